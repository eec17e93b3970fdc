"""What each package of a recipe's GPU venv costs installed: bytes and inodes (issue 39 item 3).

No multi-GB download: a wheel is a zip whose central directory (at the end of the file) lists every
member with its uncompressed size. For each package of the resolved set (hpcrl.resolve.resolve, as
tests/test_resolve.py resolves it: Linux x86_64, the site's Python) this reads only the end of its
wheel on files.pythonhosted.org with HTTP Range requests, and sums:
- bytes: the members' uncompressed sizes (what pip writes), plus the bytecode pip compiles for
  each .py (pip's default; estimated as PYC_PER_PY x the .py bytes, the ratio measured on this
  machine's own venv: see --calibrate);
- inodes: files + the directories they imply + one .pyc per .py + one __pycache__ per directory
  holding .py files (what an installed tree has on disk; GPFS counts one inode for each).
Wheels that only PyTorch's or vLLM's own indexes serve (the +cu12x builds) are not reachable from
here: the default index's build of the same version is measured instead and marked as such.

    .venv/bin/python scripts/bench_venv_size.py [--recipe gsm8k-grpo] [--site perlmutter] [--json OUT]
    .venv/bin/python scripts/bench_venv_size.py --calibrate   # .pyc/.py ratio of this machine's .venv
"""

from __future__ import annotations

import argparse
import io
import json
import os
import posixpath
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# .pyc bytes per .py byte: measured by --calibrate on this checkout's .venv (Python 3.11: torch, transformers,
# numpy, ... as pip installed them with compile on): see BENCHMARKS.md.
PYC_PER_PY = 1.32
BLOCK = 4096  # allocation unit: a small file still takes a block (said beside the apparent bytes)


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over HTTP Range requests; reads are cached in blocks so that
    zipfile's many small reads of the central directory cost a few requests."""

    CHUNK = 4 << 20

    def __init__(self, url: str):
        self.url, self.pos, self.cache = url, 0, {}
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=60) as r:
            self.size = int(r.headers["Content-Length"])
        self.requests = 0

    def seekable(self):
        return True

    def readable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def _chunk(self, i: int) -> bytes:
        if i not in self.cache:
            start, end = i * self.CHUNK, min(self.size, (i + 1) * self.CHUNK) - 1
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(req, timeout=120) as r:
                data = r.read()
            if len(data) != end - start + 1:
                raise OSError(f"{self.url}: asked {end - start + 1} bytes, got {len(data)} (no Range support?)")
            self.cache[i] = data
            self.requests += 1
        return self.cache[i]

    def read(self, n=-1):
        if n is None or n < 0:
            n = self.size - self.pos
        n = max(0, min(n, self.size - self.pos))
        out = bytearray()
        while n > 0:
            i, off = divmod(self.pos, self.CHUNK)
            piece = self._chunk(i)[off:off + n]
            out += piece
            self.pos += len(piece)
            n -= len(piece)
        return bytes(out)

    def readinto(self, b):
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def wheel_for(name: str, version: str, python: str = "3.12", glibc: str = "2.28") -> dict | None:
    """The wheel pip picks on Linux x86_64 with `glibc` for `python` (PyPI's JSON API), or None
    (sdist only)."""
    from packaging.tags import cpython_tags, compatible_tags
    from packaging.utils import parse_wheel_filename

    major, minor = (int(x) for x in python.split("."))
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(int(glibc.split(".")[1]), 4, -1)] + \
                ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    order = list(cpython_tags((major, minor), platforms=platforms)) + \
        list(compatible_tags((major, minor), interpreter=f"cp{major}{minor}", platforms=platforms))
    rank = {t: i for i, t in enumerate(order)}
    # the project's JSON (its per-version form, /pypi/NAME/VERSION/json, answers 404 through the
    # index proxy this machine reaches); its `releases` lists each version's files
    with urllib.request.urlopen(f"https://pypi.org/pypi/{name}/json", timeout=120) as r:
        releases = json.load(r)["releases"]
    from packaging.version import Version

    def same(k: str) -> bool:
        try:
            return Version(k) == Version(version)
        except ValueError:  # a pre-PEP 440 release name ("2013-02-16")
            return k == version

    files = releases.get(version) or next((v for k, v in releases.items() if same(k)), [])
    best = None
    for f in files:
        if not f["filename"].endswith(".whl"):
            continue
        _, _, _, tags = parse_wheel_filename(f["filename"])
        score = min((rank[t] for t in tags if t in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, f)
    if best is None:
        return None
    # the proxy this machine reaches answers with relative URLs ("../../packages/packages/ab/cd/..."):
    # the same file is files.pythonhosted.org/packages/ab/cd/...
    url = best[1]["url"]
    if not url.startswith("http"):
        url = "https://files.pythonhosted.org/packages/" + url.split("/packages/packages/", 1)[1]
    return {**best[1], "url": url}


CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcrl" / "wheel-members"


def measure(url: str) -> dict:
    """measure_wheel, cached by URL (a published wheel never changes)."""
    import hashlib

    f = CACHE / (hashlib.sha256(f"{PYC_PER_PY}{url}".encode()).hexdigest()[:24] + ".json")
    if f.is_file():
        return {**json.loads(f.read_text(encoding="utf-8")), "requests": 0}
    m = measure_wheel(url)
    CACHE.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(m), encoding="utf-8")
    return m


