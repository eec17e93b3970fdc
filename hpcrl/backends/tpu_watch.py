"""The watcher of runs whose jobs cannot queue their own successor (TPU queued resources).

One `tick` looks at the run's open queued resource (QR) and acts:

    ACCEPTED/WAITING_FOR_RESOURCES/PROVISIONING   wait (the reason shows the QR's state)
    ACTIVE                                         copy the VM's state (the segments it ran and
                                                   queued itself), logs and metrics here; delete a
                                                   VM whose heartbeat stopped for its stall bound
    the VM finished (jobs/QR/final.json in the bucket)
                                                   delete the QR; the run is COMPLETED / FAILED /
                                                   STOPPED as the VM decided (or goes on: a new VM)
    gone without ever a heartbeat                  the run FAILS: the VM cannot write the bucket
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
RETRY_OUTCOMES = ("preempted", "lost", "hung")
SEG_FIELDS_FROM_VM = ("state", "started", "ended", "rc", "start_step", "end_step", "k", "reason")
LAST_TICK = "last-tick"  # in the run's .tpu dir: when a watcher last looked (status shows its age)


# ---------------------------------------------------------------- per-QR records


def vm_jobs(qr_id: str, job_ids) -> list[str]:
    """The segment job ids that ran on queued resource qr_id's VM: qr_id itself, then qr_id.2, ..."""
    return [j for j in job_ids if j == qr_id or (j or "").startswith(qr_id + ".")]


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
    _save(run, rec)


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
    # A run the VM itself ended (COMPLETED, FAILED, STOPPED, adopted from its state) is left to
    # the VM to finish copying and delete itself; only a cancelled run's VM is deleted here.
    cancelled = run.state()["state"] == RunState.CANCELLED.value
    silent = _heard(run, backend, rec, raw) if not cancelled and not done else False
    if not done and not silent and st is not None and raw not in ("SUSPENDED", "FAILED", "DELETING"):
        if raw != "SUSPENDING" and cancelled and not rec.get("delete_sent"):
            backend.delete(qr)  # a cancelled run's QR (cancel deletes it too; this is idempotent)
            rec["delete_sent"] = True
            _save(run, rec)
        elif active and st.job_state == JobState.PENDING:
            _set_reason(run, f"queued resource {qr}: {raw}", only_in=(RunState.PENDING, RunState.RESUBMITTED))
        return  # still queued, running or saving (SUSPENDING)
    if st is not None and raw != "DELETING":
        backend.delete(qr)
    outcome = _outcome(raw, done, active, rec, silent, cancelled)
    if outcome == "failed":
        _fail(run, ops, qr, st.error, backend)
    elif outcome == "silent":
        ops.fail(run, Stop.BACKEND_FAILED, f"the VM of queued resource {qr} never reported to "
                                           f"{backend.site['bucket']} (deleted); {backend.silent_vm_fix()}; "
                                           f"then `hpcrl resume {run.id}`")
    why = {"preempted": "was preempted (queued resource SUSPENDED)", "lost": f"ended without its end hook ({raw})",
           "failed": "ended: its queued resource FAILED", "cancelled": "ended: the run was cancelled",
           "done": "ended (its VM was gone before it finished)", "silent": "ended: its VM never reported",
           "hung": f"ended: no heartbeat from its VM for {rec.get('stall_s')} s (deleted)"}[outcome]
    for job in vm_jobs(qr, [s.get("job_id") for s in run.state()["segments"]]):
        ops.close_segment(run, job, why)  # a no-op for those the VM closed itself
    _close_record(run, rec, outcome)
    with run.locked() as state:
        lifecycle.add_event(state, f"queued resource {qr} closed: {outcome} ({raw})", time.time())


def _outcome(raw: str, done: bool, active: bool, rec: dict, silent: bool, cancelled: bool) -> str:
    if done:  # a VM whose job ended while its queued resource was being suspended was preempted too
        return "preempted" if raw in ("SUSPENDING", "SUSPENDED") else "done"
    if raw == "FAILED":
        return "failed"
    if not active:
        return "cancelled" if cancelled else "done"
    if raw in ("SUSPENDING", "SUSPENDED"):
        return "preempted"
    if rec.get("beat") is None:
        # gone (or silent too long) without ever a heartbeat: a VM that cannot write the bucket
        # deleted itself, or the watcher deleted it; another VM would do the same
        return "silent"
    return "hung" if silent else "lost"


def _heard(run, backend, rec: dict, raw: str) -> bool:
    """Note the VM's heartbeat; True when an ACTIVE VM has been silent for longer than its segment
    plus margins (rec["stall_s"]), so that the caller deletes it: an idle TPU VM bills."""
    now, changed = time.time(), False
    if raw == "ACTIVE" and not rec.get("active_seen"):
        rec["active_seen"], changed = now, True
    if raw == "ACTIVE" or (rec.get("beat") is None and raw in ("GONE", "DELETING")):
        beat = backend.fetch_heartbeat(run.id, rec["qr_id"])
        if beat is not None and beat != rec.get("beat"):
            rec.update(beat=beat, beat_seen=now)
            changed = True
    if changed:
        _save(run, rec)
    since = rec.get("beat_seen") or rec.get("active_seen")
    return raw == "ACTIVE" and since is not None and now - since > float(rec.get("stall_s") or float("inf"))


def _save(run, rec: dict) -> None:
    atomic_write_json(_dir(run) / f"{rec['qr_id']}.json", rec)


def _pull(run, backend, ops, qr: str) -> bool:
    """Copy the VM's view of the segment here; True when the VM finished and copied everything."""
    vm, done = backend.fetch_vm_state(run.id, qr)
    backend.pull_outputs(run.dir)
    ops.refresh_checkpoint_cache(run)  # remote checkpoints (MaxText on gs://) listed here, not by status
    if vm:
        _merge(run, qr, vm, done)
    return done


def _merge(run, qr: str, vm: dict, final: bool) -> None:
    """Adopt what the VM recorded for the segments it ran (it queues each next one itself, so
    some are new here), and the run's state while it is active here: a local cancel wins over
    whatever the VM still believed. The run's end is adopted only from the VM's final copy
    (final.json, uploaded after its logs): a state copied earlier would end `logs -f` before
    the VM's last lines are in the bucket."""
    with run.locked() as state:
        for vseg in vm.get("segments", []):
            if not vm_jobs(qr, [vseg.get("job_id")]):
                continue
            seg = lifecycle.segment_by_job(state, vseg["job_id"])
            if seg is None:
                if not lifecycle.is_active(state):
                    continue
                seg = {k: vseg[k] for k in ("job_id", "submitted", "after", "asked") if k in vseg}
                state["segments"].append(seg)
            elif seg["state"] in (SegState.CANCELLED, SegState.LOST):
                continue
            seg.update({k: vseg[k] for k in SEG_FIELDS_FROM_VM if k in vseg})
        ends = vm.get("state") and not lifecycle.is_active(vm)
        if lifecycle.is_active(state) and vm.get("state") and (final or not ends):
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
