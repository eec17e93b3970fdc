"""A requirement set resolved for the machine it will be installed on, without installing it.

`uv pip compile --python-version X --python-platform x86_64-manylinux_2_28` reads the wheels'
own metadata from the index this machine reaches and picks the wheels that a Linux x86_64 node
with that Python would install (notes/gpu-stack.md). Two compiles: the annotated
requirements.txt says which package pulled which ("# via"), the pylock.toml names each chosen
wheel with its size. The answer is cached under `cache_dir` keyed by everything that decides it
(requirements, Python, platform, uv's version), so a rerun costs nothing; a failed resolve is
never cached (the index may only have been away).

Index options (`--extra-index-url URL`) and direct wheel URLs that this machine cannot reach
(PyTorch's and vLLM's CUDA 12 builds) are replaced for the resolve by the same versions from the
default index, and said so in `Resolved.substituted`: the versions are checked against each
other, and what those builds bring in is the default index's build, not theirs. A stand-in never
decides that the build it stands for exists: hpcrl/artifacts.yaml (cited sources) and, where the
internet is, hpcrl/published.py (the real indexes) do.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PLATFORM = "x86_64-manylinux_2_28"
_INDEX_OPTION = re.compile(r"^--(extra-)?index-url\s+(\S+)$")
_DIRECT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*@\s*(\S+)$")
_WHEEL_VERSION = re.compile(r"/[A-Za-z0-9_.]+-([0-9][^-/]*)-[^/]+\.whl$")
_TORCH_BACKEND = re.compile(r"^--torch-backend[= ](\S+)$")
# uv: "Because there is no version of torch==2.11.0+cpu and ..."
_NO_VERSION = re.compile(r"there is no version of ([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s+]+)\+(\w+)")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)$")


class ResolveError(Exception):
    """uv could not resolve the set (the message is uv's own explanation) or could not run."""


@dataclass
class Package:
    name: str
    version: str
    size: int | None = None          # bytes of the wheel chosen for the platform (None: an sdist)
    via: list[str] = field(default_factory=list)  # parents; "-r" for a requirement of the set itself


@dataclass
class Resolved:
    packages: dict[str, Package]
    substituted: dict[str, str]      # requirement as rendered -> what was resolved in its place, and why
    seconds: float = 0.0
    cached: bool = False

    @property
    def wheel_bytes(self) -> int:
        return sum(p.size or 0 for p in self.packages.values())


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def uv_binary() -> str:
    here = Path(sys.executable).parent / "uv"
    found = str(here) if here.exists() else shutil.which("uv")
    if not found:
        raise ResolveError("uv is not installed: pip install 'hpcrl[test]' (it pins uv)")
    return found


@functools.lru_cache(maxsize=None)
def reachable(url: str, timeout: float = 5.0) -> bool:
    """Whether this machine reaches `url`'s host at all (any HTTP answer counts); asked once per process."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def reachable_form(requirements: list[str], can_reach=reachable) -> tuple[list[str], dict[str, str]]:
    """The set as uv can resolve it here: unreachable index options dropped (their local-version
    pins `X==V+cuNNN` become `X==V`), unreachable direct wheel URLs replaced by `name==version`."""
    out, subs = [], {}
    unreachable_index = False
    for req in requirements:
        m = _INDEX_OPTION.match(req.strip())
        if m and not can_reach(m.group(2)):
            subs[req] = f"dropped: {m.group(2)} is not reachable from here"
            unreachable_index = True
            continue
        out.append(req)
    final = []
    for req in out:
        direct, pin = _DIRECT.match(req.strip()), _PIN.match(req.strip())
        if direct and not can_reach(direct.group(2)):
            version = _WHEEL_VERSION.search(direct.group(2))
            plain = version.group(1).split("+")[0] if version else ""
            new = f"{direct.group(1)}=={plain}" if plain else direct.group(1)
            subs[req] = f"{new} from the default index ({direct.group(2)} is not reachable from here)"
            final.append(new)
        elif pin and "+" in pin.group(3) and unreachable_index:
            new = f"{pin.group(1)}{pin.group(2) or ''}=={pin.group(3).split('+')[0]}"
            subs[req] = f"{new} from the default index (its +{pin.group(3).split('+')[1]} build's index is not reachable)"
            final.append(new)
        else:
            final.append(req)
    return final, subs


def reachable_options(options: list[str], can_reach=reachable) -> tuple[list[str], dict[str, str], list[str]]:
    """uv options as they can run here: `--torch-backend=B` needs PyTorch's index for B; where it
    is unreachable the option is dropped (and said so), and the set's `X==V+B` pins (MaxText's
    metadata pins torch==2.11.0+cpu) are resolved as `X==V` from the default index instead.
    Returns (options, substituted, local tags whose pins become plain)."""
    out, subs, plain_tags = [], {}, []
    for opt in options:
        backend = _TORCH_BACKEND.match(opt)
        if backend and not can_reach(f"https://download.pytorch.org/whl/{backend.group(1)}/"):
            subs[opt] = f"dropped: https://download.pytorch.org/whl/{backend.group(1)}/ is not reachable from here"
            plain_tags.append(backend.group(1))
            continue
        out.append(opt)
    return out, subs, plain_tags


def resolve(requirements: list[str], python: str = "3.12", cache_dir: Path | None = None,
            can_reach=reachable, platform: str = PLATFORM, options: list[str] = ()) -> Resolved:
    """The packages `requirements` install on Linux `platform` with `python` (major.minor), with
    uv's own `options` (--torch-backend=B, --resolution=lowest, --override=FILE) as installed."""
    import time

    reqs, subs = reachable_form(list(requirements), can_reach)
    opts, opt_subs, plain_tags = reachable_options(list(options), can_reach)
    subs.update(opt_subs)
    uv = uv_binary()
    version = _uv_version(uv)
    overrides = [Path(o.split("=", 1)[1]).read_text(encoding="utf-8") for o in opts if o.startswith("--override=")]
    # an override file by its content, not its path: the path is the checkout's (a fresh clone, a
    # new path), and keying by it made every clone resolve MaxText's set again (~50-160 s)
    named = [o for o in opts if not o.startswith("--override=")]
    key = hashlib.sha256("\n".join([python, platform, version, *reqs, *named, *overrides]).encode()).hexdigest()[:20]
    cache = Path(cache_dir) / f"{key}.json" if cache_dir else None
    if cache and cache.is_file():
        data = json.loads(cache.read_text(encoding="utf-8"))
        subs.update(data.get("substituted", {}))
        return Resolved({n: Package(**p) for n, p in data["packages"].items()}, subs, data["seconds"], True)
    start = time.monotonic()
    packages, plain = _compile_plain_tags(uv, reqs, python, platform, opts, plain_tags)
    subs.update(plain)
    took = time.monotonic() - start
    if cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"packages": {n: p.__dict__ for n, p in packages.items()}, "seconds": took,
                                   "substituted": plain},
                                  indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, cache)
    return Resolved(packages, subs, took, False)


