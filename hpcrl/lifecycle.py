"""The run lifecycle: states, stop reasons and transitions, as pure functions on a clock.

A run's state is a plain dict (what state.json holds). Every transition here takes that dict,
the event's data and `now` (unix seconds, injected: tests drive whole chains on a fake clock),
changes the dict and returns the *actions* the caller must carry out with a backend:
`Queue(after)` (submit one more segment) and `Cancel(job_ids)`. Nothing here runs a process,
reads a file or looks at a clock, so the rules (budget, crash loop, lost segments, cancel,
resume, preemption back-off) are tested in milliseconds; `launch` executes the actions under the
run's lock, and the segment script and every backend reach the rules only through it.

Stop reasons are data (`state["stop"] = {"kind": ..., ...}`); `state["reason"]` is the text a
person reads and is never parsed.
"""

from __future__ import annotations

import enum
import math
from collections import namedtuple

from .errors import RunError


class RunState(str, enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    CHECKPOINTING = "CHECKPOINTING"  # shown while a running segment saves for its walltime
    RESUBMITTED = "RESUBMITTED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    STOPPED = "STOPPED"

    @property
    def active(self) -> bool:
        return self in ACTIVE

    @property
    def final(self) -> bool:
        return not self.active


ACTIVE = frozenset({RunState.PENDING, RunState.RUNNING, RunState.CHECKPOINTING, RunState.RESUBMITTED})
FINAL = frozenset(set(RunState) - ACTIVE)


class SegState(str, enum.Enum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SKIPPED = "SKIPPED"      # started, found nothing to do, exited at once
    CANCELLED = "CANCELLED"  # never ran: cancelled by the user
    UNNEEDED = "UNNEEDED"    # never ran: the run ended (complete, budget, failure) before it started
    CONTINUE = "CONTINUE"    # stopped for continuation (checkpointed before the walltime)
    COMPLETE = "COMPLETE"    # finished the training
    FAILED = "FAILED"
    LOST = "LOST"            # ended without its end hook (node failure, hard kill, preemption)


LIVE = frozenset({SegState.QUEUED, SegState.RUNNING})


class Stop(str, enum.Enum):
    """Why a chain stopped: what control flow branches on."""

    COMPLETE = "complete"
    CRASH_LOOP = "crash_loop"
    BUDGET = "budget"
    MAX_SEGMENTS = "max_segments"
    CANCELLED = "cancelled"
    NO_JOBS = "no_jobs"              # no job of an active run is left in the queue
    QUEUE_FAILED = "queue_failed"    # the next segment could not be submitted
    RETRIES = "retries"              # preempted or lost too often in a row (watched backends)
    BACKEND_FAILED = "backend_failed"  # the scheduler failed the job itself (a TPU queued resource)
    REPEATED = "repeated"            # failed before its first step with its predecessor's error
    USER_STOP = "user_stop"          # `hpcrl stop`: saved and stopped, to be resumed


CRASH_LOOP_SEGMENTS = 2  # segments in a row without checkpoint progress that fail a run


# The actions, as named tuples (not dataclasses: `status` imports this module, and dataclasses
# pulls in inspect, ~10 ms of every start)
Queue = namedtuple("Queue", ["after"])
Queue.__doc__ = "Submit one more segment; `after`: the job it must wait for (afterany), if any."
Cancel = namedtuple("Cancel", ["job_ids"])
Cancel.__doc__ = "Cancel these jobs."


# ---------------------------------------------------------------- reading a state


def run_state(state: dict) -> RunState:
    return RunState(state["state"])


def is_active(state: dict) -> bool:
    return run_state(state).active


def seg_state(seg: dict) -> SegState:
    return SegState(seg["state"])


def live_segments(state: dict) -> list[dict]:
    return [s for s in state["segments"] if seg_state(s) in LIVE]


def segment_by_job(state: dict, job_id) -> dict | None:
    for seg in state["segments"]:
        if seg.get("job_id") == str(job_id):
            return seg
    return None


def used_hours(state: dict, now: float | None = None) -> float:
    total = 0.0
    for seg in state["segments"]:
        for attempt in seg.get("requeues", []):  # the earlier starts of a requeued job
            total += max(0.0, (attempt.get("ended") or attempt["started"]) - attempt["started"])
        if seg.get("started"):
            end = seg.get("ended") or (now if seg_state(seg) == SegState.RUNNING else None) or seg["started"]
            total += max(0.0, end - seg["started"])
    return total / 3600.0


def ran_segments(state: dict) -> int:
    return sum(1 for s in state["segments"] if s.get("started"))


def planned_segments(budget: dict) -> int:
    if budget.get("total_hours") and budget.get("hours"):
        return min(budget["max_segments"], max(1, math.ceil(budget["total_hours"] / budget["hours"] - 1e-9)))
    return budget["max_segments"]


def stop_kind(state: dict) -> Stop | None:
    stop = state.get("stop")
    return Stop(stop["kind"]) if stop else None


# ---------------------------------------------------------------- building blocks


def new_state(run_id: str, site: str, scheduler: str, trainer: str, budget: dict, now: float,
              hpcrl_version: str | None = None) -> dict:
    """budget: hours (of each segment), hours_min, total_hours, max_segments. state.json is its one
    owner: `resume` changes it there and every backend reads it from there. hpcrl_version: the
    hpcrl that created the run (its jobs run that version's code, the run's lib/ snapshot); runs
    made before it was recorded have none."""
    return {"run_id": run_id, "state": RunState.PENDING.value, "reason": "", "stop": None, "created": now,
            "hpcrl_version": hpcrl_version,
            "site": site, "scheduler": scheduler, "trainer": trainer, "budget": dict(budget), "segments": [],
            "no_progress": 0, "resumed_at": None, "events": []}


def add_event(state: dict, what: str, now: float) -> None:
    state["events"].append({"time": round(now, 3), "what": what})
    del state["events"][:-200]  # bounded: state.json is rewritten on every change


def _set(state: dict, run: RunState, reason: str = "", stop: dict | None = None) -> None:
    state["state"], state["reason"], state["stop"] = run.value, reason, stop


def queued(state: dict, job_id: str, after: str | None, now: float) -> dict:
    """Record a segment the backend accepted."""
    seg = {"job_id": str(job_id), "state": SegState.QUEUED.value, "submitted": now, "after": after}
    state["segments"].append(seg)
    if state.get("successor_pending"):
        add_event(state, f"successor queued (job {job_id}) after the scheduler came back", now)
    state["successor_pending"] = None
    return seg


def awaits_successor(state: dict, now: float) -> bool:
    """A running job is still trying to queue its successor (the scheduler was away): the run is
    not to be judged by its live jobs until that job's end."""
    pending = state.get("successor_pending")
    return bool(pending) and now < pending.get("until", 0)


def budget_stop(state: dict) -> dict | None:
    """Why the chain must not run another segment (counting those started so far), or None."""
    budget = state["budget"]
    if state["no_progress"] >= CRASH_LOOP_SEGMENTS:
        return {"kind": Stop.CRASH_LOOP.value, "hours": budget.get("hours")}
    used = used_hours(state)
    if budget.get("total_hours") is not None and used >= budget["total_hours"] - 1e-9:
        return {"kind": Stop.BUDGET.value, "used": used, "total": budget["total_hours"]}
    if ran_segments(state) >= budget["max_segments"]:
        return {"kind": Stop.MAX_SEGMENTS.value, "max": budget["max_segments"]}
    return None


_TEXT = {  # what a person reads for each stop reason (fields of the stop record, and run_id)
    Stop.BUDGET: "budget spent ({used:.2f} of {total:g} h)",
    Stop.MAX_SEGMENTS: "max_segments reached ({max})",
    Stop.CRASH_LOOP: ("no checkpoint progress in " + str(CRASH_LOOP_SEGMENTS) + " segments in a row{of_hours}; "
                      "last error: {error}"),
    Stop.COMPLETE: "training complete",
    Stop.CANCELLED: "cancelled by the user",
    Stop.NO_JOBS: "no job left in the queue (ended outside hpcrl); `hpcrl resume {run_id}` continues it",
    Stop.QUEUE_FAILED: "could not queue the next segment ({error}); `hpcrl resume {run_id}`",
    Stop.RETRIES: ("queued resource preempted or lost {retries} times in a row (site.max_retries={limit}); "
                   "`hpcrl resume {run_id}` tries again"),
    Stop.BACKEND_FAILED: "{error}",
    Stop.USER_STOP: "stopped by the user at checkpoint step {step}; `hpcrl resume {run_id}` continues from it",
    Stop.REPEATED: ("segment {k} failed before its first step with the error segment {prev} had: {error}; "
                    "another segment would fail the same way: fix it, then `hpcrl resume {run_id}`"),
}


def describe(stop: dict, run_id: str = "RUN") -> str:
    """The text a person reads for a stop reason."""
    given = {k: v for k, v in stop.items() if v is not None}
    of_hours = f" ({given['hours']:g} h each)" if isinstance(given.get("hours"), (int, float)) else ""
    fields = {"error": "(no log output)", "step": "none (it starts over)", **given, "run_id": run_id,
              "of_hours": of_hours}
    return _TEXT[Stop(stop["kind"])].format(**fields)


def fix_flag(stop: dict) -> str:
    """The `hpcrl resume` option that lifts a budget stop."""
    return "--max-segments" if Stop(stop["kind"]) is Stop.MAX_SEGMENTS else "--total-hours"


def _count_progress(state: dict, seg: dict) -> None:
    start, end = seg.get("start_step"), seg.get("end_step")
    progressed = end is not None and (start is None or end > start)
    # work kept besides checkpoints (protocol.write_progress: an evaluation's batches) counts too;
    # a segment that crashes before it keeps anything still counts as none
    progressed = progressed or (seg.get("end_work") or 0) > (seg.get("start_work") or 0)
    state["no_progress"] = 0 if progressed else state.get("no_progress", 0) + 1


def mark_lost(state: dict, seg: dict, step: int | None, why: str, now: float, work: int | None = None) -> None:
    """A running segment whose job ended without its end hook: judged by its checkpoints (and the
    work it kept, when known). The one place that closes a segment as LOST."""
    seg.update(state=SegState.LOST.value, ended=now, end_step=step, rc=None, reason=why)
    if work is not None:
        seg["end_work"] = work
    _count_progress(state, seg)
    add_event(state, f"segment {seg.get('k') or '-'} (job {seg.get('job_id')}) {why}", now)


def cancel_queued(state: dict, now: float, why: str | None = None, as_state: SegState = SegState.CANCELLED) -> list:
    """Close every queued segment as CANCELLED, or UNNEEDED when the run ended by itself (the one
    place); the Cancel action for them."""
    ids = []
    for seg in state["segments"]:
        if seg_state(seg) == SegState.QUEUED:
            seg.update(state=as_state.value, ended=now)
            if why:
                seg["reason"] = why
            ids.append(seg["job_id"])
    return [Cancel(tuple(ids))] if ids else []


def finish(state: dict, stop: dict, now: float, run_id: str = "RUN", error_tail=None) -> list:
    """Stop the chain: the final state (unless already final) and the cancelled successors.
    error_tail: a callable giving the trainer's last log lines (read only for a crash loop)."""
    if is_active(state):
        kind = Stop(stop["kind"])
        if kind is Stop.CRASH_LOOP and error_tail is not None and "error" not in stop:
            stop = {**stop, "error": error_tail()}
        final = {Stop.COMPLETE: RunState.COMPLETED, Stop.CRASH_LOOP: RunState.FAILED, Stop.REPEATED: RunState.FAILED,
                 Stop.BACKEND_FAILED: RunState.FAILED, Stop.CANCELLED: RunState.CANCELLED}.get(kind, RunState.STOPPED)
        _set(state, final, describe(stop, run_id), stop)
        add_event(state, f"run {final.value.lower()}: {state['reason']}", now)
    if stop_kind(state) in (Stop.CANCELLED, Stop.USER_STOP):
        return cancel_queued(state, now)
    return cancel_queued(state, now, why=f"not needed: the run is {state['state'].lower()}", as_state=SegState.UNNEEDED)


def _state_stop(state: dict) -> dict | None:
    """A run that is no longer active keeps its stop; this is what a late segment reports."""
    if is_active(state):
        return None
    return state.get("stop") or {"kind": Stop.CANCELLED.value}


# ---------------------------------------------------------------- segment hooks


def begin(state: dict, job_id: str, step: int | None, now: float, chains: bool,
          work: int | None = None) -> tuple[dict, list]:
    """A segment starts (`_segment begin` in the job). Returns (segment, actions); the segment's
    state is SKIPPED when the run needs nothing more, else RUNNING with its number `k`.
    work: the trainer's count of work kept besides checkpoints (protocol.read_progress), if any."""
    seg = segment_by_job(state, job_id)
    if seg is None:  # a job the user submitted by hand (sbatch job.sh): adopt it
        seg = {"job_id": str(job_id), "submitted": now, "after": None}
        state["segments"].append(seg)
    elif seg.get("started"):  # the scheduler requeued this job (node failure, preemption): it begins again
        _requeued(state, seg, step, now)
    for other in state["segments"]:
        # still RUNNING while another starts: it ended without its end hook
        if other is not seg and other.get("state") == SegState.RUNNING.value:
            mark_lost(state, other, step, "ended without its end hook", now, work)
    stop = _state_stop(state) or _user_stop(state, step) or budget_stop(state)
    if stop:
        seg.update(state=SegState.SKIPPED.value, started=None, ended=now, reason=describe(stop, state["run_id"]))
        return seg, finish(state, stop, now, state["run_id"])
    seg.update(state=SegState.RUNNING.value, started=now, start_step=step, k=seg.get("k") or ran_segments(state) + 1)
    if work is not None:
        seg["start_work"] = work
    _set(state, RunState.RUNNING)
    add_event(state, f"segment {seg['k']} started (job {job_id})", now)
    # A requeued job's successor, queued by its first start, still waits for it (afterany counts
    # the job's final end, not a requeue): one successor per segment, however often it starts.
    successor = any(seg_state(s) == SegState.QUEUED and s.get("after") == str(job_id) for s in state["segments"])
    wanted = chains and not successor and budget_stop(state) is None and not state.get("stop_requested")
    return seg, ([Queue(after=str(job_id))] if wanted else [])


def _requeued(state: dict, seg: dict, step: int | None, now: float) -> None:
    """The segment's job starts again under the same id. Its earlier start becomes an attempt in
    the segment's record (its hours still count against the budget); one that ended without its
    end hook is judged by its checkpoints, as a lost segment is."""
    if seg_state(seg) == SegState.RUNNING:
        seg.update(ended=now, end_step=step, rc=None)
        _count_progress(state, seg)
        seg["state"] = SegState.LOST.value
    attempt = {k: seg.get(k) for k in ("started", "ended", "state", "rc", "start_step", "end_step")}
    seg.setdefault("requeues", []).append(attempt)
    for key in ("ended", "rc", "end_step", "reason", "error"):
        seg.pop(key, None)
    add_event(state, f"segment {seg.get('k') or '-'} (job {seg['job_id']}) requeued by the scheduler after "
                     f"{attempt['state'].lower()} at step {attempt['end_step']}; it starts again", now)


def successor_failed(state: dict, error: str, now: float, until: float) -> None:
    """Queueing the successor failed: the segment still runs and its job keeps trying (with
    back-off) until `until`, its own end; the run is waiting for that, not lost."""
    if not state.get("successor_pending"):
        add_event(state, f"could not queue the successor: {error}; retrying", now)
    state["successor_pending"] = {"since": (state.get("successor_pending") or {}).get("since", now),
                                  "until": until, "error": error}


def needs_successor(state: dict, job_id: str) -> list:
    """What a job that keeps trying should submit now: its successor, or nothing (the run ended,
    or a successor is queued already)."""
    if not is_active(state) or not state.get("successor_pending") or state.get("stop_requested"):
        return []
    if any(seg_state(s) == SegState.QUEUED for s in state["segments"]):
        state["successor_pending"] = None
        return []
    return [Queue(after=str(job_id))]


def end(state: dict, job_id: str, rc: int, step: int | None, now: float, *, obeys_protocol: bool,
        chains: bool, exit_complete: int, exit_continue: int, error_tail=None, error: str | None = None,
        trained: bool | None = None, own_tail: str | None = None, work: int | None = None) -> list:
    """The trainer of a segment exited with `rc` (`_segment end`). Returns the actions.
    error: the reason the trainer itself gave for failing (protocol.ERROR_FILE), if any; one given
    with a continuation (it stopped before it could save anything) is kept for a crash loop's text.
    work: the trainer's count of work kept besides checkpoints (protocol.read_progress), if any.
    trained: whether the segment logged a training step (None: unknown, judged as trained);
    own_tail: the last line of this segment's own log (what a failure without a reason said)."""
    seg = segment_by_job(state, job_id)
    if seg is None or seg_state(seg) != SegState.RUNNING:
        return []
    seg.update(ended=now, rc=rc, end_step=step)
    if work is not None:
        seg["end_work"] = work
    if rc == exit_complete:
        seg["state"] = SegState.COMPLETE.value
        add_event(state, f"segment {seg['k']} completed the training", now)
        return finish(state, {"kind": Stop.COMPLETE.value}, now, state["run_id"])
    _count_progress(state, seg)
    # A trainer that knows no protocol (MaxText) is killed at the walltime: a segment that
    # advanced its checkpoint is a continuation, whatever its exit code.
    ok = rc == exit_continue or (not obeys_protocol and state["no_progress"] == 0)
    seg["state"] = (SegState.CONTINUE if ok else SegState.FAILED).value
    if error:
        if not ok:
            seg["error"] = error
        error_tail = lambda: error  # noqa: E731 - the trainer's own words beat its log's last lines
    add_event(state, f"segment {seg['k']} ended with exit code {rc} at checkpoint step {step}"
              + (f": {error}" if not ok and error else ""), now)
    repeated = None if ok else _repeated(state, seg, trained, error or own_tail)
    if state.get("stop_requested"):
        seg["user_stop"] = True  # ended early on request: its walltime was not what it lost
    stop = _state_stop(state) or _user_stop(state, step) or budget_stop(state) or repeated
    if stop:
        return finish(state, stop, now, state["run_id"], error_tail)
    if any(seg_state(s) == SegState.QUEUED for s in state["segments"]):
        _set(state, RunState.RESUBMITTED)
        return []
    if chains:
        _set(state, RunState.RESUBMITTED)
        return [Queue(after=str(job_id))]
    # A backend that cannot queue from inside the job (TPU VMs): its reconciler starts the next
    # segment when it sees this state.
    _set(state, RunState.RESUBMITTED, "waiting for the next segment to be started")
    return []


def _repeated(state: dict, seg: dict, trained: bool | None, failure: str | None) -> dict | None:
    """A failed segment that never reached its first step, with the error its predecessor ended
    with (a resume in between included): a start-up failure (an import, the data, the model, the
    config) that the next segment would repeat after its queue wait. Its stop, or None. The
    failure's last line is kept with every failed segment (`failure`) for the next to compare."""
    seg["failure"] = " ".join((failure or "").split())[:400] or None
    if trained is not False or not seg["failure"]:
        return None
    before = [s for s in state["segments"] if s.get("started") and s is not seg and (s.get("k") or 0) < seg["k"]]
    prev = before[-1] if before else None
    if prev is None or seg_state(prev) not in (SegState.FAILED, SegState.LOST) or prev.get("failure") != seg["failure"]:
        return None
    return {"kind": Stop.REPEATED.value, "k": seg["k"], "prev": prev.get("k"), "error": seg["failure"]}


def _user_stop(state: dict, step: int | None) -> dict | None:
    """The stop `hpcrl stop` asked for, once the segment it signalled has ended (or never ran)."""
    return {"kind": Stop.USER_STOP.value, "step": step} if state.get("stop_requested") else None


def queue_failed(state: dict, error: str, now: float) -> None:
    """The next segment could not be submitted: the chain stops, resumable."""
    state["successor_pending"] = None
    stop = {"kind": Stop.QUEUE_FAILED.value, "error": error}
    _set(state, RunState.STOPPED, describe(stop, state["run_id"]), stop)
    add_event(state, state["reason"], now)


# ---------------------------------------------------------------- user commands


def cancel(state: dict, now: float) -> list:
    """`hpcrl cancel`: the run is CANCELLED; every live job goes."""
    if not is_active(state):
        raise RunError(f"run '{state['run_id']}' is already {state['state']}; nothing to cancel")
    running = tuple(s["job_id"] for s in state["segments"] if seg_state(s) == SegState.RUNNING)
    stop = {"kind": Stop.CANCELLED.value}
    _set(state, RunState.CANCELLED, describe(stop), stop)
    add_event(state, "cancelled by the user", now)
    actions = cancel_queued(state, now)
    # a running segment is closed by its own end hook (or, if that never runs, as LOST)
    return actions + ([Cancel(running)] if running else [])


def stop(state: dict, now: float) -> tuple[list, tuple]:
    """`hpcrl stop`: the running segment saves and exits as at its walltime (the caller signals
    the returned job ids as the walltime would); nothing runs after it. Queued successors are
    cancelled now; the run is STOPPED, resumable, when that segment ends (at once when none runs)."""
    if not is_active(state):
        raise RunError(f"run '{state['run_id']}' is already {state['state']}; nothing to stop")
    running = tuple(s["job_id"] for s in state["segments"] if seg_state(s) == SegState.RUNNING)
    state["stop_requested"] = now
    add_event(state, "stop asked by the user: checkpoint and stop", now)
    actions = cancel_queued(state, now, why="the run was stopped by the user (hpcrl stop)")
    if not running:
        step = max([s["end_step"] for s in state["segments"] if s.get("end_step") is not None], default=None)
        return actions + finish(state, _user_stop(state, step), now, state["run_id"]), ()
    _set(state, RunState.CHECKPOINTING, "stopping: the running segment saves a checkpoint and exits (hpcrl stop)")
    return actions, running


def resume(state: dict, now: float, hours: float | None = None, total_hours: float | None = None,
           max_segments: int | None = None) -> list:
    """`hpcrl resume`: continue a stopped, cancelled or failed run (budget changes included)."""
    run_id = state["run_id"]
    if is_active(state):
        raise RunError(f"run '{run_id}' is {state['state']}; it continues by itself (hpcrl cancel {run_id} to stop it)")
    if run_state(state) == RunState.COMPLETED:
        raise RunError(f"run '{run_id}' is COMPLETED; start a new run to train further")
    budget = state["budget"]
    for key, value in (("hours", hours), ("total_hours", total_hours), ("max_segments", max_segments)):
        if value is not None:
            budget[key] = value
    state["no_progress"] = 0
    state["stop_requested"] = None
    stop = budget_stop(state)
    if stop:
        raise RunError(f"run '{run_id}': {describe(stop, run_id)}; give it more with "
                       f"`hpcrl resume {run_id} {fix_flag(stop)} N`")
    _set(state, RunState.PENDING, "resumed")
    state["resumed_at"] = now
    add_event(state, "resumed by the user", now)
    return [Queue(after=None)]


# ---------------------------------------------------------------- reconciling with the scheduler


def no_live_jobs(state: dict, step: int | None, now: float) -> None:
    """An active run none of whose jobs is alive any more (ended outside hpcrl): STOPPED."""
    for seg in state["segments"]:
        if seg_state(seg) == SegState.RUNNING:
            mark_lost(state, seg, step, "ended outside hpcrl", now)
    cancel_queued(state, now)
    stop = {"kind": Stop.NO_JOBS.value}
    _set(state, RunState.STOPPED, describe(stop, state["run_id"]), stop)
    add_event(state, state["reason"], now)


def close_segment(state: dict, job_id: str, why: str, step: int | None, now: float) -> None:
    """A segment whose job ended without its end hook (a preempted or deleted VM)."""
    seg = segment_by_job(state, job_id)
    if seg is None or seg_state(seg) not in LIVE:
        return
    if seg_state(seg) == SegState.QUEUED:
        seg.update(state=SegState.CANCELLED.value, ended=now, reason=why)
        add_event(state, f"segment - (job {job_id}) {why}", now)
    else:
        mark_lost(state, seg, step, why, now)


def next_segment(state: dict, now: float) -> list:
    """For reconcilers of backends that cannot queue from inside a job: the next segment of an
    active run with no live segment, or the stop when the run must not go on."""
    if not is_active(state) or live_segments(state):
        return []
    saved = max([s["end_step"] for s in state["segments"] if s.get("end_step") is not None], default=None)
    stop = _user_stop(state, saved) or budget_stop(state)
    if stop:
        return finish(state, stop, now, state["run_id"])
    return [Queue(after=None)]


def fail(state: dict, kind: Stop, detail: str, now: float, **data) -> None:
    """The backend ended the run (its job failed outside the trainer, or retries ran out)."""
    if not is_active(state):
        return
    stop = {"kind": kind.value, "error": detail, **data}
    final = RunState.FAILED if kind is Stop.BACKEND_FAILED else RunState.STOPPED
    _set(state, final, describe(stop, state["run_id"]), stop)
    add_event(state, f"run {final.value.lower()}: {state['reason']}", now)


def retries_in_a_row(state: dict, outcomes: list[tuple[float, str | None]], retry_outcomes) -> int:
    """(created, outcome) of closed attempts, oldest first: how many at the end were preempted or
    lost, counting only those since the user last resumed the run."""
    since = state.get("resumed_at") or 0
    count = 0
    for created, outcome in reversed([o for o in outcomes if o[0] > since]):
        if outcome not in retry_outcomes:
            break
        count += 1
    return count


def backoff_due(last_closed: float, retries: int, interval_s: float, cap_s: float) -> float:
    """When a preempted attempt may be re-created: exponential in units of the poll interval."""
    return last_closed + min(cap_s, interval_s * 2 ** max(0, retries - 1))
