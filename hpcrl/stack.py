"""The GPU builds a site's driver can run: which torch / vLLM wheels a GPU venv installs, and from
which index (site profile key `gpu_stack`; docs/perlmutter.md).

The default index serves one build per version, and since torch 2.11 / vLLM 0.24 that build is
CUDA 13 (R580 drivers or newer; notes/gpu-stack.md). A GPU site whose driver supports CUDA 12
states it (`driver_cuda`) and the variant its venvs install (`cuda_variant`, e.g. cu129); the
requirement set then names that build explicitly, from the indexes each project publishes it on
(every one listed, with its public source, in hpcrl/artifacts.yaml):
- PyTorch: `--extra-index-url https://download.pytorch.org/whl/cu129` and `torch==2.11.0+cu129`
  (torchvision / torchaudio likewise): the local version can only come from that index, so pip
  cannot settle on the default index's CUDA 13 wheel.
- vLLM: `--extra-index-url https://wheels.vllm.ai/0.24.0/cu129` and `vllm==0.24.0+cu129`, its
  per-version index. vLLM publishes CUDA 12 builds as +cu129 only (vllm issue 42756: "We only
  release cu129 and cu130 wheels"; there never was a +cu128 0.24.0 wheel). An index rather than
  the release asset's URL: the pin says which build, pip picks the file for the node's platform
  tags, and the login-node check (hpcrl/published.py) reads the same index page pip will.
Explicit pins rather than uv's `--torch-backend=auto`: that picks the backend from the driver of
the machine that builds the venv (a login node, not always the compute nodes' driver), covers
only PyTorch's own packages (not vLLM's wheel: with --torch-backend=cu129 alone the default CUDA 13
vLLM wheel needs libcudart.so.13, vllm issue 44335), needs uv where the venv is built, and the
rendered requirements would not say which build gets installed. Here the script lists exactly
what is installed and from where, pip builds it, and the resolve test checks it.

One torch for every GPU venv (2.11.0): vLLM 0.24.0 and verl 0.9.1 pin it, and its +cu129 build is
the one vLLM's cu129 wheels are built against (users' environments in vllm issue 44335).
"""

from __future__ import annotations

import re

TORCH_INDEX = "https://download.pytorch.org/whl/{variant}"
VLLM_INDEX = "https://wheels.vllm.ai/{version}/{variant}"  # vLLM's per-version index of one CUDA build
GPU_TORCH = "2.11.0"
# The CUDA 12 build that both PyTorch and vLLM publish for these versions (hpcrl/artifacts.yaml
# cites where): what a fix names, never a build that was not published. A CUDA 13 driver runs the
# default index's build (cuda_variant null).
PUBLISHED_VARIANT = {12: "cu129"}
TORCH_FAMILY = ("torch", "torchvision", "torchaudio")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s+;]+)$")


def facts(site: dict) -> dict:
    return dict(site.get("gpu_stack") or {})


def variant(site: dict) -> str | None:
    """The CUDA build a GPU venv installs on this site (cu129, ...), or None: the default
    index's build (a site without GPUs, or one that states no driver)."""
    if not int(site.get("gpus_per_node") or 0):
        return None
    v = facts(site).get("cuda_variant")
    return str(v) if v else None


def variant_cuda(v: str) -> str:
    """cu129 -> '12.9'."""
    digits = v.removeprefix("cu")
    return f"{digits[:-1]}.{digits[-1]}"


def cuda_major(version) -> int | None:
    m = re.match(r"^\s*(\d+)", str(version or ""))
    return int(m.group(1)) if m else None


def pin_builds(requirements: list[str], site: dict) -> list[str]:
    """`requirements` with the site's CUDA variant named explicitly (unchanged without one)."""
    v = variant(site)
    if v is None:
        return list(requirements)
    out, indexes = [], [TORCH_INDEX.format(variant=v)]
    for req in requirements:
        pin = _PIN.match(req.strip())
        name = pin.group(1).lower() if pin else ""
        if name == "torch":
            out.append(f"torch=={GPU_TORCH}+{v}")
        elif name in TORCH_FAMILY:
            out.append(f"{name}=={pin.group(2)}+{v}")
        elif name == "vllm":
            out.append(f"vllm=={pin.group(2)}+{v}")
            indexes.append(VLLM_INDEX.format(version=pin.group(2), variant=v))
        else:
            out.append(req)
    if out == list(requirements):  # nothing of PyTorch's or vLLM's: nothing to choose a build of
        return out
    return [f"--extra-index-url {url}" for url in indexes] + out


def build_of(requirements) -> str | None:
    """The CUDA a requirement set's torch is built for ('12.9'), or None when it does not say."""
    for req in requirements or ():
        m = re.match(r"^torch==[^+\s]+\+(cu\d+)$", str(req).strip())
        if m:
            return variant_cuda(m.group(1))
    return None


def gpu_check(site: dict, trainer) -> bool:
    """Whether a segment starts with hpcrl.gpucheck: a trainer that runs on GPUs, on a site that
    has GPUs and states its driver (test clusters with stand-in GPUs state none)."""
    return bool(getattr(trainer, "uses_gpus", False) and int(site.get("gpus_per_node") or 0)
                and facts(site).get("driver_cuda"))


# ------------------------------------------------------------------ sizes

# Installed size over wheel size, measured from every wheel's own file list (bytecode included) of
# gsm8k-grpo's GPU set: 4.31 GB of wheels install as 10.22 GB (scripts/bench_venv_size.py,
# BENCHMARKS.md "The GPU venv's size"; CUDA libraries unpack ~1.4x, Python code ~5-9x). Applied to
# other sets it is an estimate, said as one.
INSTALLED_PER_WHEEL = 2.37


def size_key(site: dict, requirements: list[str]) -> str:
    """The key of a requirement set in hpcrl/stack_sizes.py (as render.venv_path hashes it)."""
    import hashlib

    return hashlib.sha256("\n".join([str(site.get("python")), *sorted(requirements)]).encode()).hexdigest()[:12]


def size_of(site: dict, requirements: list[str]) -> dict | None:
    """The resolved wheels' size of this set, when tests/test_resolve.py measured it (hpcrl/stack_sizes.py)."""
    from .stack_sizes import SIZES

    return SIZES.get(size_key(site, requirements))


def describe_size(size: dict | None) -> str:
    if not size:
        return ""
    gb = size["wheels_bytes"] / 1e9
    return (f"{gb:.1f} GB of wheels for Linux x86_64 ({size['packages']} packages), ~{gb * INSTALLED_PER_WHEEL:.0f} GB "
            f"installed (estimate)")


# ------------------------------------------------------------------ NCCL across nodes

PLUGIN_GLOB = "libnccl-net*.so*"  # the network plugin NCCL looks for on the library path


def nccl_setup(site: dict, nodes: int) -> dict | None:
    """The site's NCCL set-up for a run of `nodes` nodes ({'modules': [...], 'env': {...}}), or None
    (one node: NCCL stays inside the node; a site that states none)."""
    nccl = facts(site).get("nccl") or {}
    if int(nodes or 1) < 2 or not nccl:
        return None
    env = {str(k): str(v) for k, v in (nccl.get("env") or {}).items()}
    bad = next((k for k in env if not re.match(r"[A-Za-z_][A-Za-z0-9_]*\Z", k)), None)
    if bad is not None:
        from .errors import SiteError

        raise SiteError(f"site '{site.get('name')}': gpu_stack.nccl.env: {bad!r} is not a variable name; "
                        f"use letters, digits and _")
    return {"modules": [str(m) for m in nccl.get("modules") or []], "env": env}
