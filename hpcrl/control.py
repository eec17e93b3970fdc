"""The run controller: carries out a run's lifecycle; the only caller of backends.

The rules live in hpcrl.lifecycle (pure, on a clock); this module gathers what they need (the
checkpoint step from the trainer adapter, the state under the run's lock), calls them, and
carries out the actions they return with the run's backend:

submit -> segment 1 queued. Each segment, when it starts (`segment_begin`, called by the job
script), records itself and queues exactly one successor behind it (afterany); when its trainer
exits (`segment_end`) it records the outcome and the chain completes, stops (budget,
max_segments, crash loop, cancel: the queued successor is cancelled) or continues. A successor
that starts for a run with nothing left to do exits at once. Backends that cannot queue from
inside a job reconcile from outside (`Backend.reconcile`, given `WatcherOps`).

`clock` is the one source of `now` here (tests replace it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from . import __version__, lifecycle, protocol, runs
from .atomicio import atomic_write_json, atomic_write_text
from .backends import for_site
from .errors import BackendError, RunError, SiteError
from .lifecycle import Cancel, Queue, Stop
from .paths import hpcrl_home
from .render import ScriptParts, expand_path, render_script, venv_path
from .runs import Run, RunLayout
from .spec import world_size
from .stack import describe_size, gpu_check, nccl_setup, size_of
from .trainers import get_trainer
from .trainers.base import TrainerContext, torchrun_argv
from .venv import build_command, requirements
from .venv import path_for as venv_path_for

clock = time.time


# ---------------------------------------------------------------- planning and rendering


def default_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(clock()))}"


def run_dir_for(resolved: dict, run_id: str) -> Path:
    site = resolved["site"]
    outputs = expand_path(site.get("outputs") or str(hpcrl_home() / "runs"), site, "outputs")
    return Path(os.path.abspath(outputs)) / run_id


def _site_backend(resolved: dict):
    """The site's backend, after it filled in the site values it knows (TPU: gcloud's config)."""
    backend = for_site(resolved["site"])
    backend.complete_site(resolved["site"])
    return backend


def trainer_context(resolved: dict, run_id: str, layout: RunLayout) -> TrainerContext:
    spec = resolved["spec"]
    return TrainerContext(run_id=run_id, run_dir=layout.root, ckpt_dir=layout.checkpoints, args=spec["args"],
                          site=resolved["site"], resources=spec["resources"])


def script_for(resolved: dict, run_id: str, run_dir: Path) -> str:
    """The segment script: each piece from its owner, put together by render."""
    from .shell import TRAINER_PY

    site = resolved["site"]
    backend = for_site(site)
    layout = backend.job_layout(run_id, RunLayout(run_dir))
    trainer = get_trainer(resolved["spec"]["trainer"])
    ctx = trainer_context(resolved, run_id, layout)
    ctx.python = TRAINER_PY
    command, ranks = trainer.command(ctx), None
    res, reqs, gpu = resolved["spec"]["resources"], requirements(resolved), gpu_check(site, trainer)
    if trainer.ranks is not None and world_size(res) > 1:
        ranks = backend.rank_launch(resolved)  # one torchrun per node, and where they meet
        command = [*ranks.prefix, *torchrun_argv(ctx.python, res["nodes"], res["ranks_per_node"], ranks.rendezvous,
                                                 trainer.entry(ctx))]
    return render_script(ScriptParts(
        run_id=run_id, site=site, spec_env=resolved["spec"].get("env", {}), layout=layout,
        header=backend.directives(resolved, run_id, layout), job_id_line=backend.job_id_line(),
        hpcrl_python=site.get("hpcrl_python") or sys.executable, command=command,
        trainer_env=trainer.env(ctx), bootstrap=trainer.bootstrap(ctx), forward_usr1=trainer.obeys_protocol,
        venv=venv_path(site, reqs), venv_prebuilt=backend.jobs_share_this_environment,
        requirements=reqs, venv_build_command=build_command(run_id),
        venv_install=trainer.venv_installer(ctx), nothing_to_do=protocol.EXIT_NOTHING_TO_DO,
        exit_continue=protocol.EXIT_CONTINUE, ranks_prelude=ranks.prelude if ranks else None,
        gpu_check=gpu, venv_size=describe_size(size_of(site, reqs)),
        nccl=nccl_setup(site, res.get("nodes") or 1) if gpu else None))


def render(resolved: dict, run_id: str | None = None) -> str:
    """What submit would send: the same code path, without writing or submitting anything."""
    backend = _site_backend(resolved)
    run_id = run_id or default_run_id(resolved["spec"]["name"])
    return backend.dry_run(resolved, run_id, script_for(resolved, run_id, run_dir_for(resolved, run_id)))


# ---------------------------------------------------------------- creating and submitting


def _write_run_dir(tmp: Path, final: Path, resolved: dict, run_id: str, script: str) -> None:
    lay, trainer = RunLayout(tmp), get_trainer(resolved["spec"]["trainer"])
    lay.logs.mkdir(parents=True)
    lay.checkpoints.mkdir()
    lay.spec.write_text(json.dumps(runs.frozen_spec(resolved), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    lay.script.write_text(script, encoding="utf-8")
    os.chmod(lay.script, 0o755)
    reqs = requirements(resolved)
    if reqs:
        lay.requirements.write_text("\n".join(reqs) + "\n", encoding="utf-8")
    job_layout = for_site(resolved["site"]).job_layout(run_id, RunLayout(final))
    for name, text in trainer.files(trainer_context(resolved, run_id, job_layout)).items():
        lay.file(name).parent.mkdir(parents=True, exist_ok=True)
        lay.file(name).write_text(text, encoding="utf-8")
    pkg = Path(__file__).resolve().parent
    shutil.copytree(pkg, lay.lib / "hpcrl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    site, spec = resolved["site"], resolved["spec"]
    atomic_write_json(lay.state, lifecycle.new_state(run_id, site["name"], site["scheduler"], spec["trainer"],
                                                     spec["budget"], clock(), hpcrl_version=__version__))


def create_run(resolved: dict, run_id: str | None = None) -> Run:
    """Write the run directory whole (temp dir + rename) and register it; nothing half-made."""
    run_id = run_id or default_run_id(resolved["spec"]["name"])
    if run_id in runs.registered_ids():
        raise RunError(f"run '{run_id}' already exists; `hpcrl resume {run_id}` continues it, or pick another --name")
    run_dir = run_dir_for(resolved, run_id)
    script = script_for(resolved, run_id, run_dir)
    if run_dir.exists():
        raise RunError(f"run directory {run_dir} already exists; pick another --name")
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"cannot create the outputs directory {run_dir.parent}: {e.strerror}") from None
    tmp = run_dir.parent / f".tmp-{run_id}-{os.getpid()}"
    renamed = False
    try:
        _write_run_dir(tmp, run_dir, resolved, run_id, script)
        os.rename(tmp, run_dir)
        renamed = True
        runs.register(run_id, run_dir)
    except BaseException:  # a Ctrl-C included: no directory of ours left without its registry entry
        shutil.rmtree(tmp, ignore_errors=True)
        if renamed and run_id not in runs.registered_ids():
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return Run(run_dir)


# Prints the version of a distribution without importing it (verl's __init__ imports ray and torch).
_PROBE = ("import sys\nfrom importlib import metadata\ntry:\n    print(metadata.version(sys.argv[1]))\n"
          "except metadata.PackageNotFoundError:\n    sys.exit(3)\n")


def check_trainer_python(resolved: dict, warn=None) -> None:
    """site.trainer_python must exist and have the trainer's package (a one-line SiteError);
    another version than the pinned one is only a warning. Checked where the job will look: on
    a site whose jobs see this machine's filesystem."""
    import shutil as sh
    import subprocess

    site, trainer = resolved["site"], get_trainer(resolved["spec"]["trainer"])
    path = site.get("trainer_python")
    if not path or not for_site(site).jobs_share_this_environment:
        return
    where = f"site '{site['name']}': trainer_python {path}"
    found = sh.which(path)
    if found is None:
        raise SiteError(f"{where}: {'no such file' if not os.path.exists(path) else 'not an executable'}; "
                        f"give the python of the environment that has the trainer (--set site.trainer_python=PATH)")
    if not trainer.package:
        return
    try:
        out = subprocess.run([found, "-c", _PROBE, trainer.package], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SiteError(f"{where}: cannot run it ({e.__class__.__name__})") from None
    if out.returncode == 3:
        pin = f"=={trainer.package_version}" if trainer.package_version else ""
        raise SiteError(f"{where}: has no '{trainer.package}' installed, which trainer '{trainer.name}' needs; "
                        f"pip install '{trainer.package}{pin}' into it or point to another interpreter")
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise SiteError(f"{where}: does not run as a Python interpreter ({tail})")
    version = out.stdout.strip()
    if trainer.package_version and version != trainer.package_version:
        (warn or _warn)(f"site.trainer_python has {trainer.package} {version}, not the {trainer.package_version} "
                        f"hpcrl was checked against; the run may still work")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def build_venv(resolved: dict, say=None, check_artifacts: bool = True) -> bool:
    """The run's venv, built here unless it is ready (True when this call built it). Sites whose
    jobs run elsewhere (TPU VMs) build it in the job instead: nothing to do here. Before a build,
    every file the set pins beyond the default index is looked up on the real indexes for the
    compute nodes' platform (hpcrl/published.py): a never-published wheel is refused here, in one
    line, not found by pip mid-build or by the first segment after its queue wait."""
    from . import venv

    plan = venv.plan(resolved)
    if plan is None or not venv.built_here(resolved):
        return False
    if check_artifacts and venv.readiness(plan) is not None:
        from . import published

        published.check(plan.requirements, resolved["site"], warn=_warn)
    return venv.ensure(plan, say)


def submit(resolved: dict, run_id: str | None = None, check_artifacts: bool = True) -> Run:
    backend = _site_backend(resolved)
    check_trainer_python(resolved)
    get_trainer(resolved["spec"]["trainer"]).check_submit(resolved["spec"]["args"],
                                                          world_size(resolved["spec"]["resources"]))
    if run_id is not None and run_id in runs.registered_ids():  # before a long venv build, not after
        raise RunError(f"run '{run_id}' already exists; `hpcrl resume {run_id}` continues it, or pick another --name")
    # On the login side, before anything of the run exists: the job only activates it (compute
    # nodes may mount venv_root read-only), and a failed build leaves no run behind.
    build_venv(resolved, check_artifacts=check_artifacts)
    check_trainer_imports(resolved)  # in the interpreter the job will run, now that it exists
    run = create_run(resolved, run_id)
    try:
        with run.locked() as state:
            lifecycle.add_event(state, "submitted", clock())
            _carry_out(run, state, [Queue(after=None)])
    except BaseException:
        # Nothing was queued: leave no half-created run behind.
        runs.unregister(run.id)
        shutil.rmtree(run.dir, ignore_errors=True)
        raise
    backend.after_change(run)
    return run


def asked_of(resolved: dict) -> dict:
    """What a segment is queued with (its record in state.json): status measures its goodput, cost
    and ETA by these, not by what a later resume asks for."""
    res, site = resolved["spec"].get("resources") or {}, resolved["site"]
    return {"hours": float(resolved["spec"]["budget"]["hours"]), "nodes": int(res.get("nodes") or 1),
            "gpus_per_node": int(res.get("gpus_per_node") or site.get("gpus_per_node") or 0),
            "ranks_per_node": res.get("ranks_per_node")}


def check_trainer_imports(resolved: dict) -> None:
    """What the job would trip on at its start (the reward imports, the data's columns and rows,
    the model directory), checked at submit in the job's own interpreter: the run's venv (built on
    this side already), site.trainer_python or hpcrl's. Only where the job sees this machine's
    files and interpreters (not a TPU VM's)."""
    site, spec = resolved["site"], resolved["spec"]
    if not for_site(site).jobs_share_this_environment:
        return
    venv = venv_path_for(resolved)
    if venv:
        python = os.path.join(venv, "bin", "python")
        if not os.access(python, os.X_OK):
            return  # not built (a dry run); the job says so itself
    else:
        python = shutil.which(site.get("trainer_python") or site.get("hpcrl_python") or sys.executable)
    if python:
        env = {**os.environ, **{str(k): str(v) for k, v in (spec.get("env") or {}).items()}}
        get_trainer(spec["trainer"]).check_python(spec["args"], python, env)


def submit_hint(run: Run) -> list[str]:
    return backend_for(run).submit_hint(run.id)


def backend_for(run: Run):
    return for_site(run.site())


def _carry_out(run: Run, state: dict, actions: list, backend=None) -> list[str]:
    """Execute the lifecycle's actions inside the run's lock; the job ids queued. A failing
    submit raises BackendError (the caller decides what that means); cancels are best effort
    only where the caller says so."""
    backend = backend or backend_for(run)
    queued = []
    for action in actions:
        if isinstance(action, Queue):
            resolved = run.spec()
            resolved["spec"]["budget"] = dict(state["budget"])  # as it is now, not as last committed
            job_id = backend.submit(run, resolved, after=action.after)
            seg = lifecycle.queued(state, job_id, action.after, clock())
            seg["asked"] = asked_of(resolved)
            queued.append(str(job_id))
        elif isinstance(action, Cancel) and action.job_ids:
            backend.cancel(list(action.job_ids), run)
    return queued


# ---------------------------------------------------------------- inside the job


def _trainer(run: Run, spec: dict | None = None):
    return get_trainer((spec or run.spec())["spec"]["trainer"])


def checkpoint_step(run: Run, spec: dict | None = None, remote: bool = False) -> int | None:
    return _trainer(run, spec).checkpoint_step(run.dir, run.layout.checkpoints, remote=remote)


RETRY_FIRST_S, RETRY_MAX_S = 2.0, 60.0  # back-off between submits while the scheduler is away
sleep = time.sleep


def segment_begin(run_dir: str, job_id: str, environ=None) -> tuple[int, float, bool] | None:
    """Record the segment's start and queue its successor: (segment number, deadline, whether the
    successor still has to be queued: the job script then keeps trying in the background), or
    None when nothing is left to do."""
    environ = os.environ if environ is None else environ
    run = Run(Path(run_dir))
    spec = run.spec()
    backend = for_site(spec["site"])
    step = checkpoint_step(run, spec, remote=True)
    job_end = _job_end(backend, run, str(job_id), environ, run.state()["budget"]["hours"])
    protocol.take_error(run.dir)  # an earlier attempt's reason is history (and in state.json)
    with run.locked() as state:
        seg, actions = lifecycle.begin(state, str(job_id), step, clock(),
                                       chains=not backend.reconciles_outside_job, work=protocol.read_progress(run.dir))
        if seg["state"] == lifecycle.SegState.SKIPPED:
            _carry_out(run, state, actions, backend)
            return None
        # a lost segment (hard kill while saving) never reached its end hook: its flag would show
        # this one as CHECKPOINTING throughout
        run.layout.checkpointing_flag.unlink(missing_ok=True)
        pending = False
        try:
            _carry_out(run, state, actions, backend)
        except BackendError as e:
            lifecycle.successor_failed(state, str(e), clock(), until=job_end)
            pending = True
    return seg["k"], job_end - float(spec["site"]["exit_margin_s"]), pending


def _job_end(backend, run: Run, job_id: str, environ, hours: float) -> float:
    """The job's real end time from its scheduler; the walltime from now if it cannot say."""
    try:
        end = backend.end_time(job_id, run, environ)
    except BackendError as e:
        print(f"hpcrl: warning: cannot read the job's end time ({e}); assuming the full walltime", file=sys.stderr)
        end = None
    return end or clock() + hours * 3600


def keep_successor(run_dir: str, job_id: str, until: float | None = None) -> bool:
    """Inside a job whose successor could not be queued: retry with back-off until it is queued,
    the run needs none any more, or `until` (default: the job's end, from its environment)
    passes. True when nothing is missing. The run's lock is held only for each attempt, never
    while waiting."""
    run = Run(Path(run_dir))
    backend = backend_for(run)
    if until is None:
        until = _job_end_from_env(run.spec(), os.environ)
    delay = RETRY_FIRST_S
    while True:
        with run.locked() as state:
            actions = lifecycle.needs_successor(state, job_id)
            if not actions:
                return True
            try:
                _carry_out(run, state, actions, backend)
                return True
            except BackendError as e:
                if clock() + delay >= until:
                    lifecycle.queue_failed(state, str(e), clock())
                    return False
                lifecycle.successor_failed(state, str(e), clock(), until=until)
        sleep(delay)
        delay = min(RETRY_MAX_S, delay * 2)


def _job_end_from_env(spec: dict, environ) -> float:
    """Inside the job, its end: the deadline the script exported plus the margin it was cut by."""
    deadline = environ.get(protocol.ENV_DEADLINE)
    margin = float(spec["site"]["exit_margin_s"])
    return (float(deadline) + margin if deadline else clock() + margin) - 2.0


def segment_end(run_dir: str, job_id: str, rc: int, environ=None) -> None:
    """Record the trainer's exit and decide whether the chain goes on; a successor the scheduler
    does not take now is retried until the job's end."""
    environ = os.environ if environ is None else environ
    run = Run(Path(run_dir))
    spec = run.spec()
    backend = for_site(spec["site"])
    step = checkpoint_step(run, spec, remote=True)
    with run.locked() as state:
        actions = lifecycle.end(state, str(job_id), rc, step, clock(), obeys_protocol=_trainer(run, spec).obeys_protocol,
                                chains=not backend.reconciles_outside_job, exit_complete=protocol.EXIT_COMPLETE,
                                exit_continue=protocol.EXIT_CONTINUE, error_tail=lambda: error_tail(run, state),
                                error=protocol.take_error(run.dir), trained=_trained(run, state, str(job_id)),
                                own_tail=_own_tail(run, str(job_id)), work=protocol.read_progress(run.dir))
        run.layout.checkpointing_flag.unlink(missing_ok=True)
        try:
            _carry_out(run, state, actions, backend)
            return
        except BackendError as e:
            until = _job_end_from_env(spec, environ)
            lifecycle.successor_failed(state, str(e), clock(), until=until)
    keep_successor(run_dir, job_id, until)


def segment_next_here(run_dir: str, job_id: str) -> tuple[str, int] | None:
    """Inside a job whose machine runs the run's next segment itself (a TPU VM, which has no
    walltime): queue it here, (its job id, its seconds), or None when the run needs none (the
    lifecycle's stop, budget and crash-loop rules decide, as the watcher's would)."""
    run = Run(Path(run_dir))
    backend = backend_for(run)
    step = checkpoint_step(run, remote=True)
    with run.locked() as state:
        # killed at its deadline before its end hook ran: judged by its checkpoints
        lifecycle.close_segment(state, job_id, "ended without its end hook (killed at its deadline)", step, clock())
        if not any(isinstance(a, Queue) for a in lifecycle.next_segment(state, clock())):
            return None
        next_id = backend.next_job_here(state, job_id)
        seg = lifecycle.queued(state, next_id, job_id, clock())
        resolved = run.spec()
        resolved["spec"]["budget"] = dict(state["budget"])
        seg["asked"] = asked_of(resolved)
        state["state"], state["reason"] = lifecycle.RunState.RESUBMITTED.value, ""
        lifecycle.add_event(state, f"next segment queued on the same machine (job {next_id})", clock())
        return next_id, max(1, round(float(state["budget"]["hours"]) * 3600))


def _trained(run: Run, state: dict, job_id: str) -> bool | None:
    """Whether the segment logged a training step (its metrics records carry its number)."""
    from .status.metrics import read_records, segment_timings

    seg = lifecycle.segment_by_job(state, job_id)
    if seg is None or not seg.get("k"):
        return None
    return seg["k"] in segment_timings(read_records(run.layout.metrics))


def _own_tail(run: Run, job_id: str) -> str | None:
    """The last line of this segment's own log that is the trainer's (not hpcrl's)."""
    tail = error_tail(run, {"segments": [{"job_id": job_id}]}, lines=1)
    return None if tail == "(no log output)" else tail


def error_tail(run: Run, state: dict, lines: int = 3) -> str:
    """The last lines of the newest segment log that are the trainer's own (not hpcrl's)."""
    for seg in reversed(state["segments"]):
        try:
            text = run.layout.log(seg.get("job_id")).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        keep = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("hpcrl:")]
        if keep:
            return " | ".join(keep[-lines:])[-400:]
    return "(no log output)"


