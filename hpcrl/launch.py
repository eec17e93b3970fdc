"""Orchestration of a run's lifecycle: the only caller of backends.

submit -> segment 1 queued. Each segment, when it starts (`segment_begin`, called by the job
script), records itself and queues exactly one successor behind it (afterany); when its trainer
exits (`segment_end`) it records the outcome and decides: complete, stop (budget, max_segments,
crash loop, cancel) — then the queued successor is cancelled — or continue, and the successor
runs. A successor that starts for a run with nothing left to do exits at once.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from . import atomicio, protocol, runs
from .backends import get_backend
from .errors import BackendError, RunError, SpecError
from .paths import hpcrl_home
from .render import RunPaths, expand_path, render_script, requirements, trainer_context
from .runs import Run
from .trainers import get_trainer

NOTHING_TO_DO = 3  # exit status of `_segment begin` when the run needs no more segments


# ---------------------------------------------------------------- planning and submission


def default_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_paths(resolved: dict, run_id: str) -> RunPaths:
    site = resolved["site"]
    outputs = expand_path(site.get("outputs") or str(hpcrl_home() / "runs"), site, "outputs")
    if not os.path.isabs(outputs):
        outputs = os.path.abspath(outputs)
    return RunPaths(run_id=run_id, run_dir=Path(outputs) / run_id,
                    hpcrl_python=site.get("hpcrl_python") or sys.executable)


def _site_backend(resolved: dict):
    """The site's backend, after it filled in the site values it knows (TPU: gcloud's config)."""
    backend = get_backend(resolved["site"]["scheduler"], resolved["site"])
    backend.complete_site(resolved["site"])
    return backend


def render(resolved: dict, run_id: str | None = None) -> str:
    """What submit would send: the same code path, without writing or submitting anything."""
    backend = _site_backend(resolved)
    run_id = run_id or default_run_id(resolved["spec"]["name"])
    return backend.dry_run(resolved, run_id, render_script(resolved, run_paths(resolved, run_id)))


def _write_run_dir(tmp: Path, resolved: dict, paths: RunPaths, script: str) -> None:
    trainer = get_trainer(resolved["spec"]["trainer"])
    (tmp / "logs").mkdir(parents=True)
    (tmp / "checkpoints").mkdir()
    (tmp / "spec.json").write_text(json.dumps(resolved, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    (tmp / "job.sh").write_text(script, encoding="utf-8")
    os.chmod(tmp / "job.sh", 0o755)
    reqs = requirements(resolved)
    if reqs:
        (tmp / "requirements.txt").write_text("\n".join(reqs) + "\n", encoding="utf-8")
    for name, text in trainer.files(trainer_context(resolved, paths)).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text, encoding="utf-8")
    pkg = Path(__file__).resolve().parent
    shutil.copytree(pkg, tmp / "lib" / "hpcrl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    atomicio.atomic_write_json(tmp / "state.json", runs.new_state(paths.run_id, resolved))


def create_run(resolved: dict, run_id: str | None = None) -> Run:
    """Write the run directory whole (temp dir + rename) and register it; nothing half-made."""
    run_id = run_id or default_run_id(resolved["spec"]["name"])
    if run_id in runs.registered_ids():
        raise RunError(f"run '{run_id}' already exists; `hpcrl resume {run_id}` continues it, or pick another --name")
    paths = run_paths(resolved, run_id)
    script = render_script(resolved, paths)
    if paths.run_dir.exists():
        raise RunError(f"run directory {paths.run_dir} already exists; pick another --name")
    try:
        paths.run_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"cannot create the outputs directory {paths.run_dir.parent}: {e.strerror}") from None
    tmp = paths.run_dir.parent / f".tmp-{run_id}-{os.getpid()}"
    try:
        _write_run_dir(tmp, resolved, paths, script)
        os.rename(tmp, paths.run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    runs.register(run_id, paths.run_dir)
    return Run(paths.run_dir)


def submit(resolved: dict, run_id: str | None = None) -> Run:
    _site_backend(resolved)
    run = create_run(resolved, run_id)
    try:
        with run.locked() as state:
            runs.add_event(state, "submitted")
            _queue_segment(run, state, after=None)
    except BaseException:
        # Nothing was queued: leave no half-created run behind.
        runs.unregister(run.id)
        shutil.rmtree(run.dir, ignore_errors=True)
        raise
    _publish_state(run)  # [tpu]
    return run


def backend_for(run: Run):
    spec = run.spec()
    return get_backend(spec["site"]["scheduler"], spec["site"])


def _queue_segment(run: Run, state: dict, after: str | None) -> dict:
    """Submit one more job of the run (inside the run's lock) and record it as QUEUED."""
    job_id = backend_for(run).submit(run.dir / "job.sh", run.dir, run.id, after=after)
    seg = {"job_id": str(job_id), "state": runs.SEG_QUEUED, "submitted": time.time(), "after": after}
    state["segments"].append(seg)
    return seg


# ---------------------------------------------------------------- inside the job


def _trainer(run: Run, spec: dict | None = None):
    return get_trainer((spec or run.spec())["spec"]["trainer"])


def _ckpt_step(run: Run, spec: dict | None = None) -> int | None:
    return _trainer(run, spec).checkpoint_step(run.dir, run.dir / "checkpoints")


def _close_lost_segments(run: Run, state: dict, except_job: str, step: int | None) -> None:
    # A segment still marked RUNNING when another starts ended without its end hook (node
    # failure, hard cancel, OOM of the batch shell): close it with what its checkpoints show.
    for seg in state["segments"]:
        if seg["state"] == runs.SEG_RUNNING and seg.get("job_id") != except_job:
            _mark_lost(state, seg, step, "ended without its end hook")


def _mark_lost(state: dict, seg: dict, step: int | None, why: str) -> None:
    """A running segment whose job ended without its end hook: judged by its checkpoints."""
    seg.update(state=runs.SEG_LOST, ended=time.time(), end_step=step, rc=None, reason=why)
    _count_progress(state, seg)
    runs.add_event(state, f"segment {seg.get('k') or '-'} (job {seg.get('job_id')}) {why}")


def _count_progress(state: dict, seg: dict) -> None:
    start, end = seg.get("start_step"), seg.get("end_step")
    progressed = end is not None and (start is None or end > start)
    state["no_progress"] = 0 if progressed else state.get("no_progress", 0) + 1


def _stop_reason(state: dict) -> str | None:
    """Why the chain must not run another segment (counting those started so far), or None."""
    budget = state["budget"]
    if state["no_progress"] >= 2:
        return "crash loop"
    if budget.get("total_hours") is not None and runs.used_hours(state) >= budget["total_hours"] - 1e-9:
        return f"budget spent ({runs.used_hours(state):.2f} of {budget['total_hours']:g} h)"
    if runs.ran_segments(state) >= budget["max_segments"]:
        return f"max_segments reached ({budget['max_segments']})"
    return None


def segment_begin(run_dir: str, job_id: str, environ=None) -> tuple[int, float] | None:
    """Record the segment's start and queue its successor; None when nothing is left to do."""
    environ = os.environ if environ is None else environ
    run = Run(Path(run_dir))
    spec = run.spec()
    backend = get_backend(spec["site"]["scheduler"], spec["site"])
    step = _ckpt_step(run, spec)
    with run.locked() as state:
        seg = runs.segment_by_job(state, job_id)
        if seg is None:  # a job the user submitted by hand (sbatch job.sh): adopt it
            seg = {"job_id": str(job_id), "submitted": time.time(), "after": None}
            state["segments"].append(seg)
        _close_lost_segments(run, state, str(job_id), step)
        reason = None if state["state"] in runs.ACTIVE_STATES else state["state"].lower()
        reason = reason or _stop_reason(state)
        if reason:
            seg.update(state=runs.SEG_SKIPPED, started=None, ended=time.time(), reason=reason)
            _finish_run(run, state, reason)
            return None
        seg.update(state=runs.SEG_RUNNING, started=time.time(), start_step=step, k=runs.ran_segments(state) + 1)
        state["state"], state["reason"] = runs.RUNNING, ""
        runs.add_event(state, f"segment {seg['k']} started (job {job_id})")
        if backend.chains_successors and _stop_reason(state) is None:
            try:
                _queue_segment(run, state, after=str(job_id))
            except BackendError as e:
                # This segment still runs; segment_end tries again to queue the next one.
                runs.add_event(state, f"could not queue the successor: {e}")
    return seg["k"], _job_end(backend, run, str(job_id), environ, spec) - float(spec["site"]["exit_margin_s"])


def _job_end(backend, run: Run, job_id: str, environ, spec: dict) -> float:
    """The job's real end time from its scheduler; the walltime from now if it cannot say."""
    try:
        end = backend.end_time(job_id, run.dir, environ)
    except BackendError as e:
        print(f"hpcrl: warning: cannot read the job's end time ({e}); assuming the full walltime", file=sys.stderr)
        end = None
    return end or time.time() + spec["spec"]["budget"]["hours"] * 3600


def _finish_run(run: Run, state: dict, reason: str) -> None:
    """Stop the chain: set the final state (unless already final) and cancel queued successors."""
    if state["state"] not in runs.FINAL_STATES:
        if reason == "crash loop":
            state["state"] = runs.FAILED
            state["reason"] = f"no checkpoint progress in 2 segments in a row; last error: {error_tail(run, state)}"
        else:
            state["state"], state["reason"] = runs.STOPPED, reason
        runs.add_event(state, f"run {state['state'].lower()}: {state['reason']}")
    queued = [s for s in state["segments"] if s["state"] == runs.SEG_QUEUED]
    for s in queued:
        s.update(state=runs.SEG_CANCELLED, ended=time.time())
    if queued:
        backend_for(run).cancel([s["job_id"] for s in queued], run_dir=run.dir)


def segment_end(run_dir: str, job_id: str, rc: int) -> None:
    """Record the trainer's exit and decide whether the chain goes on."""
    run = Run(Path(run_dir))
    step = _ckpt_step(run)
    with run.locked() as state:
        seg = runs.segment_by_job(state, job_id)
        if seg is None or seg["state"] != runs.SEG_RUNNING:
            return
        seg.update(ended=time.time(), rc=rc, end_step=step)
        (run.dir / ".checkpointing").unlink(missing_ok=True)
        if rc == protocol.EXIT_COMPLETE:
            seg["state"] = runs.SEG_COMPLETE
            if state["state"] in runs.ACTIVE_STATES:
                state["state"], state["reason"] = runs.COMPLETED, "training complete"
            runs.add_event(state, f"segment {seg['k']} completed the training")
            _finish_run(run, state, "training complete")
            return
        _count_progress(state, seg)
        # A trainer that knows no protocol (MaxText) is killed at the walltime: a segment that
        # advanced its checkpoint is a continuation, whatever its exit code.
        ok = rc == protocol.EXIT_CONTINUE or (not _trainer(run).obeys_protocol and state["no_progress"] == 0)
        seg["state"] = runs.SEG_CONTINUE if ok else runs.SEG_FAILED
        runs.add_event(state, f"segment {seg['k']} ended with exit code {rc} at checkpoint step {step}")
        reason = None if state["state"] in runs.ACTIVE_STATES else state["state"].lower()
        reason = reason or _stop_reason(state)
        if reason:
            _finish_run(run, state, reason)
        elif any(s["state"] == runs.SEG_QUEUED for s in state["segments"]):
            state["state"] = runs.RESUBMITTED
        elif backend_for(run).chains_successors:
            try:
                _queue_segment(run, state, after=str(job_id))
                state["state"] = runs.RESUBMITTED
            except BackendError as e:
                state["state"], state["reason"] = runs.STOPPED, f"could not queue the next segment ({e}); `hpcrl resume {run.id}`"
                runs.add_event(state, state["reason"])
        else:
            # A backend that cannot queue from inside the job (TPU VMs): its watcher starts the
            # next segment when it sees this state.
            state["state"], state["reason"] = runs.RESUBMITTED, "waiting for the next segment to be started"


def error_tail(run: Run, state: dict, lines: int = 3) -> str:
    """The last lines of the newest segment log that are the trainer's own (not hpcrl's)."""
    for seg in reversed(state["segments"]):
        log = run.dir / "logs" / f"job-{seg.get('job_id')}.log"
        try:
            text = log.read_text(encoding="utf-8", errors="replace")
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
        if state["state"] in runs.FINAL_STATES:
            raise RunError(f"run '{run_id}' is already {state['state']}; nothing to cancel")
        state["state"], state["reason"] = runs.CANCELLED, "cancelled by the user"
        runs.add_event(state, "cancelled by the user")
        live = [s for s in state["segments"] if s["state"] in (runs.SEG_QUEUED, runs.SEG_RUNNING)]
        for s in live:
            if s["state"] == runs.SEG_QUEUED:
                s.update(state=runs.SEG_CANCELLED, ended=time.time())
    if live:
        backend_for(run).cancel([s["job_id"] for s in live], run_dir=run.dir)
    return run


def resume(run_id: str, hours: float | None = None, total_hours: float | None = None,
           max_segments: int | None = None) -> Run:
    """Continue a stopped, cancelled or failed run from its last good checkpoint."""
    run = Run.by_id(run_id)
    refresh(run)
    if hours is not None:
        _rerender(run, hours)
    with run.locked() as state:
        if state["state"] in runs.ACTIVE_STATES:
            raise RunError(f"run '{run_id}' is {state['state']}; it continues by itself (hpcrl cancel {run_id} to stop it)")
        if state["state"] == runs.COMPLETED:
            raise RunError(f"run '{run_id}' is COMPLETED; start a new run to train further")
        budget = state["budget"]
        if total_hours is not None:
            budget["total_hours"] = _positive(total_hours, "--total-hours")
        if max_segments is not None:
            budget["max_segments"] = int(_positive(max_segments, "--max-segments"))
        if hours is not None:
            budget["hours"] = hours
        state["no_progress"] = 0
        reason = _stop_reason(state)
        if reason:
            fix = "--max-segments" if reason.startswith("max_segments") else "--total-hours"
            raise RunError(f"run '{run_id}': {reason}; give it more with `hpcrl resume {run_id} {fix} N`")
        state["state"], state["reason"] = runs.PENDING, "resumed"
        runs.add_event(state, "resumed by the user")
        _queue_segment(run, state, after=None)
    _publish_state(run)  # [tpu]
    return run


def _positive(value, flag: str) -> float:
    if value is None or value <= 0:
        raise SpecError(f"{flag} {value}: must be a positive number")
    return value


def _rerender(run: Run, hours: float) -> None:
    from .spec import _validate_qos

    resolved = run.spec()
    resolved["spec"]["budget"]["hours"] = _positive(hours, "--hours")
    _validate_qos(resolved["site"], hours)
    paths = RunPaths(run.id, run.dir, resolved["site"].get("hpcrl_python") or sys.executable)
    atomicio.atomic_write_text(run.dir / "job.sh", render_script(resolved, paths), mode=0o755)


def refresh(run: Run) -> dict:
    """Reconcile an active run with its scheduler: a chain with no live job left is STOPPED."""
    # [tpu] A backend that cannot chain successors has a watcher that owns this reconciliation
    # (start the next segment, re-create a preempted VM, close a deleted one): one step of it.
    if not backend_for(run).chains_successors:
        from . import watch

        return watch.refresh(run)
    state = run.state()
    if state["state"] not in runs.ACTIVE_STATES:
        return state
    live = [s for s in state["segments"] if s["state"] in (runs.SEG_QUEUED, runs.SEG_RUNNING)]
    try:
        infos = backend_for(run).query([s["job_id"] for s in live], run_dir=run.dir) if live else {}
    except Exception:  # a scheduler hiccup must not break `status`; the next call retries
        return state
    if any(not infos[s["job_id"]].state.finished for s in live if s["job_id"] in infos):
        return state
    snapshot = state["segments"]
    step = _ckpt_step(run)
    with run.locked() as state:
        if state["state"] not in runs.ACTIVE_STATES or state["segments"] != snapshot:
            return state  # something moved meanwhile (a segment's hook ran): trust it
        for s in state["segments"]:
            if s["state"] == runs.SEG_RUNNING:
                s.update(state=runs.SEG_LOST, ended=time.time(), end_step=step)
            elif s["state"] == runs.SEG_QUEUED:
                s.update(state=runs.SEG_CANCELLED, ended=time.time())
        state["state"] = runs.STOPPED
        state["reason"] = f"no job left in the queue (ended outside hpcrl); `hpcrl resume {run.id}` continues it"
        runs.add_event(state, state["reason"])
    return state


# ---------------------------------------------------------------- [tpu] for watchers
# Backends that cannot queue a successor from inside a job (chains_successors = False: TPU VMs)
# have a watcher outside the job (hpcrl/watch.py). These are the lifecycle steps it takes, with
# the same rules as the in-job hooks above.


def queue_next_segment(run: Run) -> str | None:
    """Queue the next segment of an active run with no live segment: its job id, or None when
    the run must stop instead (budget, max_segments, crash loop) or needs nothing."""
    with run.locked() as state:
        live = [s for s in state["segments"] if s["state"] in (runs.SEG_QUEUED, runs.SEG_RUNNING)]
        if state["state"] not in runs.ACTIVE_STATES or live:
            return None
        reason = _stop_reason(state)
        if reason:
            _finish_run(run, state, reason)
            return None
        seg = _queue_segment(run, state, after=None)
        state["state"], state["reason"] = runs.RESUBMITTED, ""
        runs.add_event(state, f"next segment queued (job {seg['job_id']})")
    _publish_state(run)
    return seg["job_id"]


def close_segment(run: Run, job_id: str, why: str) -> None:
    """Close a segment whose job ended without its end hook (a preempted or deleted VM)."""
    step = _ckpt_step(run)
    with run.locked() as state:
        seg = runs.segment_by_job(state, job_id)
        if seg is None or seg["state"] not in (runs.SEG_QUEUED, runs.SEG_RUNNING):
            return
        if seg["state"] == runs.SEG_QUEUED:
            seg.update(state=runs.SEG_CANCELLED, ended=time.time(), reason=why)
            runs.add_event(state, f"segment - (job {job_id}) {why}")
        else:
            _mark_lost(state, seg, step, why)


def _publish_state(run: Run) -> None:
    # A job that reads the run's state from elsewhere (a TPU VM reads it from the bucket) gets
    # the committed state.json once the lock is released.
    publish = getattr(backend_for(run), "publish_state", None)
    if publish:
        publish(run.dir)
