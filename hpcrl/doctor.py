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
import sys
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
        checks += _sandbox_level()
        the_spec = spec or {"trainer": trainer, "args": {}, "requirements": []}
        checks += _venv(site, the_spec, _in_job(environ), spec_file)
        checks += _gpu_driver(site, the_spec)
        checks += _venv_quota(site, the_spec)
        checks += _nccl_plugin(site)
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


def _gpu_driver(site: dict, spec: dict) -> list[Check]:
    """A GPU site: the driver's CUDA (nvidia-smi where it runs, else the profile's gpu_stack.driver_cuda)
    against the CUDA the venv's torch is built for (its pin's +cuNNN, else the built venv's torch)."""
    from . import gpucheck, stack, venv

    facts = stack.facts(site)
    if not int(site.get("gpus_per_node") or 0) or not facts.get("driver_cuda"):
        return []
    here, stated = gpucheck.driver_cuda(), str(facts["driver_cuda"])
    driver = here or stated
    source = "nvidia-smi here" if here else "the site profile; no nvidia-smi here"
    out = []
    if here and stack.cuda_major(here) != stack.cuda_major(stated):
        out.append(Check("driver", "warn", f"nvidia-smi here says CUDA {here}, the site profile says {stated}",
                         f"put gpu_stack: {{driver_cuda: '{here}'}} in your site file (extends: {site['name']})"))
    try:
        plan = venv.plan({"site": site, "spec": spec})
    except HpcrlError:
        plan = None
    build = stack.build_of(plan.requirements if plan else [])
    if build is None and plan is not None and venv.readiness(plan) is None:
        build = _torch_cuda(str(plan.path / "bin" / "python"))
    if build is None:
        return out + [Check("driver", "warn", f"driver CUDA {driver} ({source}); the venv's torch names no CUDA build "
                                              f"(the default index's torch is a CUDA 13 build since 2.11)",
                            f"set gpu_stack.cuda_variant (e.g. cu129) in your site file")]
    if stack.cuda_major(build) > stack.cuda_major(driver):
        return out + [Check("driver", "fail", f"the venv's torch is built for CUDA {build}, the driver ({source}) "
                                              f"supports CUDA {driver}: torch would see no GPU",
                            f"install a CUDA {stack.cuda_major(driver)} build: gpu_stack.cuda_variant "
                            f"{stack.PUBLISHED_VARIANT.get(stack.cuda_major(driver), 'cu' + str(stack.cuda_major(driver)) + 'x')} "
                            f"in your site file (or --set site.gpu_stack.cuda_variant=...), then hpcrl venv build")]
    return out + [Check("driver", "pass", f"driver CUDA {driver} ({source}) runs the venv's torch (built for CUDA {build})")]


def _venv_quota(site: dict, spec: dict) -> list[Check]:
    """The spec's venv (not built yet) against what venv_root's project quota has left: read from
    the site's quota command where it runs here (site venv_quota: cmnquota / cfsquota at NERSC;
    what submit refuses by, hpcrl/quota.py), else against a fixed gpu_stack.venv_quota_gb, by its
    resolved wheels (a floor) and the installed estimate (stack.INSTALLED_PER_WHEEL x wheels)."""
    from . import quota as quotas
    from . import stack, venv

    quota = stack.facts(site).get("venv_quota_gb")
    try:
        plan = venv.plan({"site": site, "spec": spec})
    except HpcrlError:
        return []
    if plan is not None and venv.readiness(plan) is not None:
        said: list[str] = []
        usage = quotas.read(list(plan.quota_command), plan.project, str(plan.path.parent), warn=said.append)
        need_bytes, need_inodes, measured = plan.need
        fix = "hpcrl venv prune (what no run uses), or another venv_root with room (--set site.venv_root=DIR)"
        if usage is not None:
            what = (f"project {plan.project} ({usage.command}): {max(usage.left_bytes, 0) / 1e9:.1f} GB and "
                    f"{max(usage.left_inodes, 0):,} inodes left; the spec's venv needs ~{need_bytes / 1e9:.1f} GB, "
                    f"~{need_inodes:,} inodes{'' if measured else ' (an empty venv: its packages not sized)'}")
            short = quotas.shortfall(usage, need_bytes, need_inodes)
            return [Check("venv quota", "fail", f"{what}: does not fit (submit refuses it)", fix) if short
                    else Check("venv quota", "pass", f"{what}: fits")]
        if said:
            return [Check("venv quota", "warn", said[0], "run `" + " ".join(plan.quota_command) + "` yourself")]
    size = stack.size_of(site, list(plan.requirements)) if plan else None
    if not quota or plan is None or size is None or venv.readiness(plan) is None:
        return []
    root = plan.path.parent
    used = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink()) if root.is_dir() else 0
    free, wheels = float(quota) * 1e9 - used, size["wheels_bytes"]
    need = wheels * stack.INSTALLED_PER_WHEEL
    what = (f"venv_root {root}: quota {float(quota):g} GB, {used / 1e9:.1f} GB used; the spec's venv is "
            f"{stack.describe_size(size)}")
    fix = ("another venv_root with room (--set site.venv_root=DIR, e.g. a project directory with more quota), "
           "site.trainer_python for an existing venv, or more quota from your centre (NERSC: a ticket for "
           "/global/common/software)")
    if wheels > free:
        return [Check("venv quota", "fail", f"{what}: its wheels alone exceed what is left", fix)]
    if need > free:
        return [Check("venv quota", "warn", f"{what}: likely more than is left", fix)]
    return [Check("venv quota", "pass", f"{what}: fits")]


