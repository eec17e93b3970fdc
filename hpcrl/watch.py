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

`hpcrl status` runs one tick (through launch.refresh); `hpcrl watch RUN` repeats it until the run
ends. Ticks of one run never overlap (a lock file), so status, logs -f and a watcher in the
background may all run at once. Per-QR records live in RUN_DIR/.tpu/QR.json (written by
TpuBackend.submit, closed here with the outcome), which is what counts retries.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import sys
import time
from . import launch, runs
from .backends.base import JobState
from .errors import BackendError, HpcrlError
from .atomicio import atomic_write_json
from .runs import Run

BACKOFF_CAP_S = 1800.0  # the longest wait before re-creating a preempted VM
RETRY_OUTCOMES = ("preempted", "lost")
SEG_FIELDS_FROM_VM = ("state", "started", "ended", "rc", "start_step", "end_step", "k", "reason")


# ---------------------------------------------------------------- per-QR records


def _records(run: Run) -> list[dict]:
    recs = []
    for p in (run.dir / ".tpu").glob("*.json"):
        try:
            recs.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return sorted(recs, key=lambda r: r.get("n", 0))


def _open_record(run: Run) -> dict | None:
    open_ = [r for r in _records(run) if not r.get("closed")]
    return open_[-1] if open_ else None


def _close_record(run: Run, rec: dict, outcome: str) -> None:
    rec.update(closed=time.time(), outcome=outcome)
    atomic_write_json(run.dir / ".tpu" / f"{rec['qr_id']}.json", rec)


