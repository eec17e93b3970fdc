"""The watcher of runs whose jobs cannot queue their own successor (TPU queued resources).

One `tick` looks at the run's open queued resource (QR) and acts:

    ACCEPTED/WAITING_FOR_RESOURCES/PROVISIONING   wait (the reason shows the QR's state)
    ACTIVE                                         copy the VM's state, logs and metrics here
    the VM finished the segment (jobs/QR/final.json in the bucket)
                                                   delete the QR; the run goes on (next segment),
                                                   or is COMPLETED / FAILED / STOPPED as the VM decided
    SUSPENDING                                     wait: the VM is saving and copying
    SUSPENDED (preempted) or gone without finishing
                                                   close the segment, delete the QR, re-create it after
                                                   a back-off, at most site.max_retries times in a row;
                                                   the new VM resumes from the checkpoint in the bucket
    FAILED                                         delete it; the run FAILS with state.failedData.error
    run cancelled                                  `hpcrl cancel` deleted the QR; close what is left

`hpcrl watch RUN` repeats `tick` until the run ends (`status` never ticks: it must not wait on
the network, so it shows what the watcher last copied here). Ticks of one run never overlap (a lock file), so status, logs -f and a watcher in the
background may all run at once. Per-QR records live in RUN_DIR/.tpu/QR.json (written by
TpuBackend.submit, closed here with the outcome), which is what counts retries.

The lifecycle steps a tick takes (queue the next segment, close a segment, stop the run) are
the launcher's, passed in as `ops` (launch.WatcherOps): this module decides only what the
queued resource's state means.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time

from .. import lifecycle
from ..atomicio import atomic_write_json
from ..errors import BackendError, HpcrlError
from ..lifecycle import ACTIVE, RunState, SegState, Stop
from .base import JobState

BACKOFF_CAP_S = 1800.0  # the longest wait before re-creating a preempted VM
RETRY_OUTCOMES = ("preempted", "lost")
SEG_FIELDS_FROM_VM = ("state", "started", "ended", "rc", "start_step", "end_step", "k", "reason")
LAST_TICK = "last-tick"  # in the run's .tpu dir: when a watcher last looked (status shows its age)


# ---------------------------------------------------------------- per-QR records


def _dir(run):
    return run.layout.private("tpu")


def _records(run) -> list[dict]:
    recs = []
    for p in _dir(run).glob("*.json"):
        try:
            recs.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return sorted(recs, key=lambda r: r.get("n", 0))


def open_record(run) -> dict | None:
    open_ = [r for r in _records(run) if not r.get("closed")]
    return open_[-1] if open_ else None


def _close_record(run, rec: dict, outcome: str) -> None:
    rec.update(closed=time.time(), outcome=outcome)
    atomic_write_json(_dir(run) / f"{rec['qr_id']}.json", rec)


@contextlib.contextmanager
def _tick_lock(run):
    _dir(run).mkdir(exist_ok=True)
    with open(_dir(run) / ".tick.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def last_tick(run) -> float | None:
    try:
        return (_dir(run) / LAST_TICK).stat().st_mtime
    except OSError:
        return None


# ---------------------------------------------------------------- one step


def tick(run, backend, ops, interval_s: float = 60.0) -> dict:
    """Observe the open QR and act on it; start the next segment when the run needs one."""
    with _tick_lock(run):
        rec = open_record(run)
        if rec is not None:
            _observe(run, backend, ops, rec)
        state = run.state()
        if open_record(run) is None:
            if lifecycle.is_active(state):
                _start_next(run, backend, ops, interval_s)
            elif not (_dir(run) / "secrets-dropped").exists():
                backend.drop_secrets(run.id)  # the run is over: its tokens leave the bucket
                (_dir(run) / "secrets-dropped").touch()
        (_dir(run) / LAST_TICK).touch()
    return run.state()


def _observe(run, backend, ops, rec: dict) -> None:
    qr = rec["qr_id"]
    st = backend.describe(qr)
    raw = st.state if st else "GONE"
    done = _pull(run, backend, ops, qr) if st is None or st.job_state != JobState.PENDING else False
    active = lifecycle.is_active(run.state())
    if not done and st is not None and raw not in ("SUSPENDED", "FAILED", "DELETING"):
        if raw != "SUSPENDING" and not active and not rec.get("delete_sent"):
            backend.delete(qr)  # a cancelled run's QR (cancel deletes it too; this is idempotent)
            rec["delete_sent"] = True
            atomic_write_json(_dir(run) / f"{qr}.json", rec)
        elif active and st.job_state == JobState.PENDING:
            _set_reason(run, f"queued resource {qr}: {raw}", only_in=(RunState.PENDING, RunState.RESUBMITTED))
        return  # still queued, running or saving (SUSPENDING)
    if st is not None and raw != "DELETING":
        backend.delete(qr)
    if done:  # a VM whose job ended while its queued resource was being suspended was preempted too
        outcome = "preempted" if raw in ("SUSPENDING", "SUSPENDED") else "done"
    elif raw == "FAILED":
        outcome = "failed"
        _fail(run, ops, qr, st.error, backend)
    elif not active:
        outcome = "cancelled"
    else:
        outcome = "preempted" if raw == "SUSPENDED" else "lost"
    why = {"preempted": "was preempted (queued resource SUSPENDED)", "lost": f"ended without its end hook ({raw})",
           "failed": "ended: its queued resource FAILED", "cancelled": "ended: the run was cancelled",
           "done": "ended (its VM was gone before it finished)"}[outcome]
    ops.close_segment(run, qr, why)  # a no-op when the VM closed the segment itself
    _close_record(run, rec, outcome)
    with run.locked() as state:
        lifecycle.add_event(state, f"queued resource {qr} closed: {outcome} ({raw})", time.time())


def _pull(run, backend, ops, qr: str) -> bool:
    """Copy the VM's view of the segment here; True when the VM finished and copied everything."""
    vm, done = backend.fetch_vm_state(run.id, qr)
    backend.pull_outputs(run.dir)
    ops.refresh_checkpoint_cache(run)  # remote checkpoints (MaxText on gs://) listed here, not by status
    if vm:
        _merge(run, qr, vm)
    return done