# ---------------------------------------------------------------- user commands


def cancel(run_id: str) -> Run:
    run = Run.by_id(run_id)
    with run.locked() as state:
        actions = lifecycle.cancel(state, clock())
    cancels = [j for a in actions if isinstance(a, Cancel) for j in a.job_ids]
    if cancels:
        backend_for(run).cancel(cancels, run)
    return run


def stop(run_id: str) -> Run:
    """`hpcrl stop`: the running segment checkpoints and exits as at its walltime (the backend
    signals it the same way), nothing is queued after it; the run ends STOPPED, resumable."""
    run = Run.by_id(run_id)
    backend = backend_for(run)
    with run.locked() as state:
        actions, running = lifecycle.stop(state, clock())
        _carry_out(run, state, actions, backend)
    if running:
        backend.checkpoint_stop(list(running), run)
    backend.after_change(run)
    return run


def version_note(run: Run) -> str | None:
    """One line when this hpcrl is not the one that created the run: its jobs keep running the
    creator's code (the run's lib/ snapshot) while this one builds, queues and reconciles. None
    for the same version, and for a run made before versions were recorded (nothing to compare)."""
    created = run.state().get("hpcrl_version")
    if not created or created == __version__:
        return None
    return (f"run {run.id} was created by hpcrl {created}; resuming with {__version__} "
            f"(its jobs keep running the {created} code in {run.layout.lib})")