@contextlib.contextmanager
def _tick_lock(run: Run):
    (run.dir / ".tpu").mkdir(exist_ok=True)
    with open(run.dir / ".tpu" / ".tick.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- one step


def refresh(run: Run, interval_s: float = 60.0) -> dict:
    """One tick for `status`: a gcloud hiccup leaves the state as it is (the next call retries)."""
    try:
        return tick(run, interval_s)
    except HpcrlError:
        return run.state()


def tick(run: Run, interval_s: float = 60.0) -> dict:
    """Observe the open QR and act on it; start the next segment when the run needs one."""
    backend = launch.backend_for(run)
    with _tick_lock(run):
        rec = _open_record(run)
        if rec is not None:
            _observe(run, backend, rec)
        state = run.state()
        if _open_record(run) is None:
            if state["state"] in runs.ACTIVE_STATES:
                _start_next(run, backend, interval_s)
            elif not (run.dir / ".tpu" / "secrets-dropped").exists():
                backend.drop_secrets(run.id)  # the run is over: its tokens leave the bucket
                (run.dir / ".tpu" / "secrets-dropped").touch()
    return run.state()


def _observe(run: Run, backend, rec: dict) -> None:
    qr = rec["qr_id"]
    st = backend.describe(qr)
    raw = st.state if st else "GONE"
    done = _pull(run, backend, qr) if st is None or st.job_state != JobState.PENDING else False
    active = run.state()["state"] in runs.ACTIVE_STATES
    if not done and st is not None and raw not in ("SUSPENDED", "FAILED", "DELETING"):
        if raw != "SUSPENDING" and not active and not rec.get("delete_sent"):
            backend.delete(qr)  # a cancelled run's QR (cancel deletes it too; this is idempotent)
            rec["delete_sent"] = True
            atomic_write_json(run.dir / ".tpu" / f"{qr}.json", rec)
        elif active and st.job_state == JobState.PENDING:
            _set_reason(run, f"queued resource {qr}: {raw}", only_in=(runs.PENDING, runs.RESUBMITTED))
        return  # still queued, running or saving (SUSPENDING)
    if st is not None and raw != "DELETING":
        backend.delete(qr)
    if done:
        outcome = "preempted" if raw == "SUSPENDED" else "done"
    elif raw == "FAILED":
        outcome = "failed"
        _fail(run, qr, st.error, backend.site)
    elif not active:
        outcome = "cancelled"
    else:
        outcome = "preempted" if raw == "SUSPENDED" else "lost"
    why = {"preempted": "was preempted (queued resource SUSPENDED)", "lost": f"ended without its end hook ({raw})",
           "failed": "ended: its queued resource FAILED", "cancelled": "ended: the run was cancelled",
           "done": "ended (its VM was gone before it finished)"}[outcome]
    launch.close_segment(run, qr, why)  # a no-op when the VM closed the segment itself
    _close_record(run, rec, outcome)
    with run.locked() as state:
        runs.add_event(state, f"queued resource {qr} closed: {outcome} ({raw})")


def _pull(run: Run, backend, qr: str) -> bool:
    """Copy the VM's view of the segment here; True when the VM finished and copied everything."""
    vm, done = backend.fetch_vm_state(run.id, qr)
    backend.pull_outputs(run.dir)
    if vm:
        _merge(run, qr, vm)
    return done


def _merge(run: Run, qr: str, vm: dict) -> None:
    """Adopt what the VM recorded for its segment (and the run's state while it is active here:
    a local cancel wins over whatever the VM still believed)."""
    vseg = runs.segment_by_job(vm, qr)
    with run.locked() as state:
        seg = runs.segment_by_job(state, qr)
        if vseg is None or seg is None or seg["state"] in (runs.SEG_CANCELLED, runs.SEG_LOST):
            return
        seg.update({k: vseg[k] for k in SEG_FIELDS_FROM_VM if k in vseg})
        if state["state"] in runs.ACTIVE_STATES and vm.get("state"):
            state["state"], state["reason"] = vm["state"], vm.get("reason", "")
            state["no_progress"] = vm.get("no_progress", state["no_progress"])
        known = {(e.get("time"), e.get("what")) for e in state["events"]}
        new = [e for e in vm.get("events", []) if (e.get("time"), e.get("what")) not in known]
        state["events"] = sorted(state["events"] + new, key=lambda e: e.get("time", 0))[-200:]


def _set_reason(run: Run, reason: str, only_in=runs.ACTIVE_STATES) -> None:
    if run.state().get("reason") == reason:
        return  # unchanged: no rewrite of state.json on every poll
    with run.locked() as state:
        if state["state"] in only_in:
            state["reason"] = reason


def _stop(run: Run, final: str, reason: str) -> None:
    with run.locked() as state:
        if state["state"] in runs.ACTIVE_STATES:
            state["state"], state["reason"] = final, reason
            runs.add_event(state, f"run {final.lower()}: {reason}")


def _fail(run: Run, qr: str, error: str, site: dict) -> None:
    from .backends.tpu import explain

    fix = explain(error, site)
    _stop(run, runs.FAILED, f"queued resource {qr} FAILED: {error or 'no error given'}" + (f"; {fix}" if fix else ""))


# ---------------------------------------------------------------- the next segment


def retries_in_a_row(state: dict, recs: list[dict]) -> int:
    """Preempted or lost QRs at the end of the run's history, since the user last resumed it."""
    resumed = max((e["time"] for e in state["events"] if e.get("what") == "resumed by the user"), default=0)
    count = 0
    for rec in reversed([r for r in recs if r.get("created", 0) > resumed and r.get("closed")]):
        if rec.get("outcome") not in RETRY_OUTCOMES:
            break
        count += 1
    return count


def _start_next(run: Run, backend, interval_s: float) -> None:
    state, recs = run.state(), _records(run)
    retries, limit = retries_in_a_row(state, recs), int(backend.site.get("max_retries") or 0)
    if retries > limit:
        _stop(run, runs.STOPPED, f"queued resource preempted or lost {retries} times in a row "
                                 f"(site.max_retries={limit}); `hpcrl resume {run.id}` tries again")
        return
    if retries:
        # Exponential back-off in units of the poll interval: capacity rarely returns at once.
        due = recs[-1]["closed"] + min(BACKOFF_CAP_S, interval_s * 2 ** (retries - 1))
        if time.time() < due:
            _set_reason(run, f"VM preempted; re-creating it after {time.strftime('%H:%M:%S', time.localtime(due))} "
                             f"(retry {retries} of {limit})")
            return
    try:
        launch.queue_next_segment(run)
    except BackendError as e:
        _stop(run, runs.FAILED, f"could not start the next segment: {e}")


# ---------------------------------------------------------------- `hpcrl watch`


def step(run: Run, interval_s: float) -> dict:
    if launch.backend_for(run).chains_successors:
        return launch.refresh(run)  # Slurm and local chain by themselves: just reconcile
    return tick(run, interval_s)


def status_line(run: Run, state: dict) -> str:
    from . import report

    row = report.summary(run, state)
    ckpt = "-" if row["checkpoint_step"] is None else str(row["checkpoint_step"])
    line = (f"{time.strftime('%H:%M:%S')} {row['state']} segment {row['segments']}/{row['segments_planned']} "
            f"job {row['job_id'] or '-'} step {row['step'] if row['step'] is not None else '-'} checkpoint {ckpt}")
    return f"{line}: {row['reason']}" if row["reason"] else line


def watch(run_id: str, interval_s: float = 60.0, once: bool = False, out=None, err=None) -> int:
    """Tick until the run ends (or once); print a line whenever what it shows changes. Exit
    status: 0 when the run COMPLETED (or after --once), 1 when it ended any other way."""
    out, err = out or sys.stdout, err or sys.stderr
    run = Run.by_id(run_id)
    last = None
    while True:
        try:
            state = step(run, interval_s)
        except HpcrlError as e:
            if once:
                raise
            print(f"hpcrl: warning: {e}", file=err, flush=True)  # e.g. a network blip: keep watching
            state = run.state()
        line = status_line(run, state)
        if line.split(" ", 1)[1] != (last or " ").split(" ", 1)[1]:
            print(line, file=out, flush=True)
            last = line
        if once:
            return 0
        if state["state"] in runs.FINAL_STATES and _open_record(run) is None:
            return 0 if state["state"] == runs.COMPLETED else 1
        time.sleep(interval_s)


def follow_in_background(run: Run, interval_s: float) -> None:
    """For `hpcrl logs -f` on a TPU run: keep ticking (which copies the logs here) while it prints."""
    import threading

    def loop():
        while True:
            refresh(run, interval_s)
            if run.state()["state"] in runs.FINAL_STATES and _open_record(run) is None:
                return
            time.sleep(interval_s)

    threading.Thread(target=loop, daemon=True, name="hpcrl-tpu-tick").start()


def is_watched_backend(run: Run) -> bool:
    return not launch.backend_for(run).chains_successors
