"""Pure rendering: the pieces of a segment script -> its text.

The caller (launch) gathers the pieces from their owners — the backend's directives, job-id line
and job-side layout, the trainer adapter's command, environment and bootstrap — and hands them
here; render asks nobody. Every user-supplied string that reaches the shell goes through
hpcrl.shell.q (here, and as the template's `q` filter): one quoting path, tested with hostile values.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field

from . import __version__
from .protocol import ERROR_FILE
from .errors import SiteError
from .paths import hpcrl_home, templates_dir
from .shell import command_line, comment, expandable, expandable_vars, q


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


def job_env(site: dict, overridden) -> list[tuple[str, str]]:
    """The site's job_env as (name, shell word) pairs, expanded by the job's shell (caches under the
    job's $SCRATCH), less the names the spec, site env or trainer set. A variable a value uses
    must be set here too: the job inherits this shell's environment, and its `set -u` would end
    the script at an unset one before the segment is recorded."""
    out = []
    for key, value in sorted((site.get("job_env") or {}).items()):  # checked by spec._validate_site
        if key in overridden:
            continue
        unset = next((v for v in expandable_vars(value) if v not in os.environ), None)
        if unset is not None:
            raise SiteError(f"site '{site.get('name')}': job_env.{key} '{value}' uses ${unset}, which is not set here; "
                            f"set it or pass --set site.job_env.{key}=DIR")
        out.append((key, expandable(value)))
    return out


def venv_path(site: dict, requirements: list[str]) -> str | None:
    """The venv for this requirement set: venv_root/<hash of python + sorted requirements>
    (none when the site names a ready trainer_python)."""
    if not site.get("venv_root") or not requirements or site.get("trainer_python"):
        return None
    key = "\n".join([str(site.get("python")), *sorted(requirements)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"{expand_path(site['venv_root'], site, 'venv_root')}/{digest}"


@dataclass
class ScriptParts:
    """Everything a segment script is made of, each from its owner."""

    run_id: str
    site: dict                # the resolved site (name, modules, setup, env, python)
    spec_env: dict            # the spec's env
    layout: object            # hpcrl.runs.RunLayout as the job sees it
    header: list[str]         # the backend's directives
    job_id_line: str          # the backend's: exports HPCRL_JOB_ID
    hpcrl_python: str
    command: list[str]        # the trainer adapter's argv
    trainer_env: dict = field(default_factory=dict)
    bootstrap: str = ""
    forward_usr1: bool = True  # the trainer checkpoints on USR1 (the protocol)
    venv: str | None = None
    # Built at submit on this side (the job only checks and activates it), or in the job (a TPU
    # VM: its own disk); the resolved requirements are listed in the script either way.
    venv_prebuilt: bool = True
    requirements: list[str] = field(default_factory=list)
    venv_build_command: str = "hpcrl venv build"
    venv_install: str | None = None  # the trainer's installer script for a venv built in the job
    nothing_to_do: int = 3    # protocol.EXIT_NOTHING_TO_DO of `_segment begin`
    exit_continue: int = 85   # protocol.EXIT_CONTINUE: the job itself then ends 0 for its scheduler
    # Under a multi-process launcher (torchrun, srun): the backend's bash before it (None: the
    # trainer is one process). USR1 then becomes HPCRL_STOP_FILE and the code HPCRL_EXIT_FILE.
    ranks_prelude: str | None = None
    # Start with `python -m hpcrl.rl.gpucheck` (the venv's torch sees each GPU given): hpcrl/stack.py
    gpu_check: bool = False
    venv_size: str = ""       # the resolved wheels' size, when measured (stack.describe_size)
    nccl: dict | None = None  # multi-node NCCL set-up from the site (stack.nccl_setup): modules, env


def _template_cache(jinja2):
    """The compiled template, kept between runs under the registry home (compiling segment.sh.j2
    costs more than the rest of `hpcrl render`); jinja2 checks it against the template's source
    and Python's version, writes it atomically and ignores a failed write. A home that cannot
    hold it: no cache, the template compiled each time."""
    path = hpcrl_home() / "cache" / "templates"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return jinja2.FileSystemBytecodeCache(str(path))


def render_script(p: ScriptParts) -> str:
    """The segment script, byte for byte what the backend submits."""
    import jinja2

    site, lay = p.site, p.layout
    env = sorted({**site.get("env", {}), **p.spec_env}.items()) + sorted(p.trainer_env.items())
    expanded = job_env(site, {k for k, _ in env})
    jenv = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=False, autoescape=False,
                              bytecode_cache=_template_cache(jinja2))
    jenv.filters["q"] = q
    jenv.filters["comment"] = comment
    return jenv.get_template("segment.sh.j2").render(
        header="\n".join(["#!/bin/bash", *p.header]), run_id=p.run_id, site_name=site["name"], version=__version__,
        run_dir=str(lay.root), ckpt_dir=str(lay.checkpoints), metrics=str(lay.metrics),
        checkpointing_flag=lay.checkpointing_flag.name, rc_prefix=lay.trainer_rc("").name,
        stop_prefix=lay.trainer_stop("").name, exit_prefix=lay.trainer_exit("").name, ranks_prelude=p.ranks_prelude,
        hpcrl_python=p.hpcrl_python, hpcrl_src=str(lay.lib), job_id_line=p.job_id_line,
        modules=site.get("modules", []), setup=site.get("setup", []), venv=p.venv, venv_prebuilt=p.venv_prebuilt,
        requirements=p.requirements, venv_build_command=p.venv_build_command, error_file=ERROR_FILE,
        venv_install=p.venv_install,
        trainer_python=site.get("trainer_python"), python=site.get("python") or "python3",
        requirements_file=str(lay.requirements), env=env, job_env=expanded, nothing_to_do=int(p.nothing_to_do),
        exit_continue=int(p.exit_continue),
        bootstrap=p.bootstrap, gpu_check=p.gpu_check, venv_size=p.venv_size, nccl=p.nccl, command=command_line(p.command), forward_usr1=p.forward_usr1,
    )