def _merge(run, qr: str, vm: dict) -> None:
    """Adopt what the VM recorded for its segment (and the run's state while it is active here:
    a local cancel wins over whatever the VM still believed)."""
    vseg = lifecycle.segment_by_job(vm, qr)
    with run.locked() as state:
        seg = lifecycle.segment_by_job(state, qr)
        if vseg is None or seg is None or seg["state"] in (SegState.CANCELLED, SegState.UNNEEDED, SegState.LOST):
            return
        seg.update({k: vseg[k] for k in SEG_FIELDS_FROM_VM if k in vseg})
        if lifecycle.is_active(state) and vm.get("state"):
            state["state"], state["reason"] = vm["state"], vm.get("reason", "")
            state["stop"] = vm.get("stop")
            state["no_progress"] = vm.get("no_progress", state["no_progress"])
        known = {(e.get("time"), e.get("what")) for e in state["events"]}
        new = [e for e in vm.get("events", []) if (e.get("time"), e.get("what")) not in known]
        state["events"] = sorted(state["events"] + new, key=lambda e: e.get("time", 0))[-200:]


def _set_reason(run, reason: str, only_in=ACTIVE) -> None:
    if run.state().get("reason") == reason:
        return  # unchanged: no rewrite of state.json on every poll
    with run.locked() as state:
        if state["state"] in only_in:
            state["reason"] = reason


def _fail(run, ops, qr: str, error: str, backend) -> None:
    fix = backend.explain(error)
    ops.fail(run, Stop.BACKEND_FAILED,
             f"queued resource {qr} FAILED: {error or 'no error given'}" + (f"; {fix}" if fix else ""))


# ---------------------------------------------------------------- the next segment


def retries_in_a_row(state: dict, recs: list[dict]) -> int:
    """Preempted or lost QRs at the end of the run's history, since the user last resumed it."""
    closed = [(r.get("created", 0), r.get("outcome")) for r in recs if r.get("closed")]
    return lifecycle.retries_in_a_row(state, closed, RETRY_OUTCOMES)


def _start_next(run, backend, ops, interval_s: float) -> None:
    state, recs = run.state(), _records(run)
    retries, limit = retries_in_a_row(state, recs), int(backend.site.get("max_retries") or 0)
    if retries > limit:
        ops.fail(run, Stop.RETRIES, "", retries=retries, limit=limit)
        return
    if retries:
        # capacity rarely returns at once
        due = lifecycle.backoff_due(recs[-1]["closed"], retries, interval_s, BACKOFF_CAP_S)
        if time.time() < due:
            _set_reason(run, f"VM preempted; re-creating it after {time.strftime('%H:%M:%S', time.localtime(due))} "
                             f"(retry {retries} of {limit})")
            return
    try:
        ops.queue_next(run)
    except BackendError as e:
        ops.fail(run, Stop.BACKEND_FAILED, f"could not start the next segment: {e}")


def is_finished(run) -> bool:
    return not lifecycle.is_active(run.state()) and open_record(run) is None


def follow_in_background(run, backend, interval_s: float, ops=None) -> None:
    """For `hpcrl logs -f` on a TPU run: keep ticking (which copies the logs here) while it prints."""
    import threading

    def loop():
        while True:
            try:
                tick(run, backend, ops, interval_s)
            except HpcrlError:
                pass  # a gcloud hiccup: the next tick retries
            if is_finished(run):
                return
            time.sleep(interval_s)

    threading.Thread(target=loop, daemon=True, name="hpcrl-tpu-tick").start()