def _nccl_plugin(site: dict) -> list[Check]:
    """A site with a multi-node NCCL set-up: after its modules load (in a non-interactive bash, as
    in the job), is NCCL's network plugin (libnccl-net*.so) on the library path?"""
    from . import stack

    setup = stack.nccl_setup(site, 2)
    if setup is None:
        return []
    modules = list(site.get("modules") or []) + setup["modules"]
    script = "".join(f"module load {q(m)} || exit 91\n" for m in modules)
    script += ('IFS=: ; for d in $LD_LIBRARY_PATH; do for f in "$d"/' + stack.PLUGIN_GLOB
               + '; do [ -e "$f" ] && { echo "$f"; exit 0; }; done; done; exit 92\n')
    try:
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return [Check("nccl", "warn", "loading the NCCL modules took over 2 minutes", "check the module system")]
    fix = (f"on {site['name']}'s login node `module load {' '.join(setup['modules']) or '...'}` must put the "
           f"aws-ofi-nccl plugin on LD_LIBRARY_PATH (`module show`); without it multi-node NCCL falls back to TCP")
    if proc.returncode == 0:
        return [Check("nccl", "pass", f"multi-node runs: NCCL's network plugin found ({proc.stdout.strip()})")]
    if proc.returncode == 91 or "module: command not found" in proc.stderr:
        return [Check("nccl", "warn", f"multi-node runs: `module load {' '.join(modules)}` fails here, so NCCL's "
                                      f"network plugin cannot be looked for", fix)]
    return [Check("nccl", "warn", f"multi-node runs: no {stack.PLUGIN_GLOB} on LD_LIBRARY_PATH after the modules "
                                  f"load: NCCL would use TCP sockets across nodes", fix)]


def _torch_cuda(python: str) -> str | None:
    try:
        proc = subprocess.run([python, "-c", "import torch; print(torch.version.cuda or '')"], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


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


def _sandbox_level(python: str = sys.executable, environ=None) -> list[Check]:
    """The code reward's isolation level on this machine (issue 28): what a sample can reach. Run
    as a process (hpcrl/rl is reached only that way; it imports nothing beyond the stdlib)."""
    environ = os.environ if environ is None else environ
    script = "from hpcrl.rewards import sandbox; print(sandbox.isolation())"
    try:
        proc = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL, env=dict(environ))
    except (OSError, subprocess.TimeoutExpired) as e:
        return [Check("sandbox", "warn", f"could not probe the code sandbox: {e}", "run doctor again")]
    level = proc.stdout.strip()
    said = next((ln.split("(", 1)[-1].rstrip(")") for ln in proc.stderr.splitlines()
                 if ln.startswith("hpcrl sandbox: isolation level")), "")
    if level in ("namespaces", "userns"):
        return [Check("sandbox", "pass", f"code samples here: isolation level {level} ({said.split(' - ')[0]})")]
    if level == "plain":
        allowed = environ.get("HPCRL_SANDBOX_PLAIN") == "1"
        return [Check("sandbox", "warn", "code samples here: isolation level plain (no namespaces: a sample reads "
                      "your files and environment and reaches the network)" + ("; allowed" if allowed else
                                                                             "; code rewards refuse it"),
                      "run as root or where unprivileged user namespaces are allowed; or set "
                      "HPCRL_SANDBOX_PLAIN=1 in the job to accept it")]
    return [Check("sandbox", "warn", f"could not probe the code sandbox: {proc.stderr.strip()[-200:]}",
                  "run doctor again")]


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

