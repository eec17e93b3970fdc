"""`hpcrl doctor`: the preflight a user runs on the login node before the first big submission.

Each check passes, warns or fails with a one-line fix. The scheduler's own checks (it answers,
the account, the QOS table against the scheduler's limits, features and GPUs, cloud credentials)
come from the site's backend (`Backend.doctor`); the ones every site shares are here: the
profile's modules load in a non-interactive bash, the Python they give is new enough for the
trainer, outputs and venv_root are writable (with free space; venv_root read-only inside a job is
expected: compute nodes only activate venvs), the venv of the spec is built and ready (else the
command that builds it), and the variables the profile's paths use are set. Nothing here changes anything (writability is tried with a temporary file, removed at once).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .backends import for_site
from .backends.base import Check
from .errors import HpcrlError
from .render import expand_path
from .shell import q
from .trainers import get_trainer

STATUS_ORDER = ("pass", "warn", "fail")


def run_checks(site: dict, trainer: str = "builtin", spec: dict | None = None, environ=None,
               spec_file: str | None = None) -> list[Check]:
    """spec: the spec part of a resolved spec (trainer, args, requirements) whose venv to check,
    read from spec_file; default: the trainer's with its default arguments."""
    environ = os.environ if environ is None else environ
    backend = for_site(site)
    checks = list(backend.doctor(site))
    if backend.jobs_share_this_environment:
        checks += _paths(site, in_job=_in_job(environ))
        checks += _modules_and_python(site, get_trainer(trainer))
        checks += hooks_python(site)
        checks += _venv(site, spec or {"trainer": trainer, "args": {}, "requirements": []}, _in_job(environ),
                        spec_file)
    else:  # the job's modules, Python and venvs are on another machine: only the run dirs are here
        checks += _paths({**site, "venv_root": None})
    return checks


def _in_job(environ) -> bool:
    """Inside a batch job (a compute node): there, venv_root is only read (Perlmutter mounts
    /global/common read-only on compute nodes)."""
    return bool(environ.get("SLURM_JOB_ID") or environ.get("HPCRL_JOB_ID"))


def _venv(site: dict, spec: dict, in_job: bool, spec_file: str | None = None) -> list[Check]:
    """The venv the spec's jobs activate exists and is ready; else the command that builds it."""
    from . import venv

    try:
        plan = venv.plan({"site": site, "spec": spec})
    except HpcrlError as e:  # venv_root's variable unset: the venv_root line says so already
        return [Check("venv", "fail", str(e).split("; ")[0], "set the variable, or --set site.venv_root=DIR")]
    if plan is None:
        return []
    why = venv.readiness(plan)
    if why is None:
        return [Check("venv", "pass", f"{plan.path} ready ({len(plan.requirements)} requirements of "
                                      f"{spec['trainer']})")]
    what = q(spec_file) if spec_file else f"--trainer {q(spec['trainer'])}"
    command = f"hpcrl venv build {what} --site {q(site['name'])}"
    if site.get("account"):
        command += f" --account {q(site['account'])}"
    if in_job:
        return [Check("venv", "fail", f"{plan.path}: {why}; a job cannot build it (venv_root is read-only here)",
                      f"on a login node: {command} (or hpcrl submit, which builds it)")]
    return [Check("venv", "warn", f"{plan.path}: {why} (hpcrl submit builds it first, which takes minutes)",
                  f"build it now: {command}")]


def _paths(site: dict, in_job: bool = False) -> list[Check]:
    out = []
    for key in ("outputs", "venv_root"):
        template = site.get(key)
        if not template:
            continue
        try:
            path = Path(expand_path(template, site, key))
        except HpcrlError as e:  # a $SCRATCH-style variable that is not set here
            out.append(Check(key, "fail", str(e).split("; ")[0], f"set the variable, or --set site.{key}=DIR"))
            continue
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        problem = _unwritable(existing)
        if problem and key == "venv_root" and in_job and existing.is_dir():
            # Perlmutter's compute nodes mount /global/common read-only: jobs only activate venvs
            out.append(Check(key, "pass", f"{path}: read-only here, in a job (as on compute nodes: expected; "
                                          f"venvs are built on the login node, at submit)"))
            continue
        if problem:
            out.append(Check(key, "fail", f"{path}: {problem}",
                             f"point site.{key} at a directory you own (--set site.{key}=DIR)"))
            continue
        free_gb = shutil.disk_usage(existing).free / 1e9
        made = "" if existing == path else " (will be created)"
        status = "warn" if free_gb < 10 else "pass"
        out.append(Check(key, status, f"{path}{made}: writable, {free_gb:.1f} GB free",
                         "checkpoints of a real model need tens of GB: free space or move it" if status == "warn" else ""))
    return out


