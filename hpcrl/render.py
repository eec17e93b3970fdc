"""Pure rendering: (resolved spec and site, run paths) -> the segment script text.

Every user-supplied string that reaches the shell goes through `q` (here, and as the template's
`q` filter): one quoting path, tested with hostile values.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .errors import SiteError
from .paths import hpcrl_home, templates_dir
from .shell import TRAINER_PY, command_line, q
from .trainers import get_trainer
from .trainers.base import TrainerContext


@dataclass
class RunPaths:
    run_id: str
    run_dir: Path
    hpcrl_python: str

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def script(self) -> Path:
        return self.run_dir / "job.sh"

    @property
    def lib_dir(self) -> Path:
        # A snapshot of the hpcrl package taken at submit: the job imports it, so a run keeps
        # working with the code it was created with even if hpcrl is upgraded meanwhile.
        return self.run_dir / "lib"

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"


JOB_ID_LINES = {
    "slurm": 'export HPCRL_JOB_ID="$SLURM_JOB_ID"',
    "local": 'export HPCRL_JOB_ID="${HPCRL_JOB_ID:?run this script through hpcrl: the local backend sets HPCRL_JOB_ID}"',
    "tpu": 'export HPCRL_JOB_ID="${HPCRL_JOB_ID:?the TPU startup script sets HPCRL_JOB_ID}"',
}


def expand_path(template: str, site: dict, what: str) -> str:
    """Expand $VARS (and $HPCRL_HOME even when unset) and {account}/{project} in a site path."""
    account = site.get("account") or ""
    value = str(template).replace("{account}", account).replace("{project}", account.removesuffix("_g"))
    env = dict(os.environ)
    env.setdefault("HPCRL_HOME", str(hpcrl_home()))
    expanded = os.path.expanduser(_expandvars(value, env))
    unset = re.search(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", expanded)
    if unset:
        var = "$" + unset.group(1)
        raise SiteError(f"site '{site.get('name')}': {what} '{template}' uses {var}, which is not set here; "
                        f"set it or pass --set site.{what}=DIR")
    return expanded


def _expandvars(value: str, env: dict) -> str:
    import string

    class _Keep(dict):
        def __missing__(self, key):
            return "${" + key + "}"

    return string.Template(value).safe_substitute(_Keep(env))


def venv_path(site: dict, requirements: list[str]) -> str | None:
    """The venv for this requirement set: venv_root/<hash of python + sorted requirements>."""
    if not site.get("venv_root") or not requirements:
        return None
    key = "\n".join([str(site.get("python")), *sorted(requirements)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"{expand_path(site['venv_root'], site, 'venv_root')}/{digest}"


def trainer_context(resolved: dict, paths: RunPaths) -> TrainerContext:
    spec, site = resolved["spec"], resolved["site"]
    return TrainerContext(run_id=paths.run_id, run_dir=paths.run_dir, ckpt_dir=paths.ckpt_dir,
                          args=spec["args"], site=site, resources=spec["resources"])


def requirements(resolved: dict) -> list[str]:
    spec, site = resolved["spec"], resolved["site"]
    return list(get_trainer(spec["trainer"]).requirements(spec["args"], site)) + list(spec["requirements"])


def walltime_minutes(hours: float) -> int:
    # Slurm limits are whole minutes; round up so a user never gets less than asked (after
    # rounding to whole seconds: 0.0167 h means one minute, not two).
    return max(1, math.ceil(round(hours * 3600) / 60))


def slurm_options(resolved: dict, paths: RunPaths) -> dict:
    spec, site = resolved["spec"], resolved["site"]
    res, budget = spec["resources"], spec["budget"]
    opts = {
        "account": site.get("account"),
        "qos": site.get("qos"),
        "partition": site.get("partition"),
        "constraint": site.get("constraint"),
        "nodes": res["nodes"],
        "gpus-per-node": res.get("gpus_per_node") or None,
        "cpus-per-task": res.get("cpus_per_task"),
        "mem": f"{res['mem_gb']:g}G" if res.get("mem_gb") else None,
        "time": walltime_minutes(budget["hours"]),
        "time-min": walltime_minutes(budget["hours_min"]) if budget.get("hours_min") else None,
        "signal": f"B:USR1@{int(site['signal_lead_s'])}",
        "open-mode": "append",
        "job-name": paths.run_id,
        "output": str(paths.logs_dir / "job-%j.log"),
        "chdir": str(paths.run_dir),  # never the submitter's cwd (a stray ./hpcrl would shadow the snapshot)
        "dependency": "singleton",
    }
    return {**site.get("scheduler_flags", {}), **spec.get("scheduler_flags", {}), **opts}


def local_header(resolved: dict) -> list[str]:
    site, hours = resolved["site"], resolved["spec"]["budget"]["hours"]
    return [f"#HPCRL-LOCAL walltime_s={hours * 3600:g}", f"#HPCRL-LOCAL signal_lead_s={site['signal_lead_s']:g}",
            f"#HPCRL-LOCAL kill_grace_s={site['kill_grace_s']:g}"]


def header(resolved: dict, paths: RunPaths) -> str:
    kind = resolved["site"]["scheduler"]
    if kind == "slurm":
        from .backends.slurm import sbatch_directives

        lines = sbatch_directives(slurm_options(resolved, paths))
    elif kind == "local":
        lines = local_header(resolved)
    else:
        lines = []
    return "\n".join(["#!/bin/bash", *lines])


def _environment(resolved: dict) -> list[tuple[str, str]]:
    spec, site = resolved["spec"], resolved["site"]
    ctx_env = {**site.get("env", {}), **spec.get("env", {})}
    return sorted(ctx_env.items())


def tpu_paths(paths: RunPaths) -> RunPaths:
    """[tpu] The job runs on the TPU VM: its run dir there, not this machine's mirror of it."""
    from dataclasses import replace

    from .backends.tpu import vm_run_dir

    return replace(paths, run_dir=Path(vm_run_dir(paths.run_id)))


def render_script(resolved: dict, paths: RunPaths) -> str:
    """The segment script, byte for byte what the backend submits."""
    import jinja2

    spec, site = resolved["spec"], resolved["site"]
    if site["scheduler"] == "tpu":  # [tpu] see tpu_paths
        paths = tpu_paths(paths)
    trainer = get_trainer(spec["trainer"])
    ctx = trainer_context(resolved, paths)
    reqs = requirements(resolved)
    venv = venv_path(site, reqs)
    ctx.python = TRAINER_PY
    env = _environment(resolved) + sorted(trainer.env(ctx).items())
    jenv = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=False, autoescape=False)
    jenv.filters["q"] = q
    return jenv.get_template("segment.sh.j2").render(
        header=header(resolved, paths), run_id=paths.run_id, site_name=site["name"], version=__version__,
        run_dir=str(paths.run_dir), ckpt_dir=str(paths.ckpt_dir), metrics=str(paths.run_dir / "metrics.jsonl"),
        hpcrl_python=paths.hpcrl_python, hpcrl_src=str(paths.lib_dir), job_id_line=JOB_ID_LINES[site["scheduler"]],
        modules=site.get("modules", []), setup=site.get("setup", []), venv=venv, python=site.get("python") or "python3",
        requirements_file=str(paths.run_dir / "requirements.txt"), env=env,
        bootstrap=trainer.bootstrap(ctx), command=command_line(trainer.command(ctx)),
        forward_usr1=trainer.obeys_protocol,
    )
