"""Every GPU and TPU recipe's venv resolves for the machine it is built for (issue 31).

Each recipe's complete requirement set as `hpcrl render --site perlmutter` renders it is resolved
for Linux x86_64 and the site's Python (`uv pip compile --python-platform`, metadata only: a
dry run, not an install) against the package index this machine reaches, and fails on:
- a pin that cannot be resolved, or two that conflict (uv's own explanation is the message);
- a CUDA major above the one the site's driver supports (site.gpu_stack.driver_cuda), read from
  the resolved set: cuda-toolkit / nvidia-cuda-runtime versions, nvidia-*-cuNN names, torch's
  local version (+cuNNN);
- a package the trainer imports at run time (Trainer.runtime_packages) that is not installed.

Where a build lives only on an index this machine cannot reach (PyTorch's +cu129 wheels on
download.pytorch.org, vLLM's +cu129 wheels on wheels.vllm.ai), the same versions are resolved
from the default index, and the rendered index option and the build's CUDA tag are checked
instead: the report below says which (it is printed, never skipped). Such a stand-in only
simulates the install (versions against each other, what else comes in): it never decides that
the build exists. That is the manifest's job (hpcrl/artifacts.yaml, each file with the public
source that shows it was published; tests/test_artifacts.py fails on a render that names one it
lacks) and, where the internet is, the login-node check against the real indexes
(hpcrl/published.py, before `venv build` / `submit`).

Resolves are cached by requirement set (~/.cache/hpcrl/resolve, or $HPCRL_RESOLVE_CACHE): the
first run needs the package index (~20 s per distinct set), a rerun is instant.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from helpers import ROOT
from hpcrl import resolve as rs

GPU_SITE = "perlmutter"
GPU_RECIPES = ["gsm8k-grpo", "gsm8k-gspo", "countdown-grpo", "mbpp-code-grpo", "tinyzero-countdown-builtin",
               "tinyzero-countdown-ppo", "tinyzero-countdown-grpo", "verl-gsm8k-grpo", "verl-gsm8k-gspo"]
CACHE = Path(os.environ.get("HPCRL_RESOLVE_CACHE") or Path.home() / ".cache" / "hpcrl" / "resolve")


RESOLVED: dict[str, rs.Resolved] = {}  # name -> its resolve, for the size table below


TPU_RECIPES = ["maxtext-llama3.1-8b-grpo", "maxtext-llama3.1-8b-gspo"]


def tpu_case(recipe: str) -> tuple[list[str], list[str]]:
    """A TPU recipe's VM venv as MaxText 0.2.5 documents it: (requirement lines, uv options)."""
    import yaml

    from hpcrl.trainers.maxtext import tpu_requirements

    spec = yaml.safe_load((ROOT / "hpcrl" / "recipes" / f"{recipe}.yaml").read_text(encoding="utf-8"))
    return tpu_requirements({"spec": {"requirements": spec.get("requirements") or []}})


def gpu_case(recipe: str) -> tuple[dict, list[str]]:
    from hpcrl import spec, venv

    resolved = spec.resolve(str(ROOT / "hpcrl" / "recipes" / f"{recipe}.yaml"), GPU_SITE,
                            flags={"account": "m1234_g", "hours": 4})
    return resolved, venv.requirements(resolved)


def conflicting_pins(requirements: list[str]) -> list[str]:
    pins: dict[str, set[str]] = {}
    for req in requirements:
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(\S+)$", req.strip())
        if m:
            pins.setdefault(rs.canonical(m.group(1)), set()).add(m.group(2))
    return [f"{name}: {' vs '.join(sorted(v))}" for name, v in pins.items() if len(v) > 1]