def measure_wheel(url: str) -> dict:
    """Bytes and inodes a wheel's members take once unpacked (and compiled, as pip does)."""
    rf = RangeFile(url)
    with zipfile.ZipFile(io.BufferedReader(rf, buffer_size=1 << 16)) as z:
        infos = [i for i in z.infolist() if not i.is_dir()]
    files = len(infos)
    size = sum(i.file_size for i in infos)
    blocks = sum(-(-i.file_size // BLOCK) * BLOCK for i in infos)
    dirs, py_dirs, py_bytes, py, pyc_blocks = set(), set(), 0, 0, 0
    for i in infos:
        d = posixpath.dirname(i.filename)
        while d:
            dirs.add(d)
            d = posixpath.dirname(d)
        if i.filename.endswith(".py") and ".data/" not in i.filename:
            py += 1
            py_bytes += i.file_size
            py_dirs.add(posixpath.dirname(i.filename))
            pyc_blocks += -(-int(i.file_size * PYC_PER_PY) // BLOCK) * BLOCK
    pyc = int(py_bytes * PYC_PER_PY)
    return {"files": files, "dirs": len(dirs), "py": py, "bytes": size, "pyc_bytes": pyc,
            "alloc_bytes": blocks + pyc_blocks,
            "inodes": files + len(dirs) + py + len(py_dirs), "requests": rf.requests, "wheel_bytes": rf.size}


def calibrate(site_packages: Path) -> float:
    """.pyc bytes / .py bytes over an installed site-packages (pip compiled it at install)."""
    py = pyc = 0
    for root, _, names in os.walk(site_packages):
        if not root.endswith("__pycache__"):
            continue
        src = Path(root).parent
        for n in names:
            stem = n.split(".")[0]
            s = src / f"{stem}.py"
            if n.endswith(".pyc") and s.is_file():
                py += s.stat().st_size
                pyc += (Path(root) / n).stat().st_size
    return pyc / py if py else float("nan")


def check_installed(names: list[str]) -> int:
    """Predicted (this script) against installed (the files pip's RECORD lists, stat'ed on disk) for
    packages of this checkout's .venv, with the wheel pip would pick for this machine's Python."""
    from importlib import metadata

    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    for name in names:
        dist = metadata.distribution(name)
        files = [Path(dist.locate_file(f)) for f in dist.files or []]
        on_disk = [f for f in files if f.is_file() and f.suffix != ".pyc"]
        # this checkout's setup compiles bytecode after pip (not in RECORD): count each .py's .pyc
        tag = sys.implementation.cache_tag
        on_disk += [c for f in on_disk if f.suffix == ".py"
                    for c in [f.parent / "__pycache__" / f"{f.stem}.{tag}.pyc"] if c.is_file()]
        size = sum(f.stat().st_size for f in on_disk)
        dirs = {d for f in on_disk for d in f.parents if str(d).startswith(str(dist.locate_file("")))}
        wheel = wheel_for(name, dist.version.split("+")[0], py, "2.28")
        if wheel is None:
            print(f"{name} {dist.version}: no wheel of that version on PyPI for this machine")
            continue
        m = measure(wheel["url"])
        print(f"{name} {dist.version}: installed {size / 1e6:.1f} MB, {len(on_disk) + len(dirs) - 1:,} inodes "
              f"(RECORD + bytecode); predicted {(m['bytes'] + m['pyc_bytes']) / 1e6:.1f} MB, {m['inodes']:,} inodes "
              f"({wheel['filename']})")
    return 0


def gpu_set(recipe: str, site: str) -> tuple[list[str], str, str]:
    from hpcrl import spec, venv

    resolved = spec.resolve(str(ROOT / "hpcrl" / "recipes" / f"{recipe}.yaml"), site,
                            flags={"account": "m1234_g", "hours": 4})
    stack = resolved["site"].get("gpu_stack") or {}
    # the nodes' glibc where the site states it (a wheel tagged manylinux_2_31 needs 2.31)
    return venv.requirements(resolved), str(stack.get("python_version") or "3.12"), str(stack.get("glibc") or "2.28")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="gsm8k-grpo")
    ap.add_argument("--site", default="perlmutter")
    ap.add_argument("--json", help="write the per-package figures here")
    ap.add_argument("--requirements", nargs="+", metavar="REQ",
                    help="measure this requirement set instead of the recipe's (e.g. torch==2.9.1: the default "
                         "index's CUDA 12.8 build, whose nvidia-*-cu12 libraries stand for a CUDA 12 venv's)")
    ap.add_argument("--calibrate", action="store_true", help="print the .pyc/.py ratio of this checkout's .venv")
    ap.add_argument("--check-installed", nargs="+", metavar="NAME",
                    help="the method against pip's own install: each NAME as installed in this checkout's .venv "
                         "(its RECORD's files on disk) beside what its wheel's central directory predicts")
    ns = ap.parse_args()
    if ns.check_installed:
        return check_installed(ns.check_installed)
    if ns.calibrate:
        sp = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
        print(f"{sp}: .pyc bytes / .py bytes = {calibrate(sp):.3f}")
        return 0
    from hpcrl import resolve as rs

    reqs, python, glibc = gpu_set(ns.recipe, ns.site)
    if ns.requirements:
        reqs = list(ns.requirements)
    cache = Path(os.environ.get("HPCRL_RESOLVE_CACHE") or Path.home() / ".cache" / "hpcrl" / "resolve")
    start = time.monotonic()
    res = rs.resolve(reqs, python=python, cache_dir=cache)
    print(f"# {ns.recipe} on {ns.site}: {len(res.packages)} packages for Linux x86_64, Python {python} "
          f"glibc {glibc} (resolved in {time.monotonic() - start:.0f} s{', cached' if res.cached else ''})", file=sys.stderr)
    for req, why in res.substituted.items():
        print(f"#   stand-in: {req} -> {why}", file=sys.stderr)
    stand_ins = {rs.canonical(w.split(" from ")[0].split("==")[0]) for w in res.substituted.values() if " from " in w}
    rows = []
    for pkg in sorted(res.packages.values(), key=lambda p: p.name):
        try:
            wheel = wheel_for(pkg.name, pkg.version.split("+")[0], python, glibc)
        except urllib.error.HTTPError as e:
            print(f"#   {pkg.name} {pkg.version}: PyPI's JSON API answers {e.code}: not counted", file=sys.stderr)
            continue
        if wheel is None:
            print(f"#   {pkg.name} {pkg.version}: no wheel for the platform (sdist): not counted", file=sys.stderr)
            continue
        m = measure(wheel["url"])
        rows.append({"name": pkg.name, "version": pkg.version, "wheel": wheel["filename"],
                     "stand_in": pkg.name in stand_ins, **m})
        print(f"{pkg.name:32} {m['wheel_bytes'] / 1e6:9.1f} MB wheel {(m['bytes'] + m['pyc_bytes']) / 1e6:9.1f} MB "
              f"installed {m['inodes']:7d} inodes ({m['requests']} range requests)", file=sys.stderr)
    rows.sort(key=lambda r: -(r["bytes"] + r["pyc_bytes"]))
    tot = {k: sum(r[k] for r in rows) for k in ("wheel_bytes", "bytes", "pyc_bytes", "alloc_bytes", "files", "inodes")}
    print(f"\n| package | version | wheel MB | installed MB | files | inodes |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        mark = " (default-index build)" if r["stand_in"] else ""
        print(f"| {r['name']}{mark} | {r['version']} | {r['wheel_bytes'] / 1e6:,.0f} | "
              f"{(r['bytes'] + r['pyc_bytes']) / 1e6:,.0f} | {r['files']:,} | {r['inodes']:,} |")
    installed = tot["bytes"] + tot["pyc_bytes"]
    print(f"| **total ({len(rows)} packages)** | | **{tot['wheel_bytes'] / 1e9:.2f} GB** | **{installed / 1e9:.2f} GB** | "
          f"**{tot['files']:,}** | **{tot['inodes']:,}** |")
    print(f"\ninstalled: {installed / 1e9:.2f} GB apparent ({tot['pyc_bytes'] / 1e9:.2f} GB of it bytecode), "
          f"{tot['alloc_bytes'] / 1e9:.2f} GB in {BLOCK}-byte blocks; {tot['inodes']:,} inodes; "
          f"installed/wheel = {installed / tot['wheel_bytes']:.2f}")
    cuda = [r for r in rows if r["name"].startswith(("nvidia-", "cuda-"))]
    print(f"of which NVIDIA's CUDA libraries (nvidia-*, cuda-*: {len(cuda)} packages): "
          f"{sum(r['bytes'] + r['pyc_bytes'] for r in cuda) / 1e9:.2f} GB installed, "
          f"{sum(r['wheel_bytes'] for r in cuda) / 1e9:.2f} GB of wheels")
    print(f"against Global Common's default quota (10 GB, 1,000,000 inodes): {installed / 10e9:.0%} of the space, "
          f"{tot['inodes'] / 1e6:.1%} of the inodes")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"recipe": ns.recipe, "site": ns.site, "python": python,
                                             "totals": tot, "packages": rows}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
