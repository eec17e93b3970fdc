"""The trainer's venv, built where it can be written: on the login side, at `hpcrl submit` (or
`hpcrl venv build`), never in the job.

Compute nodes may mount venv_root read-only (Perlmutter's Global Common; its profile now puts
venvs on CFS, where a GPU venv fits: docs/perlmutter.md); the segment script only checks the ready
marker and activates. One venv per distinct requirement set (render.venv_path:
venv_root/<hash of python + sorted requirements>), built under a lock
(`<venv>.lock`, flock) so that two submits never build it at once; pip's output goes to
`<venv>.log`. The ready marker (`<venv>/.hpcrl-ready`, holding the requirement list) is written
last: a build that died leaves none, and the next one starts over. A failed build leaves only its
log.

Before a build, the venv's estimated size (bytes and inodes: hpcrl/quota.py) is weighed against
what the site's quota command says is left of venv_root's project quota, and a venv that does not
fit is refused in one line, before anything is written or queued. pip's caches go where the
site's job_env puts them (PIP_CACHE_DIR, XDG_CACHE_HOME, UV_CACHE_DIR, PIP_NO_CACHE_DIR, expanded
here, on the login side): a GPU venv's wheels are ~4 GB, and $HOME holds 40 GB.

Sites whose jobs run elsewhere (a TPU VM: Backend.jobs_share_this_environment False) build on the
VM, in the job, where the disk is the VM's own; nothing is built here for them.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import HpcrlError
from .shell import q

READY = ".hpcrl-ready"


class VenvError(HpcrlError):
    """A venv that cannot be built or used; the message names the log or the fix."""


@dataclass(frozen=True)
class Plan:
    """The venv a resolved spec runs in: where, from which requirements, built by which python."""

    path: Path
    requirements: tuple[str, ...]
    python: str
    modules: tuple[str, ...]
    setup: tuple[str, ...]
    size: str = ""  # the resolved wheels' size when measured (hpcrl/stack_sizes.py)
    env: tuple[tuple[str, str], ...] = ()  # pip's cache settings for the build (BUILD_ENV)
    env_error: str = ""  # why they cannot be expanded here (said only when a build needs them)
    quota_command: tuple[str, ...] = ()  # what reports venv_root's project quota (hpcrl/quota.py)
    project: str = ""
    need: tuple[float, int, bool] = (0.0, 0, False)  # installed bytes, inodes, measured (quota.estimate)

    @property
    def marker(self) -> Path:
        return self.path / READY

    @property
    def log(self) -> Path:
        return self.path.parent / (self.path.name + ".log")

    @property
    def lock(self) -> Path:
        return self.path.parent / (self.path.name + ".lock")

    def marker_text(self) -> str:
        return "".join(f"{r}\n" for r in self.requirements)


# The site's job_env variables that say where pip (and uv) keep their caches: the login-side build
# uses them too, so that a GPU venv's ~4 GB of wheels is not cached in $HOME (issue 39 item 4).
BUILD_ENV = ("PIP_CACHE_DIR", "PIP_NO_CACHE_DIR", "XDG_CACHE_HOME", "UV_CACHE_DIR")


def build_env(site: dict) -> tuple[tuple[str, str], ...]:
    """BUILD_ENV as the site's job_env sets them, expanded here (a variable unset here is the
    same one-line error render gives for the job)."""
    from .render import expand_path

    job_env = site.get("job_env") or {}
    return tuple((k, expand_path(str(job_env[k]), site, f"job_env.{k}")) for k in BUILD_ENV if k in job_env)


def requirements(resolved: dict) -> list[str]:
    """The resolved requirement list: the trainer adapter's, then the spec's own."""
    from .trainers import get_trainer

    spec, site = resolved["spec"], resolved["site"]
    if site.get("trainer_python"):
        return []  # the user's own interpreter: nothing to install
    from .stack import pin_builds

    # the site's CUDA build named explicitly (index option + local-version pins): hpcrl/stack.py
    return pin_builds(list(get_trainer(spec["trainer"]).requirements(spec["args"], site)) + list(spec["requirements"]), site)


def path_for(resolved: dict) -> str | None:
    """The run's venv directory (None: the site has no venv_root, or nothing to install)."""
    from .render import venv_path

    return venv_path(resolved["site"], requirements(resolved))


def plan(resolved: dict) -> Plan | None:
    """The venv of this spec on this site, or None (no venv_root, trainer_python, nothing to install)."""
    from .render import venv_path

    site = resolved["site"]
    reqs = requirements(resolved)
    path = venv_path(site, reqs)
    if path is None:
        return None
    from . import quota
    from .stack import describe_size, size_of

    try:
        env, env_error = build_env(site), ""
    except HpcrlError as e:  # e.g. $SCRATCH unset here: only a build needs it (doctor, render do not)
        env, env_error = (), str(e)
    return Plan(Path(path), tuple(reqs), site.get("python") or "python3", tuple(site.get("modules") or []),
                tuple(site.get("setup") or []), describe_size(size_of(site, reqs)), env, env_error,
                tuple(quota.command_for(site, str(Path(path).parent)) or ()),
                (site.get("account") or "").removesuffix("_g"), quota.estimate(site, reqs))