def check_set(name: str, requirements: list[str], python: str, driver_cuda: str | None, runtime: list[str],
              platform: str = rs.PLATFORM, options: list[str] = ()) -> list[str]:
    """The problems of one requirement set (empty: it installs and runs on its target); prints the
    report. driver_cuda None: a TPU VM (no CUDA to check)."""
    problems = [f"conflicting pins {c}" for c in conflicting_pins(requirements)]
    if problems:
        return problems
    try:
        res = rs.resolve(requirements, python=python, cache_dir=CACHE, platform=platform, options=options)
    except rs.ResolveError as e:
        return [f"does not resolve for Linux x86_64, Python {python}: {e}"]
    driver = int(str(driver_cuda).split(".")[0]) if driver_cuda else 99
    replaced = {rs.canonical(re.split(r"[=@\[ ]", new.split(" from ")[0])[0]) for new in res.substituted.values()
                if " from " in new}
    majors: dict[str, int] = {}
    excused = 0
    for pkg in res.packages.values():
        major = rs.cuda_major(pkg)
        if major is not None and rs.attributed(res, pkg.name, replaced):
            excused += 1  # the default index's build of a replaced package brought it: not installed
        elif major is not None:
            majors[f"{pkg.name}=={pkg.version}"] = major
    problems += [f"{what} needs CUDA {major}, the site's driver supports {driver_cuda}"
                 for what, major in sorted(majors.items()) if major > driver]
    # checked from the rendered options instead; whether the substituted build was published at
    # all is not decided here (a stand-in resolves whatever is named): tests/test_artifacts.py
    for req, why in res.substituted.items():
        tag = re.search(r"\+cu(\d\d)\d", req)
        if tag and int(tag.group(1)) > driver:
            problems.append(f"{req} is a CUDA {tag.group(1)} build, the site's driver supports {driver_cuda}")
    # a dependency's +cpu pin resolved plain here: the torch backend that serves it must be rendered
    cpu_pins = [r for r in res.substituted if re.search(r"==\S+\+cpu\b", r)]
    if cpu_pins and "--torch-backend=cpu" not in options:
        problems.append(f"{cpu_pins[0]} is pinned with no torch backend that serves it")
    local = [r for r in res.substituted if re.search(r"==\S+\+cu\d+$", r)]
    if local and not any(r.startswith(("--extra-index-url ", "--index-url ")) for r in requirements):
        problems.append(f"{local[0]} is pinned with no index option that serves it")
    problems += [f"the trainer imports {p} at run time, and the set does not install it"
                 for p in runtime if rs.canonical(p) not in res.packages]
    RESOLVED[name] = res
    print(f"\n[{name}] Python {python}, Linux {platform}, driver CUDA {driver_cuda or 'none (TPU)'}: {len(res.packages)} packages, "
          f"wheels {res.wheel_bytes / 1e9:.2f} GB, CUDA majors {sorted(set(majors.values())) or 'none named'}"
          f"{f'; {excused} CUDA packages came with the default-index stand-ins, not checked' if excused else ''}"
          f"{' (cached)' if res.cached else f' ({res.seconds:.0f} s)'}")
    for req, why in res.substituted.items():
        print(f"  not reachable here, checked from the rendered requirements instead: {req} -> {why}")
    return problems


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipe_venv_resolves_for_its_site(recipe):
    from hpcrl.trainers import get_trainer

    resolved, reqs = gpu_case(recipe)
    stack = resolved["site"].get("gpu_stack") or {}
    assert stack.get("driver_cuda"), f"site {GPU_SITE} states no gpu_stack.driver_cuda"
    runtime = get_trainer(resolved["spec"]["trainer"]).runtime_packages(resolved["spec"]["args"])
    problems = check_set(recipe, reqs, str(stack.get("python_version") or "3.12"), stack["driver_cuda"], runtime)
    assert not problems, f"{recipe} on {GPU_SITE}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("recipe", TPU_RECIPES)
