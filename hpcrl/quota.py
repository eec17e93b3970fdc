"""Room for a venv, read before anything is built or queued (issue 39).

A directory quota is the project's, not the file system's: `df` on /global/common/software shows a
shared file system with terabytes free while the project's 10 GB are full, and pip then dies
mid-install ("Disk quota exceeded") with a half-written venv. So the site profile names, per
file system, the command that reports the project's quota (`venv_quota`: a list of
{under: PATH-PREFIX, command: "cmnquota {project}"}); before a venv is built its estimated size
(bytes and inodes) is weighed against what that command says is left, and a venv that does not
fit is refused in one line naming the fix. Where the command does not exist (not at that
centre: this machine, a test cluster) nothing is checked and nothing is said; where it fails or
prints what this parser does not know, a one-line warning says the quota was not checked.

The parser reads the table NERSC's `cmnquota` / `cfsquota` print (on Perlmutter these are
`showquota` under their old names, which keeps each one's old output format; NERSC's quota page):
    -------- Space (GB) ------- ------ Inode --------
    Project Usage Quota Percent Usage Quota   Percent
    ------- ----- ----- ------- ----- ------- -------
    m3857       0    10       0     1 1000000       0
(tests/data/nersc/ holds the recorded output and where it comes from.)

What a venv costs installed, measured by scripts/bench_venv_size.py (BENCHMARKS.md, "The GPU
venv's size"): the resolved wheels' bytes x INSTALLED_PER_WHEEL, and INODES_PER_WHEEL_GB inodes a
GB of wheels, plus an empty venv; a set whose wheels were never measured (hpcrl/stack_sizes.py)
counts as an empty venv: a floor, never a guess above it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

from . import stack as _stack
from .errors import SiteError

# scripts/bench_venv_size.py on gsm8k-grpo's GPU set (199 packages, Linux x86_64, Python 3.12):
# 4.31 GB of wheels install as 10.22 GB (bytecode included: stack.INSTALLED_PER_WHEEL) and
# 104,578 inodes.
INSTALLED_PER_WHEEL = _stack.INSTALLED_PER_WHEEL
INODES_PER_WHEEL_GB = 24_300
# `python3 -m venv` with pip and nothing else (measured here: du --apparent-size, find | wc -l)
EMPTY_VENV_BYTES = 23_000_000
EMPTY_VENV_INODES = 1_660

_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "PB": 1e15,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}
_HEADER = ["Project", "Usage", "Quota", "Percent", "Usage", "Quota", "Percent"]


@dataclass(frozen=True)
class Usage:
    project: str
    used_bytes: float
    quota_bytes: float
    used_inodes: int
    quota_inodes: int
    command: str

    @property
    def left_bytes(self) -> float:
        return self.quota_bytes - self.used_bytes

    @property
    def left_inodes(self) -> int:
        return self.quota_inodes - self.used_inodes


def _unit(text: str) -> str | None:
    """The table's space unit ('GB'), or None when `text` is not a cmnquota/cfsquota table."""
    lines = text.splitlines()
    unit = next((m.group(1) for ln in lines for m in [re.search(r"Space \(([A-Za-z]+)\)", ln)] if m), None)
    if unit is None or unit.upper() not in _UNITS or not any(ln.split() == _HEADER for ln in lines):
        return None
    return unit


def parse(text: str, project: str, command: str = "") -> Usage | None:
    """The project's row of a cmnquota/cfsquota table, or None (not that table, or no such row)."""
    unit = _unit(text)
    if unit is None:
        return None
    lines = text.splitlines()
    scale = _UNITS[unit.upper()]
    for line in lines:
        tok = line.split()
        if len(tok) == 7 and tok[0] == project:
            try:
                return Usage(project, float(tok[1]) * scale, float(tok[2]) * scale, int(float(tok[4])),
                             int(float(tok[5])), command)
            except ValueError:
                return None
    return None


def command_for(site: dict, root: str) -> list[str] | None:
    """The site's quota command for the file system holding `root` ({project}: the account
    without its _g, as in venv_root), or None: no rule for it, or no account to ask about."""
    rules = site.get("venv_quota") or []
    where = f"site '{site.get('name')}': venv_quota"
    if not isinstance(rules, list):
        raise SiteError(f"{where}: expected a list of {{under: PATH, command: 'cmnquota {{project}}'}}, got {rules!r}")
    project = (site.get("account") or "").removesuffix("_g")
    for rule in rules:
        if not isinstance(rule, dict) or not isinstance(rule.get("under"), str) or not isinstance(rule.get("command"), str):
            raise SiteError(f"{where}: each entry needs under: PATH and command: 'NAME {{project}}', got {rule!r}")
        under = rule["under"].rstrip("/")
        if root == under or root.startswith(under + "/"):
            return [w.replace("{project}", project) for w in shlex.split(rule["command"])] if project else None
    return None


def read(argv: list[str], project: str, root: str, warn=None) -> Usage | None:
    """What the quota command `argv` says of `project` (None: no such command here, or unreadable)."""
    if not argv or shutil.which(argv[0]) is None:
        return None  # not at that centre: nothing to check, nothing to say
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    shown = " ".join(shlex.quote(a) for a in argv)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        warn(f"`{shown}` did not answer ({e.__class__.__name__}); the venv's room in {root} was not checked")
        return None
    usage = parse(proc.stdout, project, shown) if proc.returncode == 0 else None
    if usage is None:
        why = (f"exit {proc.returncode}" if proc.returncode else
               f"no row for project {project}" if _unit(proc.stdout) else "output hpcrl does not recognise")
        warn(f"`{shown}`: {why}; the venv's room in {root} was not checked")
    return usage


def estimate(site: dict, requirements: list[str]) -> tuple[float, int, bool]:
    """(bytes, inodes, measured) a venv of `requirements` takes installed; measured False: the
    set's wheels were never sized, and this is an empty venv's floor."""
    from .stack import size_of

    size = size_of(site, list(requirements))
    if not size:
        return float(EMPTY_VENV_BYTES), EMPTY_VENV_INODES, False
    wheels = float(size["wheels_bytes"])
    return (EMPTY_VENV_BYTES + wheels * INSTALLED_PER_WHEEL,
            EMPTY_VENV_INODES + int(wheels / 1e9 * INODES_PER_WHEEL_GB), True)


def shortfall(usage: Usage, need_bytes: float, need_inodes: int) -> str | None:
    """What does not fit ('0.4 GB left of 10 GB, the venv needs ~10.2 GB'), or None."""
    out = []
    if need_bytes > usage.left_bytes:
        out.append(f"{max(usage.left_bytes, 0) / 1e9:.1f} GB left of {usage.quota_bytes / 1e9:g} GB, "
                   f"the venv needs ~{need_bytes / 1e9:.1f} GB")
    if need_inodes > usage.left_inodes:
        out.append(f"{max(usage.left_inodes, 0):,} inodes left of {usage.quota_inodes:,}, "
                   f"the venv needs ~{need_inodes:,}")
    return "; ".join(out) or None