def resume(run_id: str, hours: float | None = None, total_hours: float | None = None,
           max_segments: int | None = None, nodes: int | None = None, sets: list[str] | None = None) -> Run:
    """Continue a stopped, cancelled or failed run from its last good checkpoint. New hours
    change the budget record in state.json (its one owner) and the job script, together; new
    resources (nodes, ranks_per_node, ...) the frozen spec and the job script, together."""
    from .spec import check_resume_budget, resize, validate_qos
    from .siterules import resume_segments

    run = Run.by_id(run_id)
    backend = backend_for(run)
    reconcile(run, interval_s=60.0)
    build_venv(run.spec())  # gone since (a cleaned venv_root, a new base Python): rebuilt here, not in the job
    check_resume_budget(hours, total_hours, max_segments, run.state()["budget"])
    if hours is not None:
        validate_qos(run.site(), hours)
    if max_segments is not None:
        max_segments = int(max_segments)
    max_segments = resume_segments(run.site(), lifecycle.ran_segments(run.state()), max_segments)
    resolved = run.spec()
    old_res, new_res = resolved["spec"]["resources"], resize(resolved, sets, nodes)
    if new_res is not None:
        resolved["spec"]["resources"] = new_res
        # the new world must render (a backend may refuse it) before anything changes
        script_for({**resolved, "spec": {**resolved["spec"], "budget": run.state()["budget"]}}, run.id, run.dir)
    with run.locked() as state:
        actions = lifecycle.resume(state, clock(), hours, total_hours, max_segments)
        if state.get("hpcrl_version") and state["hpcrl_version"] != __version__:
            lifecycle.add_event(state, f"resumed with hpcrl {__version__} (created by {state['hpcrl_version']})", clock())
        if new_res is not None:
            atomic_write_json(run.layout.spec, runs.frozen_spec(resolved))
            lifecycle.add_event(state, f"resources: {_world(old_res)} -> {_world(new_res)}", clock())
        if hours is not None or new_res is not None:
            resolved["spec"]["budget"] = dict(state["budget"])
            atomic_write_text(run.layout.script, script_for(resolved, run.id, run.dir), mode=0o755)
        _carry_out(run, state, actions, backend)
    backend.after_change(run)
    return run