def test_tpu_recipe_venv_resolves_as_maxtext_documents_it(recipe):
    """The VM's venv: maxtext[tpu-post-train] with uv's CPU torch backend, lowest resolution and the
    wheel's overrides (jax/libtpu/flax), for the TPU VM's Python and glibc. The GitHub-pinned vLLM,
    tpu-inference and Tunix commits are installed after it by MaxText's own command (no resolve)."""
    from hpcrl.trainers.maxtext import TPU_PYTHON, TPU_PYTHON_PLATFORM

    lines, options = tpu_case(recipe)
    problems = check_set(recipe, lines, TPU_PYTHON, None, [], platform=TPU_PYTHON_PLATFORM, options=options)
    assert not problems, f"{recipe} on a TPU VM:\n  " + "\n  ".join(problems)
    res = RESOLVED[recipe]
    for pkg, version in (("jax", "0.11.0"), ("libtpu", "0.0.44"), ("flax", "0.12.8")):
        assert res.packages[pkg].version == version, (pkg, res.packages[pkg].version)


def test_maxtexts_set_from_the_default_index_alone_does_not_resolve():
    """What the VM installed before (`pip install maxtext[tpu-post-train]==0.2.5`, default index):
    the extra's torch==2.11.0+cpu exists on no index it reads."""
    from hpcrl.trainers.maxtext import TPU_PYTHON, TPU_PYTHON_PLATFORM

    lines, _ = tpu_case(TPU_RECIPES[0])
    problems = check_set("maxtext@default-index", lines, TPU_PYTHON, None, [], platform=TPU_PYTHON_PLATFORM)
    assert len(problems) == 1 and "torch==2.11.0+cpu" in problems[0], problems


def test_the_checks_catch_what_they_are_for():
    """Each failure the recipes must not have, on a set that has it (no network: parsing only)."""
    assert conflicting_pins(["torch==2.13.0", "vllm==0.24.0", "torch==2.11.0"]) == ["torch: 2.11.0 vs 2.13.0"]
    pkgs = {n: rs.Package(n, v, via=via) for n, v, via in [
        ("torch", "2.11.0", ["-r"]), ("cuda-toolkit", "13.0.2", ["torch"]), ("nvidia-nccl-cu13", "2.28", ["torch"]),
        ("numpy", "2.5.5", ["-r", "torch"]), ("nvidia-cutlass-dsl-libs-cu13", "4.4", ["nvidia-cutlass-dsl"]),
        ("nvidia-cutlass-dsl", "4.4", ["vllm"]), ("vllm", "0.24.0", ["-r"])]}
    res = rs.Resolved(pkgs, {})
    assert {n: rs.cuda_major(p) for n, p in pkgs.items() if rs.cuda_major(p)} == {
        "cuda-toolkit": 13, "nvidia-nccl-cu13": 13, "nvidia-cutlass-dsl-libs-cu13": 13}
    assert rs.cuda_major(rs.Package("torch", "2.11.0+cu128")) == 12
    # attributed to a replaced build: only what comes in through it alone
    assert rs.attributed(res, "cuda-toolkit", {"torch"}) and not rs.attributed(res, "cuda-toolkit", {"vllm"})
    assert rs.attributed(res, "nvidia-cutlass-dsl-libs-cu13", {"vllm"})
    assert not rs.attributed(res, "torch", {"torch"}), "a requirement of the set itself is never excused"
    # unreachable index options: local-version pins and direct wheel URLs resolved as plain versions
    # (stand-ins for the install only: whether each build exists is hpcrl/artifacts.yaml's to say)
    reqs, subs = rs.reachable_form(
        ["--extra-index-url https://download.pytorch.org/whl/cu129", "--extra-index-url https://wheels.vllm.ai/0.24.0/cu129",
         "torch==2.11.0+cu129", "numpy>=1.26", "vllm==0.24.0+cu129",
         "flash-attn @ https://example.org/flash_attn-2.8.3+cu12torch2.11-cp312-cp312-linux_x86_64.whl"],
        can_reach=lambda url: False)
    assert reqs == ["torch==2.11.0", "numpy>=1.26", "vllm==0.24.0", "flash-attn==2.8.3"] and len(subs) == 5
    reqs, subs = rs.reachable_form(["--extra-index-url https://x/cu129", "torch==2.11.0+cu129"], can_reach=lambda u: True)
    assert reqs == ["--extra-index-url https://x/cu129", "torch==2.11.0+cu129"] and not subs


