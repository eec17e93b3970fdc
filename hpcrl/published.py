"""Before anything queues: does every file the venv's requirement set names exist, for the compute
nodes' platform, on the real indexes? (issue 39: a never-published wheel used to fail the first
segment's venv build with a 404, after the queue wait.)

Asked where the venv is built on this machine (`hpcrl venv build`, `hpcrl submit`: venv.built_here),
and only when the venv is not ready yet:
- each `name==V+local` pin (+cu129, ...): the PEP 503 simple page of each index option of the set
  (INDEX/NAME/) must list a wheel of exactly that version for the nodes: Python tag cpXY (or
  cp3N-abi3 with N <= Y, or py3) for the site's gpu_stack.python_version, platform any or
  manylinux_A_B_x86_64 with A.B <= the site's gpu_stack.glibc (legacy manylinux1/2010/2014 as
  2.5/2.12/2.17);
- each direct `name @ https://...` URL: a HEAD request answers (git+ URLs are not asked).
Plain pins come from the default index, which the resolve test covers; they are not asked here.
A missing file refuses in one line naming it and what to change. A network failure (no internet
here, an index away) is a one-line warning, not a refusal: the check could not be made. Skip it
with `--no-check-artifacts`.

`HPCRL_INDEX_MAP` ("URL=LOCAL[,URL=LOCAL...]") reads an index from another base, prefix for
prefix: a local copy of an index (the suite's loopback index, tests/test_published.py). pip still
installs from the URLs the requirements name.
"""

from __future__ import annotations

import html.parser
import os
import platform
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from .artifacts import canonical
from .errors import HpcrlError

TIMEOUT_S = 30
_INDEX = re.compile(r"^--(?:extra-)?index-url\s+(\S+)$")
_LOCAL_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([0-9][^\s+;]*)\+([A-Za-z0-9.]+)$")
_DIRECT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*@\s*(https?://\S+)$")
_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
# resume has no flag of its own: `hpcrl venv build --run RUN --no-check-artifacts` builds the run's
# venv, and resume then finds it ready (the check runs only before a build)
SKIP_HINT = "build anyway with --no-check-artifacts (hpcrl venv build / submit)"


class NotPublished(HpcrlError):
    """A file the requirement set names does not exist for the compute nodes (one line, the fix)."""


@dataclass
class Target:
    """The compute nodes' platform, as wheel tags see it."""

    python: tuple[int, int] | None   # None: any CPython
    glibc: tuple[int, int]
    machine: str = "x86_64"
    glibc_from: str = "site gpu_stack.glibc"

    def describe(self) -> str:
        py = f"cp{self.python[0]}{self.python[1]}, " if self.python else ""
        return f"{py}glibc {self.glibc[0]}.{self.glibc[1]}, {self.machine}"


@dataclass
class Outcome:
    checked: list[str] = field(default_factory=list)   # what was found published
    unreachable: dict[str, str] = field(default_factory=dict)  # host -> why it could not be asked


def target(site: dict) -> Target:
    """The nodes' Python and glibc from the site (gpu_stack.python_version, gpu_stack.glibc); a site
    that states no glibc builds for this machine's own (its jobs run where this venv is built)."""
    stack = site.get("gpu_stack") or {}
    py = _version(stack.get("python_version"))
    glibc = _version(stack.get("glibc"))
    source = "site gpu_stack.glibc"
    if glibc is None:
        libc, ver = platform.libc_ver()
        glibc = _version(ver) if libc == "glibc" else None
        source = "this machine's glibc"
    return Target(py, glibc or (2, 17), platform.machine() or "x86_64", source)


def _version(text) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)", str(text or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


# ------------------------------------------------------------------ wheel tags