@functools.lru_cache(maxsize=None)
def _uv_version(uv: str) -> str:
    return subprocess.run([uv, "--version"], capture_output=True, text=True).stdout.strip()


def _compile_plain_tags(uv: str, reqs: list[str], python: str, platform: str, opts: list[str],
                        plain_tags: list[str]) -> tuple[dict[str, Package], dict[str, str]]:
    """_compile; where a dropped torch backend's `X==V+B` pin has no version on the default index,
    again with the override `X==V` (one package at a time, as uv names them)."""
    plain: dict[str, str] = {}
    for _ in range(8):
        try:
            return _compile(uv, reqs, python, platform, opts, list(plain.values())), {
                f"{k} (a dependency's pin)": f"{v} from the default index (its build's index is not reachable)"
                for k, v in plain.items()}
        except ResolveError as e:
            missing = _NO_VERSION.search(str(e))
            pin = missing and f"{missing.group(1)}=={missing.group(2)}+{missing.group(3)}"
            if not missing or missing.group(3) not in plain_tags or pin in plain:
                raise
            plain[pin] = f"{missing.group(1)}=={missing.group(2)}"
    raise ResolveError("too many local-version pins to resolve without their index")


def _compile(uv: str, reqs: list[str], python: str, platform: str = PLATFORM, opts: list[str] = (),
             more_overrides: list[str] = ()) -> dict[str, Package]:
    with tempfile.TemporaryDirectory(prefix="hpcrl-resolve-") as tmp:
        src = Path(tmp) / "req.in"
        src.write_text("".join(f"{r}\n" for r in reqs), encoding="utf-8")
        extra_opts = []
        overrides = [Path(o.split("=", 1)[1]).read_text(encoding="utf-8") for o in opts if o.startswith("--override=")]
        if overrides or more_overrides:  # one overrides file: the set's own, then the stand-ins for its dropped builds
            ov = Path(tmp) / "overrides.txt"
            ov.write_text("\n".join([*overrides, *more_overrides, ""]), encoding="utf-8")
            extra_opts = ["--override", str(ov)]
        extra_opts += [o for o in opts if not o.startswith("--override=")]
        base = [uv, "pip", "compile", str(src), "--python-version", python, "--python-platform", platform,
                "--no-header", "--quiet", *extra_opts]
        env = {**os.environ, "UV_NO_CONFIG": "1"}
        txt, lock = Path(tmp) / "req.txt", Path(tmp) / "pylock.toml"
        for extra in (["-o", str(txt)], ["--format", "pylock.toml", "-o", str(lock)]):
            proc = subprocess.run(base + extra, capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode != 0:
                raise ResolveError(" ".join(proc.stderr.split())[-1500:] or f"uv exited {proc.returncode}")
        packages = _parse_annotated(txt.read_text(encoding="utf-8"))
        _add_sizes(packages, lock.read_text(encoding="utf-8"))
    return packages


def _parse_annotated(text: str) -> dict[str, Package]:
    packages: dict[str, Package] = {}
    current = None
    for line in text.splitlines():
        pin = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*(?:==|@)\s*(\S+)", line)
        if pin:
            current = Package(canonical(pin.group(1)), pin.group(2))
            packages[current.name] = current
            continue
        via = re.match(r"^\s*#\s+(?:via\s+)?(\S+)", line)
        if current and via and via.group(1) != "via":
            parent = via.group(1)
            current.via.append("-r" if parent == "-r" else canonical(parent))
    return packages


def _add_sizes(packages: dict[str, Package], pylock: str) -> None:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the sizes are a report, not a condition
        return
    for entry in tomllib.loads(pylock).get("packages", []):
        pkg = packages.get(canonical(entry.get("name", "")))
        wheels = entry.get("wheels") or []
        if pkg is not None and wheels:
            pkg.size = sum(int(w.get("size") or 0) for w in wheels[:1])


# ------------------------------------------------------------------ what CUDA a resolved set needs

_SUFFIX = re.compile(r"-cu(\d\d)$")
_LOCAL = re.compile(r"\+cu(\d\d)(\d)$")


def cuda_major(pkg: Package) -> int | None:
    """The CUDA major version this package's build needs, when its name or version says so."""
    suffix = _SUFFIX.search(pkg.name)
    if suffix:
        return int(suffix.group(1))
    if pkg.name in ("cuda-toolkit", "nvidia-cuda-runtime"):
        return int(pkg.version.split(".")[0])
    local = _LOCAL.search(pkg.version)
    if local:
        return int(local.group(1))
    return None


def attributed(resolved: Resolved, name: str, replaced: set[str], _seen=None) -> bool:
    """Whether `name` is in the set only through `replaced` packages (resolved from the default
    index in place of a build this machine cannot reach): its own build is then not the one a
    real install would get."""
    seen = _seen if _seen is not None else set()
    pkg = resolved.packages.get(name)
    if pkg is None or name in seen:
        return True
    seen.add(name)
    if not pkg.via or "-r" in pkg.via:
        return False
    return all(parent in replaced or attributed(resolved, parent, replaced, seen) for parent in pkg.via)