def _world(res: dict) -> str:
    nodes, ranks = int(res.get("nodes") or 1), res.get("ranks_per_node")
    return f"{nodes} node(s)" + (f" x {ranks} rank(s)" if ranks else "")


# ---------------------------------------------------------------- reconciling


def refresh(run: Run) -> dict:
    """Reconcile one active run with its scheduler (see refresh_many)."""
    return refresh_many([run])[run.id]


def refresh_many(run_list: list[Run], problems: dict | None = None) -> dict[str, dict]:
    """Reconcile active runs with their schedulers: a chain with no live job left is STOPPED.

    One batched `poll` per backend for every live job of every run (status costs O(1) scheduler
    calls however many runs there are). Runs whose backend reconciles outside the job (TPU) are
    left as their watcher last saw them: `status` never waits on the network.
    """
    out, groups = {}, {}
    for run in run_list:
        state = run.state()
        out[run.id] = state
        if not lifecycle.is_active(state) and not lifecycle.live_segments(state):
            continue  # final and closed: nothing to ask the scheduler
        site = run.site()
        backend = for_site(site)
        if backend.reconciles_outside_job:
            continue
        key = (site["scheduler"], site["name"])
        groups.setdefault(key, (backend, []))[1].append((run, state))
    for backend, members in groups.values():
        jobs = [(run, s["job_id"]) for run, state in members for s in lifecycle.live_segments(state)]
        try:
            infos = backend.poll(jobs) if jobs else {}
        except BackendError as e:  # the scheduler is away: say so, judge nothing; the next call retries
            for run, _ in members:
                if problems is not None:
                    problems[run.id] = f"scheduler unreachable ({e}); showing the last known state"
            continue
        for run, state in members:
            if not lifecycle.is_active(state):
                # a final run (cancelled, say) whose segment was killed before its end hook ran:
                # without this it would read RUNNING for ever, and `logs -f` would wait on it
                ended = [s["job_id"] for s in lifecycle.live_segments(state)
                         if s["job_id"] in infos and infos[s["job_id"]].state.finished]
                if ended:
                    out[run.id] = _close_ended(run, ended)
                continue
            if lifecycle.awaits_successor(state, clock()):
                continue  # its job is still queueing the successor: not a chain that ended
            live = lifecycle.live_segments(state)
            if any(not infos[s["job_id"]].state.finished for s in live if s["job_id"] in infos):
                continue
            out[run.id] = _close_if_unchanged(run, state["segments"])
    return out