def test_a_driver_older_than_the_build_fails_the_set():
    """The same recipe on a site whose driver is CUDA 11: its +cu129 builds are named as too new."""
    resolved, reqs = gpu_case("verl-gsm8k-grpo")
    problems = check_set("verl-gsm8k-grpo@cuda11", reqs, "3.12", "11.8", [])
    assert any("torch==2.11.0+cu129 is a CUDA 12 build" in p for p in problems), problems
    assert any("vllm==0.24.0+cu129 is a CUDA 12 build" in p for p in problems), problems
    problems = check_set("verl-gsm8k-grpo@flash", reqs, "3.12", "12.4", ["flash-attn"])
    assert problems == ["the trainer imports flash-attn at run time, and the set does not install it"]


def test_size_table_matches_each_recipes_resolved_wheels():
    """hpcrl/stack_sizes.py (what render, venv build and doctor show) holds each GPU recipe's
    resolved wheel bytes; HPCRL_UPDATE_GOLDENS=1 rewrites it."""
    import pprint

    from hpcrl import stack
    from hpcrl.stack_sizes import SIZES

    want: dict = {}
    for recipe in GPU_RECIPES:
        resolved, reqs = gpu_case(recipe)
        stack_facts = resolved["site"]["gpu_stack"]
        res = rs.resolve(reqs, python=str(stack_facts.get("python_version") or "3.12"), cache_dir=CACHE)
        key = stack.size_key(resolved["site"], reqs)
        largest = sorted(((p.size or 0, p.name) for p in res.packages.values()), reverse=True)[:5]
        entry = want.setdefault(key, {"recipes": [], "wheels_bytes": res.wheel_bytes, "packages": len(res.packages),
                                      "largest": [[n, round(s / 1e6)] for s, n in largest],
                                      "stand_ins": sorted(r for r in res.substituted if not r.startswith("--"))})
        entry["recipes"].append(recipe)
    path = ROOT / "hpcrl" / "stack_sizes.py"
    if os.environ.get("HPCRL_UPDATE_GOLDENS") == "1":
        text = path.read_text(encoding="utf-8")
        path.write_text(text[:text.index("SIZES: dict = ")] + "SIZES: dict = " + pprint.pformat(want, width=110)
                        + "\n", encoding="utf-8")
        return
    stale = "hpcrl/stack_sizes.py is stale: rerun this test with HPCRL_UPDATE_GOLDENS=1"
    assert sorted(SIZES) == sorted(want), stale  # a requirement set changed
    for key, entry in want.items():
        # ranges (transformers>=5.0,<5.20, ...) resolve to newer releases over time: 10% leeway
        assert SIZES[key]["recipes"] == entry["recipes"], stale
        assert abs(SIZES[key]["wheels_bytes"] - entry["wheels_bytes"]) <= 0.1 * entry["wheels_bytes"], stale


def test_an_override_file_is_keyed_by_its_content_not_its_path(tmp_path, monkeypatch):
    """A fresh clone puts MaxText's override file at a new path: the cached resolve still applies
    (keyed by the path, every CI clone resolved the TPU set again, 50-160 s); new content does not."""
    compiled = []
    monkeypatch.setattr(rs, "_compile_plain_tags", lambda *a: (compiled.append(a), ({}, {}))[1])
    here, there = tmp_path / "a" / "overrides.txt", tmp_path / "b" / "overrides.txt"
    for path in (here, there):
        path.parent.mkdir()
        path.write_text("jax==0.7.2\n")
    reach = lambda url: True  # noqa: E731 (nothing to substitute: only the key is under test)
    first = rs.resolve(["maxtext==0.2.5"], cache_dir=tmp_path / "c", can_reach=reach, options=[f"--override={here}"])
    again = rs.resolve(["maxtext==0.2.5"], cache_dir=tmp_path / "c", can_reach=reach, options=[f"--override={there}"])
    assert (first.cached, again.cached, len(compiled)) == (False, True, 1)
    there.write_text("jax==0.7.1\n")
    assert not rs.resolve(["maxtext==0.2.5"], cache_dir=tmp_path / "c", can_reach=reach,
                          options=[f"--override={there}"]).cached