def _unwritable(directory: Path) -> str | None:
    """Why nothing can be created in `directory`, or None. Tried for real (a temporary file,
    removed at once): permission bits do not tell root about a read-only filesystem."""
    import tempfile

    if not directory.is_dir():
        return f"{directory} is not a directory"
    try:
        fd, name = tempfile.mkstemp(prefix=".hpcrl-doctor-", dir=directory)
    except OSError as e:
        return f"{directory} is not writable ({e.strerror})"
    os.close(fd)
    os.unlink(name)
    return None


def _modules_and_python(site: dict, trainer) -> list[Check]:
    """Run what the job runs first, in a non-interactive bash: the module loads, then the Python."""
    modules = site.get("modules") or []
    python = site.get("python") or "python3"
    loads = "".join(f"module load {q(m)} || exit 91\n" for m in modules)
    script = loads + f"exec {q(python)} -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'\n"
    try:
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return [Check("modules", "fail", "loading the modules took over 2 minutes", "check the module system")]
    err = " ".join(proc.stderr.split())[-300:]
    out = []
    if modules:
        if proc.returncode == 91 or "module: command not found" in proc.stderr:
            out.append(Check("modules", "fail", f"`module load {' '.join(modules)}` failed in a non-interactive "
                                                f"bash: {err or 'exit ' + str(proc.returncode)}",
                             "fix the site's modules (module avail lists them), or run doctor on a login node"))
            return out
        out.append(Check("modules", "pass", f"{', '.join(modules)} load in a non-interactive bash"))
    if proc.returncode != 0:
        out.append(Check("python", "fail", f"{python}: {err or 'exit ' + str(proc.returncode)}",
                         "set the site's python to an interpreter the job can run"))
        return out
    have = tuple(int(x) for x in proc.stdout.strip().split("."))
    need = tuple(getattr(trainer, "python_min", (3, 10)))
    if have < need:
        out.append(Check("python", "fail", f"{python} is {'.'.join(map(str, have))}; the {trainer.name} trainer's "
                                           f"requirements need >= {'.'.join(map(str, need))}",
                         "load a newer python module or set the site's python"))
    else:
        out.append(Check("python", "pass", f"{python} is {'.'.join(map(str, have))} (>= {'.'.join(map(str, need))} "
                                           f"for {trainer.name})"))
    return out


def format_checks(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        line = f"{c.status.upper():<5} {c.name:<{width}}  {c.detail}"
        lines.append(line + (f"; fix: {c.fix}" if c.fix and c.status != "pass" else ""))
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    lines.append(f"{len(checks)} checks: {len(checks) - fails - warns} passed, {warns} warned, {fails} failed")
    return "\n".join(lines)


# Directories a compute node has its own of (or none): an interpreter there is not the job's.
NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/local", "/scratch/local")


def hooks_python(site: dict, executable: str | None = None, prefix: str | None = None) -> list[Check]:
    """The rendered script runs hpcrl's own hooks (`_segment begin/end`) with site.hpcrl_python
    or the interpreter hpcrl runs in here: on a site whose jobs run on other nodes, that path
    must be on a file system they mount, not this machine's /tmp or node-local disk."""
    import sys

    if site.get("scheduler") == "local":
        return []
    given = site.get("hpcrl_python")
    path = os.path.abspath(given or executable or sys.executable)
    where = [path] if given else [path, os.path.abspath(prefix or sys.prefix)]  # a venv: its dir too
    local = next((p for p in where if _node_local(p)), None)
    if local is None:
        return [Check("hooks python", "pass", f"{path} (runs hpcrl's segment hooks in the job)")]
    return [Check("hooks python", "fail", f"{path}: the job runs hpcrl's segment hooks with it, but {local} is on "
                                          f"{_node_local(local)}, which compute nodes do not share",
                  "install hpcrl into a venv on a shared file system ($HOME, /global/common/software/PROJECT) and "
                  "run hpcrl from it, or --set site.hpcrl_python=PATH of such an interpreter")]


def _node_local(path: str) -> str | None:
    """What makes `path` node-local (its directory or its file system's type), or None."""
    for top in NODE_LOCAL:
        if path == top or path.startswith(top + "/"):
            return top
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    best = max((m for m in mounts if path == m[0] or path.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return f"a {best[1]} file system ({best[0]})" if best and best[1] in ("tmpfs", "ramfs") else None