def built_here(resolved: dict) -> bool:
    """Whether this machine builds the venv (its jobs see this machine's venv_root)."""
    from .backends import for_site

    return for_site(resolved["site"]).jobs_share_this_environment


def readiness(p: Plan) -> str | None:
    """Why the venv cannot be used as it is (None: ready): no marker, a marker for other
    requirements, or an interpreter that no longer runs (its base Python moved or was removed)."""
    try:
        text = p.marker.read_text(encoding="utf-8")
    except OSError:
        return "not built" if not p.path.exists() else "not ready (a build that did not finish)"
    if text != p.marker_text():
        return "built for other requirements"
    import subprocess  # here: render loads this module and runs nothing

    try:
        ok = subprocess.run([str(p.path / "bin" / "python"), "-c", ""], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return None if ok else "stale: its python does not run (was its base Python removed or upgraded?)"


def build_script(p: Plan, requirements_file: Path) -> str:
    """What runs in bash on the login side: the job's modules and set-up lines, so that the venv's
    python is the one the job gets, then venv + pip. Every value through `q`."""
    lines = ["set -e"]
    lines += [f"module load {q(m)}" for m in p.modules]
    lines += list(p.setup)  # trusted: from the site profile, as in the job
    lines += [f"{q(p.python)} -m venv {q(str(p.path))}",
              f"{q(str(p.path / 'bin' / 'python'))} -m pip install --disable-pip-version-check "
              f"-r {q(str(requirements_file))}"]
    return "\n".join(lines) + "\n"


def ensure(p: Plan, say=None) -> bool:
    """Build the venv unless it is ready; True when this call built it. Waits for the lock while
    another build of the same venv runs (then finds it ready)."""
    say = say or (lambda msg: print(f"hpcrl: {msg}", file=sys.stderr))
    if readiness(p) is None:
        return False
    if p.env_error:
        raise VenvError(p.env_error)
    check_room(p)  # before anything is written: a refused venv leaves no directory or lock behind
    try:
        p.path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(p.lock, "a")
    except OSError as e:
        raise VenvError(f"cannot create the venv's directory {p.path.parent}: {e.strerror}; build venvs on a "
                        f"login node, where venv_root is writable, or --set site.venv_root=DIR") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another build of venv {p.path} (lock {p.lock})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as e:  # a file system without locks (some network mounts): no safe build
            raise VenvError(f"cannot lock {p.lock}: {e.strerror}; venv_root needs a file system with locks "
                            f"(on a login node): --set site.venv_root=DIR") from None
        if readiness(p) is None:  # built meanwhile by the holder of the lock
            return False
        _build(p, say)
        return True


def check_room(p: Plan, warn=None) -> None:
    """Refuse, in one line and before anything is written, a venv that venv_root's project quota
    has no room for (the site's quota command says what is left; where it does not exist, nothing
    is checked)."""
    from . import quota

    usage = quota.read(list(p.quota_command), p.project, str(p.path.parent), warn)
    if usage is None:
        return
    need_bytes, need_inodes, measured = p.need
    if p.path.is_dir() and not p.path.is_symlink():  # a stale or unfinished one: the build removes it first
        freed, freed_inodes = _du([p.path])
        need_bytes, need_inodes = need_bytes - freed, need_inodes - freed_inodes
    short = quota.shortfall(usage, need_bytes, need_inodes)
    if short is None:
        return
    raise VenvError(f"no room for venv {p.path} in project {p.project}'s quota ({usage.command}): {short}"
                    f"{'' if measured else ' (an empty venv; its packages add more)'}; free some (hpcrl venv prune "
                    f"lists what no run uses) or build venvs elsewhere: --set site.venv_root=DIR")


def _build(p: Plan, say) -> None:
    shutil.rmtree(p.path, ignore_errors=True)
    say(f"building venv {p.path} ({len(p.requirements)} requirements{'; ' + p.size if p.size else ''}; "
        f"pip's output: {p.log})")
    caches = "".join(f"# {k}={v}\n" for k, v in p.env) or "# pip's caches: its defaults (the site's job_env names none)\n"
    import subprocess

    reqs = p.path.parent / (p.path.name + ".requirements.txt")
    reqs.write_text(p.marker_text(), encoding="utf-8")
    try:
        with open(p.log, "w", encoding="utf-8") as log:
            log.write(f"# hpcrl venv build of {p.path}\n# requirements:\n{p.marker_text()}# environment:\n{caches}"
                      f"# script:\n{build_script(p, reqs)}\n")
            log.flush()
            rc = subprocess.run(["bash", "-c", build_script(p, reqs)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **dict(p.env)}).returncode
    finally:
        reqs.unlink(missing_ok=True)
    if rc != 0:
        shutil.rmtree(p.path, ignore_errors=True)  # no half-built venv in a quota'd file system
        raise VenvError(f"building venv {p.path} failed (exit {rc}); see {p.log}")
    tmp = p.path / (READY + ".tmp")
    tmp.write_text(p.marker_text(), encoding="utf-8")
    os.replace(tmp, p.marker)  # last: the venv is ready only once everything above succeeded
    say(f"venv {p.path} ready")


def build_command(run_id: str) -> str:
    """The command that builds a run's venv (what a job that finds none tells the user)."""
    return f"hpcrl venv build --run {run_id}"


# ------------------------------------------------------------------ prune

# What hpcrl writes in venv_root, and nothing else is ever touched: <hash>/ (render.venv_path's 12
# hex digits), <hash>.log, <hash>.lock, <hash>.requirements.txt.
_OWN = re.compile(r"([0-9a-f]{12})(\.log|\.lock|\.requirements\.txt)?\Z")


@dataclass
class Prunable:
    """One venv of hpcrl's in venv_root: every path of it, what it is, its size, who uses it."""

    path: Path
    paths: list[Path]
    kind: str                     # "ready" or "failed build" (a log or lock, no ready marker)
    bytes: int = 0
    inodes: int = 0
    used_by: list[str] = None     # "RUN (STATE)" of the runs that could still run or be resumed

    @property
    def removable(self) -> bool:
        return not self.used_by


def in_use(run_ids=None) -> dict[str, list[str]]:
    """venv path -> the runs that use it: every registered run that is not COMPLETED. A FAILED,
    STOPPED or CANCELLED run still uses its venv: `hpcrl resume` continues it from its checkpoint
    (and a run still queued or running activates it at each segment's start)."""
    from .lifecycle import RunState
    from .runs import Run, registered_ids

    out: dict[str, list[str]] = {}
    for run_id in (registered_ids() if run_ids is None else run_ids):
        try:
            run = Run.by_id(run_id)
            state = run.state()["state"]
            if state == RunState.COMPLETED:
                continue
            path = path_for(run.spec())
        except (HpcrlError, OSError, ValueError, KeyError) as e:
            # a run whose venv cannot be told: pruning might remove the venv it resumes in
            raise VenvError(f"cannot tell which venv run '{run_id}' uses ({str(e).split('; ')[0]}); nothing "
                            f"removed: fix or cancel that run first") from None
        if path:
            out.setdefault(str(Path(path)), []).append(f"{run_id} ({state})")
    return out


def prunable(root: Path, used: dict[str, list[str]]) -> list[Prunable]:
    """hpcrl's venvs in `root` (ready ones, and failed builds: a log or lock and no ready marker),
    each with its size and the runs that use it; a build in progress (its lock held) is left out."""
    groups: dict[str, list[Path]] = {}
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    for name in names:
        m = _OWN.match(name)
        entry = root / name
        if m is None or entry.is_symlink() or (m.group(2) is None) != entry.is_dir():
            continue  # not hpcrl's: never touched
        groups.setdefault(m.group(1), []).append(entry)
    out = []
    for digest, paths in groups.items():
        venv = root / digest
        if (venv / READY).is_file():
            kind = "ready"
        elif any(p.suffix in (".log", ".lock") for p in paths):
            kind = "failed build"
        else:
            continue  # a bare directory with neither marker nor log: not known to be hpcrl's
        if _building(venv):
            continue
        size, inodes = _du(paths)
        out.append(Prunable(venv, sorted(paths), kind, size, inodes, used.get(str(venv), [])))
    return out


def _building(venv: Path) -> bool:
    """Whether a build of `venv` holds its lock now."""
    lock = venv.parent / (venv.name + ".lock")
    try:
        with open(lock, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return False
    except OSError:  # held (BlockingIOError), or locks unsupported: leave it
        return True
    return False


def _du(paths: list[Path]) -> tuple[int, int]:
    """Apparent bytes and inodes under `paths` (symlinks counted, never followed)."""
    size = inodes = 0
    for top in paths:
        if not top.is_dir() or top.is_symlink():
            size += top.lstat().st_size
            inodes += 1
            continue
        for base, dirs, files in os.walk(top):
            inodes += 1
            for name in files + [d for d in dirs if os.path.islink(os.path.join(base, d))]:
                size += os.lstat(os.path.join(base, name)).st_size
                inodes += 1
    return size, inodes


def remove(p: Prunable) -> None:
    """Remove one prunable venv: the directory first (a half-removed venv has no ready marker left
    early: the marker goes with it), then its log and requirements, its lock last."""
    for path in sorted(p.paths, key=lambda x: (x.suffix == ".lock", x.suffix != "")):
        if path.is_dir() and not path.is_symlink():
            (path / READY).unlink(missing_ok=True)  # first: never a ready marker on a partial venv
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