def parse_wheel(filename: str) -> dict | None:
    """name, version, python tags, abi tags, platform tags of a wheel file name (None: not a wheel)."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    name, version, py, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    return {"name": canonical(name), "version": version, "python": py.split("."), "abi": abi.split("."),
            "platform": plat.split(".")}


def glibc_needed(platform_tag: str, machine: str) -> tuple[int, int] | None:
    """The glibc a platform tag needs, or None when it is not a Linux tag for `machine`."""
    m = re.match(r"^manylinux_(\d+)_(\d+)_(\w+)$", platform_tag)
    if m:
        return (int(m.group(1)), int(m.group(2))) if m.group(3) == machine else None
    m = re.match(r"^(manylinux1|manylinux2010|manylinux2014)_(\w+)$", platform_tag)
    if m:
        return _LEGACY[m.group(1)] if m.group(2) == machine else None
    return None


def python_fits(wheel: dict, python: tuple[int, int] | None) -> bool:
    if python is None:
        return True
    major, minor = python
    for tag in wheel["python"]:
        m = re.match(r"^(cp|py)(\d)(\d*)$", tag)
        if not m or int(m.group(2)) != major:
            continue
        if m.group(1) == "py" and (not m.group(3) or int(m.group(3)) <= minor):
            return True
        if m.group(1) == "cp" and m.group(3):
            n = int(m.group(3))
            if n == minor or ("abi3" in wheel["abi"] and n <= minor):
                return True
    return False


def fits(wheel: dict, t: Target) -> tuple[bool, tuple[int, int] | None]:
    """(installs on the target, the lowest glibc it needs among its Linux tags for the machine)."""
    if not python_fits(wheel, t.python):
        return False, None
    if "any" in wheel["platform"]:
        return True, None
    needs = [g for g in (glibc_needed(p, t.machine) for p in wheel["platform"]) if g]
    if not needs:
        return False, None
    low = min(needs)
    return low <= t.glibc, low


# ------------------------------------------------------------------ the indexes


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.files: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href") or ""
            name = urllib.parse.unquote(href.split("#")[0].split("?")[0].rstrip("/").rsplit("/", 1)[-1])
            if name:
                self.files.append(name)


def mapped(url: str) -> str:
    """`url` as HPCRL_INDEX_MAP reads it (unchanged where no prefix matches)."""
    for pair in re.split(r"[,\s]+", os.environ.get("HPCRL_INDEX_MAP", "").strip()):
        if "=" in pair:
            src, dst = pair.split("=", 1)
            if src and url.startswith(src.rstrip("/")):
                return dst.rstrip("/") + url[len(src.rstrip("/")):]
    return url


class _Away(Exception):
    """The host could not be asked (no network, DNS, refused, timed out, 5xx)."""


def _open(url: str, method: str = "GET"):
    req = urllib.request.Request(mapped(url), method=method,
                                 headers={"Accept": "text/html", "User-Agent": "hpcrl-artifact-check"})
    try:
        return urllib.request.urlopen(req, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code in (404, 410):
            return None
        raise _Away(f"HTTP {e.code}") from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise _Away(str(getattr(reason, "strerror", None) or reason)) from None


def files_on(index: str, name: str) -> list[str] | None:
    """The file names the index's simple page lists for `name` (None: the index has no such page)."""
    page = f"{index.rstrip('/')}/{canonical(name)}/"
    resp = _open(page)
    if resp is None:
        return None
    with resp:
        parser = _Links()
        parser.feed(resp.read().decode("utf-8", "replace"))
    return parser.files


# ------------------------------------------------------------------ the check


def check(requirements, site: dict, warn=None) -> Outcome:
    """Raise NotPublished (one line) when a file the set names is not published for the site's
    compute nodes; warn (one line) when an index could not be asked. Returns what was found."""
    t = target(site)
    reqs = [str(r).strip() for r in requirements or ()]
    indexes = [m.group(1) for m in (_INDEX.match(r) for r in reqs) if m]
    out = Outcome()
    for req in reqs:
        pin, direct = _LOCAL_PIN.match(req), _DIRECT.match(req)
        if pin:
            _check_pin(pin.group(1), f"{pin.group(2)}+{pin.group(3)}", indexes, t, out)
        elif direct:
            _check_url(direct.group(1), direct.group(2), out)
    if out.unreachable:
        (warn or (lambda m: None))(
            "could not check that the venv's files are published (" +
            "; ".join(f"{h}: {why}" for h, why in out.unreachable.items()) +
            f"): building anyway (a missing file fails the build itself; --no-check-artifacts skips this check)")
    return out


def _host(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc or url


def _check_pin(name: str, version: str, indexes: list[str], t: Target, out: Outcome) -> None:
    want = f"{name}=={version}"
    fix = (f"pick a build published for the compute nodes (hpcrl/artifacts.yaml lists those checked; "
           f"site gpu_stack.cuda_variant, or the spec's requirements), or {SKIP_HINT}")
    if not indexes:
        raise NotPublished(f"{want}: a local-version pin with no --extra-index-url in the requirements; only "
                           f"another index serves it: add that index's option, or {SKIP_HINT}")
    too_new: list[tuple[str, tuple[int, int]]] = []
    asked, pages, away = [], [], False  # indexes asked; those with a page for the package
    for index in indexes:
        if _host(index) in out.unreachable:
            away = True
            continue
        try:
            files = files_on(index, name)
        except _Away as e:
            out.unreachable[_host(index)] = str(e)
            away = True
            continue
        asked.append(index)
        if files is not None:
            pages.append(index)
        for f in files or ():
            w = parse_wheel(f)
            if not w or w["name"] != canonical(name) or w["version"] != version:
                continue
            ok, needs = fits(w, t)
            if ok:
                out.checked.append(f"{want}: {f} on {index}")
                return
            if needs:
                too_new.append((f, needs))
    if away:
        return  # an index that could not be asked may hold it: the warning says so, never a refusal
    where = " or ".join(f"{i.rstrip('/')}/{canonical(name)}/" for i in (pages or asked))
    if too_new:
        f, needs = min(too_new, key=lambda x: x[1])
        raise NotPublished(f"{want}: {where} has {f}, which needs glibc {needs[0]}.{needs[1]}; the compute nodes "
                           f"have {t.glibc[0]}.{t.glibc[1]} ({t.glibc_from}): {fix}")
    wheel = f"{canonical(name).replace('-', '_')}-{version}-*.whl"
    raise NotPublished(f"{want}: no file {wheel} for the compute nodes ({t.describe()}) on {where}: {fix}")


def _check_url(name: str, url: str, out: Outcome) -> None:
    if _host(url) in out.unreachable:
        return
    try:
        resp = _open(url, "HEAD")
    except _Away as e:
        out.unreachable[_host(url)] = str(e)
        return
    if resp is None:
        raise NotPublished(f"{name} @ {url}: not found (HTTP 404): the file was never published or has moved; "
                           f"fix the URL in the requirements, or {SKIP_HINT}")
    resp.close()
    out.checked.append(f"{name} @ {url}")