def _close_ended(run: Run, job_ids: list) -> dict:
    step = checkpoint_step(run)
    with run.locked() as state:
        for job_id in job_ids:
            lifecycle.close_segment(state, job_id, f"ended after the run was {state['state'].lower()}", step, clock())
    return run.state()


def _close_if_unchanged(run: Run, snapshot: list) -> dict:
    step = checkpoint_step(run)
    with run.locked() as state:
        if lifecycle.is_active(state) and state["segments"] == snapshot:
            lifecycle.no_live_jobs(state, step, clock())
        # else something moved meanwhile (a segment's hook ran): trust it
    return run.state()


class WatcherOps:
    """The lifecycle steps a backend's reconciler (Backend.reconcile) may take."""

    def queue_next(self, run: Run) -> str | None:
        """Queue the next segment of an active run with no live segment: its job id, or None when
        the run must stop instead (budget, max_segments, crash loop) or needs nothing."""
        backend = backend_for(run)
        with run.locked() as state:
            actions = lifecycle.next_segment(state, clock())
            queued = _carry_out(run, state, actions, backend)
            if queued:
                state["state"], state["reason"] = lifecycle.RunState.RESUBMITTED.value, ""
                lifecycle.add_event(state, f"next segment queued (job {queued[0]})", clock())
        backend.after_change(run)
        return queued[0] if queued else None

    def close_segment(self, run: Run, job_id: str, why: str) -> None:
        step = checkpoint_step(run)
        with run.locked() as state:
            lifecycle.close_segment(state, job_id, why, step, clock())

    def fail(self, run: Run, kind: Stop, detail: str, **data) -> None:
        with run.locked() as state:
            lifecycle.fail(state, kind, detail, clock(), **data)

    def refresh_checkpoint_cache(self, run: Run) -> None:
        checkpoint_step(run, remote=True)


def reconcile(run: Run, interval_s: float) -> dict:
    """One step of keeping a run going: its backend's reconciler, or a plain refresh."""
    backend = backend_for(run)
    if backend.reconciles_outside_job:
        return backend.reconcile(run, WatcherOps(), interval_s)
    return refresh(run)


def follow(run: Run, interval_s: float, keep_going: bool) -> None:
    """Before `logs`: whatever the backend does to make the local logs current (a TPU run's are
    copied from its bucket by a reconcile step), and with keep_going (-f) keeps doing it."""
    from .errors import HpcrlError

    backend = backend_for(run)
    if not backend.reconciles_outside_job:
        return
    try:
        backend.reconcile(run, WatcherOps(), interval_s)
    except HpcrlError:
        pass  # a gcloud hiccup: print what is here
    if keep_going:
        backend.follow(run, WatcherOps(), interval_s)
