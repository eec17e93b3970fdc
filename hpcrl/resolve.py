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
other, and what those builds bring in is the default index's build, not theirs.
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


def resolve(requirements: list[str], python: str = "3.12", cache_dir: Path | None = None,
            can_reach=reachable) -> Resolved:
    """The packages `requirements` install on Linux x86_64 with `python` (major.minor)."""
    import time

    reqs, subs = reachable_form(list(requirements), can_reach)
    uv = uv_binary()
    version = _uv_version(uv)
    key = hashlib.sha256("\n".join([python, PLATFORM, version, *reqs]).encode()).hexdigest()[:20]
    cache = Path(cache_dir) / f"{key}.json" if cache_dir else None
    if cache and cache.is_file():
        data = json.loads(cache.read_text(encoding="utf-8"))
        return Resolved({n: Package(**p) for n, p in data["packages"].items()}, subs, data["seconds"], True)
    start = time.monotonic()
    packages = _compile(uv, reqs, python)
    took = time.monotonic() - start
    if cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"packages": {n: p.__dict__ for n, p in packages.items()}, "seconds": took},
                                  indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, cache)
    return Resolved(packages, subs, took, False)


@functools.lru_cache(maxsize=None)
def _uv_version(uv: str) -> str:
    return subprocess.run([uv, "--version"], capture_output=True, text=True).stdout.strip()


def _compile(uv: str, reqs: list[str], python: str) -> dict[str, Package]:
    with tempfile.TemporaryDirectory(prefix="hpcrl-resolve-") as tmp:
        src = Path(tmp) / "req.in"
        src.write_text("".join(f"{r}\n" for r in reqs), encoding="utf-8")
        base = [uv, "pip", "compile", str(src), "--python-version", python, "--python-platform", PLATFORM,
                "--no-header", "--quiet"]
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
