"""The trainer's venv, built where it can be written: on the login side, at `hpcrl submit` (or
`hpcrl venv build`), never in the job.

On Perlmutter venv_root is under /global/common/software, which compute nodes mount read-only;
the segment script only checks the ready marker and activates. One venv per distinct requirement
set (render.venv_path: venv_root/<hash of python + sorted requirements>), built under a lock
(`<venv>.lock`, flock) so that two submits never build it at once; pip's output goes to
`<venv>.log`. The ready marker (`<venv>/.hpcrl-ready`, holding the requirement list) is written
last: a build that died leaves none, and the next one starts over. A failed build leaves only its
log.

Sites whose jobs run elsewhere (a TPU VM: Backend.jobs_share_this_environment False) build on the
VM, in the job, where the disk is the VM's own; nothing is built here for them.
"""

from __future__ import annotations

import fcntl
import os
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
    from .stack import describe_size, size_of

    return Plan(Path(path), tuple(reqs), site.get("python") or "python3", tuple(site.get("modules") or []),
                tuple(site.get("setup") or []), describe_size(size_of(site, reqs)))


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
        if readiness(p) is None:  # built meanwhile by the holder of the lock
            return False
        _build(p, say)
        return True


def _build(p: Plan, say) -> None:
    shutil.rmtree(p.path, ignore_errors=True)
    say(f"building venv {p.path} ({len(p.requirements)} requirements{'; ' + p.size if p.size else ''}; "
        f"pip's output: {p.log})")
    import subprocess

    reqs = p.path.parent / (p.path.name + ".requirements.txt")
    reqs.write_text(p.marker_text(), encoding="utf-8")
    try:
        with open(p.log, "w", encoding="utf-8") as log:
            log.write(f"# hpcrl venv build of {p.path}\n# requirements:\n{p.marker_text()}# script:\n"
                      f"{build_script(p, reqs)}\n")
            log.flush()
            rc = subprocess.run(["bash", "-c", build_script(p, reqs)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT).returncode
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
