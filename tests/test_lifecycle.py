"""The lifecycle's rules on a fake clock, in milliseconds: budget, max_segments, crash loop, lost
segments, cancel/resume, the successor chain, a scheduler that loses jobs, TPU preemption
back-off. Whole chains go through the real launcher (run directory, state file under its lock,
the smoke trainer's checkpoint pointer) with a TEST DOUBLE of the backend that records jobs in
memory; the real-process and real-Slurm tests keep what only they can show (signals, traps,
the scheduler's own behaviour)."""

from __future__ import annotations

import pytest

from hpcrl import lifecycle, protocol
from hpcrl import control
from hpcrl.backends.base import Backend, JobInfo, JobState
from hpcrl.errors import BackendError, RunError
from hpcrl.lifecycle import RunState, SegState, Stop
from hpcrl.spec import resolve

CONTINUE, COMPLETE = protocol.EXIT_CONTINUE, protocol.EXIT_COMPLETE


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeScheduler(Backend):
    """A TEST DOUBLE of a scheduler: jobs are dict entries; `fail_submit` makes submit raise,
    `away` makes every call raise (slurmctld gone for a while)."""

    name = "fake"

    def __init__(self, site):
        super().__init__(site)
        self.jobs: dict[str, dict] = {}
        self.fail_submit = False
        self.away = False
        self.polls = 0
        self.submits = 0

    def submit(self, run, resolved, after=None):
        self.submits += 1
        if self.fail_submit or self.away:
            raise BackendError("sbatch failed: Socket timed out on send/recv operation")
        job_id = str(100 + len(self.jobs))
        self.jobs[job_id] = {"state": JobState.PENDING, "after": after, "hours": resolved["spec"]["budget"]["hours"]}
        return job_id

    def query(self, job_ids, run=None):
        return {j: JobInfo(j, self.jobs[j]["state"] if j in self.jobs else JobState.UNKNOWN) for j in job_ids}

    def poll(self, jobs):
        self.polls += 1
        if self.away:
            raise BackendError("squeue failed: Unable to contact slurm controller (connect failure)")
        return self.query([j for _, j in jobs])

    def cancel(self, job_ids, run=None):
        for j in job_ids:
            self.jobs[j]["state"] = JobState.CANCELLED

    def end_time(self, job_id, run, environ):
        return None  # the launcher falls back to now + hours


@pytest.fixture
def chain(home, monkeypatch):
    """(make_run, clock, scheduler): runs of the smoke trainer whose backend is the double."""
    clock, sched = Clock(), FakeScheduler({})
    monkeypatch.setattr(control, "clock", clock)
    monkeypatch.setattr(control, "for_site", lambda site: sched)

    def make_run(name="r", *sets, hours=1.0):
        resolved = resolve(None, "local", ["args.steps=100", *sets], {"trainer": "smoke", "hours": hours})
        return control.submit(resolved, name)

    return make_run, clock, sched


def checkpoint(run, step: int) -> None:
    """What the trainer's save leaves for the launcher: the pointer to its newest checkpoint."""
    run.layout.checkpoints.mkdir(exist_ok=True)
    (run.layout.checkpoints / "LATEST").write_text(f"step-{step:08d}\n")


def segment(run, clock, sched, rc: int, step: int | None, seconds: float = 3600.0) -> str:
    """Run the newest queued job as a segment: begin, train for `seconds`, checkpoint, end."""
    job = [s for s in run.state()["segments"] if s["state"] == SegState.QUEUED][0]["job_id"]
    sched.jobs[job]["state"] = JobState.RUNNING
    started = control.segment_begin(str(run.dir), job, environ={})
    if started is None:
        sched.jobs[job]["state"] = JobState.COMPLETED
        return job
    clock.advance(seconds)
    if step is not None:
        checkpoint(run, step)
    control.segment_end(str(run.dir), job, rc)
    sched.jobs[job]["state"] = JobState.COMPLETED
    return job


def test_chain_continues_then_completes_with_one_successor_at_a_time(chain):
    make_run, clock, sched = chain
    run = make_run()
    for step in (10, 20):
        segment(run, clock, sched, CONTINUE, step)
        live = lifecycle.live_segments(run.state())
        assert [s["state"] for s in live] == ["QUEUED"], "exactly one successor queued"
        assert run.state()["state"] == RunState.RESUBMITTED
    segment(run, clock, sched, COMPLETE, 30)
    state = run.state()
    assert state["state"] == RunState.COMPLETED and state["stop"] == {"kind": "complete"}
    ran = [s for s in state["segments"] if s.get("started")]
    assert [(s["k"], s["start_step"], s["end_step"], s["state"]) for s in ran] == [
        (1, None, 10, "CONTINUE"), (2, 10, 20, "CONTINUE"), (3, 20, 30, "COMPLETE")]
    # the successor queued at segment 3's start found the run complete and was cancelled
    # its job was cancelled; the segment reads as not needed (not as a cancel, which is the user's)
    assert state["segments"][-1]["state"] == SegState.UNNEEDED
    assert state["segments"][-1]["reason"] == "not needed: the run is completed"
    assert sched.jobs[state["segments"][-1]["job_id"]]["state"] == JobState.CANCELLED
    assert lifecycle.used_hours(state) == pytest.approx(3.0)


def test_segment_deadline_comes_from_the_walltime_when_the_scheduler_cannot_say(chain):
    make_run, clock, sched = chain
    run = make_run(hours=2.0)
    job = run.state()["segments"][0]["job_id"]
    k, deadline, pending = control.segment_begin(str(run.dir), job, environ={})
    assert not pending
    assert k == 1 and deadline == pytest.approx(clock.now + 2 * 3600 - run.spec()["site"]["exit_margin_s"])


def test_total_hours_budget_stops_the_chain_and_resume_needs_more(chain):
    make_run, clock, sched = chain
    run = make_run("b", "budget.total_hours=2.5", hours=1.0)
    for step in (10, 20, 30):
        segment(run, clock, sched, CONTINUE, step)
    state = run.state()
    assert state["state"] == RunState.STOPPED and state["stop"]["kind"] == Stop.BUDGET
    assert state["reason"] == "budget spent (3.00 of 2.5 h)"
    assert not lifecycle.live_segments(state)
    with pytest.raises(RunError, match="--total-hours"):
        control.resume("b")
    control.resume("b", total_hours=5)
    segment(run, clock, sched, COMPLETE, 40)
    assert run.state()["state"] == RunState.COMPLETED


def test_max_segments_stops_and_resume_names_the_flag(chain):
    make_run, clock, sched = chain
    run = make_run("m", "budget.max_segments=2")
    with pytest.raises(RunError, match="continues by itself"):
        control.resume("m")
    segment(run, clock, sched, CONTINUE, 10)
    segment(run, clock, sched, CONTINUE, 20)
    state = run.state()
    assert state["state"] == RunState.STOPPED and state["stop"] == {"kind": "max_segments", "max": 2}
    with pytest.raises(RunError, match="--max-segments"):
        control.resume("m")
    control.resume("m", max_segments=3)
    assert run.state()["state"] == RunState.PENDING and run.state()["resumed_at"] == clock.now


def test_crash_loop_fails_the_run_with_the_trainers_last_error(chain):
    make_run, clock, sched = chain
    run = make_run("c")
    job = segment(run, clock, sched, 1, None)
    run.layout.log(job).write_text("hpcrl: segment\nTraceback ...\nValueError: boom\n")
    assert run.state()["state"] == RunState.RESUBMITTED  # one failure is not a loop
    segment(run, clock, sched, 1, None)
    state = run.state()
    assert state["state"] == RunState.FAILED and state["stop"]["kind"] == Stop.CRASH_LOOP
    assert "no checkpoint progress in 2 segments" in state["reason"] and "ValueError: boom" in state["reason"]
    assert not lifecycle.live_segments(state)


def test_a_trainers_own_reason_is_kept_with_its_failed_segment_and_shown(chain):
    from hpcrl.status import text as status_text

    make_run, clock, sched = chain
    run = make_run("e")
    job = [s for s in run.state()["segments"] if s["state"] == SegState.QUEUED][0]["job_id"]
    (run.dir / protocol.ERROR_FILE).write_text("stale reason of an earlier attempt\n")
    sched.jobs[job]["state"] = JobState.RUNNING
    control.segment_begin(str(run.dir), job, environ={})
    assert not (run.dir / protocol.ERROR_FILE).exists()  # begin clears the old one
    run.layout.log(job).write_text("Traceback ...\nOSError: [Errno 28] No space left on device\n")
    protocol.report_error(run.dir, "disk full at /scratch/ckpt (the previous checkpoint is intact; free space, then resume)")
    control.segment_end(str(run.dir), job, 1)
    sched.jobs[job]["state"] = JobState.COMPLETED
    state = run.state()
    seg = state["segments"][0]
    assert seg["state"] == SegState.FAILED and seg["error"].startswith("disk full at /scratch/ckpt")
    assert not (run.dir / protocol.ERROR_FILE).exists()  # taken: it lives in state.json now
    assert any("disk full at /scratch/ckpt" in e["what"] for e in state["events"])
    text = status_text.detail(run, state, status_text.summary(run, state))
    assert "error: segment 1 failed (exit code 1): disk full at /scratch/ckpt" in text
    # the next failure without a reason of its own: the crash loop names the last one given
    segment(run, clock, sched, 1, None)
    state = run.state()
    assert state["state"] == RunState.FAILED and "disk full at /scratch/ckpt" not in state["reason"]  # log tail
    assert "error" not in state["segments"][1]


def test_a_crash_loop_names_the_trainers_own_reason(chain):
    make_run, clock, sched = chain
    run = make_run("r")
    for _ in range(2):
        job = [s for s in run.state()["segments"] if s["state"] == SegState.QUEUED][0]["job_id"]
        sched.jobs[job]["state"] = JobState.RUNNING
        control.segment_begin(str(run.dir), job, environ={})
        run.layout.log(job).write_text("ray: a worker died\n")
        protocol.report_error(run.dir, "verl ended at step 16 but its newest checkpoint is step 15")
        control.segment_end(str(run.dir), job, 1)
        sched.jobs[job]["state"] = JobState.COMPLETED
    state = run.state()
    assert state["state"] == RunState.FAILED
    assert state["reason"].endswith("last error: verl ended at step 16 but its newest checkpoint is step 15")


def _failing_segment(run, clock, sched, log: str, trained_steps=(), step=None) -> str:
    """Run the queued job as a segment that logs `trained_steps` (its metrics records), saves at
    `step`, prints `log` and exits 1."""
    job = [s for s in run.state()["segments"] if s["state"] == SegState.QUEUED][0]["job_id"]
    sched.jobs[job]["state"] = JobState.RUNNING
    k, _, _ = control.segment_begin(str(run.dir), job, environ={})
    clock.advance(600)
    for n in trained_steps:
        protocol.append_metrics(run.layout.metrics, {"step": n, "segment": k, "time": clock.now})
    if step is not None:
        checkpoint(run, step)
    run.layout.log(job).write_text(log)
    control.segment_end(str(run.dir), job, 1)
    sched.jobs[job]["state"] = JobState.COMPLETED
    return job


OOM = "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"


def test_a_segment_failing_before_its_first_step_with_its_predecessors_error_ends_the_run(chain):
    """#29: a start-up failure that repeats the previous segment's error would repeat again after
    the next queue wait: the run is FAILED at once, with that line, and nothing stays queued."""
    make_run, clock, sched = chain
    run = make_run("rep")
    _failing_segment(run, clock, sched, OOM, trained_steps=range(1, 12), step=10)  # trained, then OOM
    assert run.state()["state"] == RunState.RESUBMITTED  # progress: not a loop
    _failing_segment(run, clock, sched, OOM)  # before its first step, the same error
    state = run.state()
    assert state["state"] == RunState.FAILED and state["stop"]["kind"] == Stop.REPEATED
    assert state["reason"].startswith("segment 2 failed before its first step with the error segment 1 had: "
                                      "torch.OutOfMemoryError: CUDA out of memory")
    assert "hpcrl resume rep" in state["reason"]
    assert not lifecycle.live_segments(state) and len([s for s in state["segments"] if s.get("started")]) == 2


def test_a_resumed_run_failing_at_start_as_before_stops_after_one_segment(chain):
    make_run, clock, sched = chain
    run = make_run("res")
    for _ in range(2):
        _failing_segment(run, clock, sched, "ModuleNotFoundError: No module named 'nosuchpkg'\n")
    assert run.state()["stop"]["kind"] == Stop.CRASH_LOOP  # the first two: the crash loop's words, as before
    control.resume("res")
    _failing_segment(run, clock, sched, "ModuleNotFoundError: No module named 'nosuchpkg'\n")
    state = run.state()
    assert state["state"] == RunState.FAILED and state["stop"]["kind"] == Stop.REPEATED
    assert len([s for s in state["segments"] if s.get("started")]) == 3 and not lifecycle.live_segments(state)


@pytest.mark.parametrize("second, trained", [
    ("RuntimeError: NCCL error: unhandled system error\n", ()),  # another error: may be the node's
    (OOM, (11, 12)),  # the same error, but after a step: not a start-up failure
])
def test_a_failure_that_is_not_a_repeated_start_up_failure_goes_on(chain, second, trained):
    make_run, clock, sched = chain
    run = make_run("go")
    _failing_segment(run, clock, sched, OOM, trained_steps=range(1, 12), step=10)
    _failing_segment(run, clock, sched, second, trained_steps=trained)
    assert run.state()["state"] == RunState.RESUBMITTED


def test_stop_saves_then_stops_with_nothing_after_it_and_resume_continues(chain):
    """`hpcrl stop`: the running job gets the walltime's signal, the queued successor is cancelled
    at once, the run is STOPPED (not FAILED, not CANCELLED) when the segment ends for
    continuation, and resume queues the next segment."""
    make_run, clock, sched = chain
    run = make_run("st")
    first = run.state()["segments"][0]["job_id"]
    sched.jobs[first]["state"] = JobState.RUNNING
    control.segment_begin(str(run.dir), first, environ={})
    successor = lifecycle.live_segments(run.state())[-1]["job_id"]
    signalled = []
    sched.checkpoint_stop = lambda ids, run=None: signalled.extend(ids)
    control.stop("st")
    state = run.state()
    assert signalled == [first] and state["state"] == RunState.CHECKPOINTING
    assert sched.jobs[successor]["state"] == JobState.CANCELLED and not [
        s for s in state["segments"] if s["state"] == SegState.QUEUED]
    clock.advance(60)
    checkpoint(run, 17)
    control.segment_end(str(run.dir), first, CONTINUE)
    state = run.state()
    assert state["state"] == RunState.STOPPED and state["stop"] == {"kind": "user_stop", "step": 17}
    assert state["reason"] == "stopped by the user at checkpoint step 17; `hpcrl resume st` continues from it"
    assert state["segments"][0]["user_stop"] is True  # goodput measures it by the time it held, not its walltime
    assert not lifecycle.live_segments(state) and sched.submits == 2
    with pytest.raises(RunError, match="already STOPPED; nothing to stop"):
        control.stop("st")
    control.resume("st")
    assert run.state()["state"] == RunState.PENDING and not run.state()["stop_requested"]
    segment(run, clock, sched, CONTINUE, 30)
    assert run.state()["state"] == RunState.RESUBMITTED  # the chain goes on as before


def test_stop_of_a_run_whose_segment_has_not_started_stops_it_at_once(chain):
    make_run, clock, sched = chain
    run = make_run("sq")
    control.stop("sq")
    state = run.state()
    assert state["state"] == RunState.STOPPED and state["stop"]["kind"] == "user_stop"
    assert [s["state"] for s in state["segments"]] == [SegState.CANCELLED]


def test_progress_between_failures_is_no_crash_loop(chain):
    make_run, clock, sched = chain
    run = make_run()
    segment(run, clock, sched, 1, 5)     # failed, but checkpointed further
    segment(run, clock, sched, 1, 9)
    segment(run, clock, sched, 1, None)  # no progress once
    assert run.state()["state"] == RunState.RESUBMITTED and run.state()["no_progress"] == 1


def test_segment_that_died_without_its_end_hook_is_closed_lost_by_its_successor(chain):
    make_run, clock, sched = chain
    run = make_run()
    first = run.state()["segments"][0]["job_id"]
    control.segment_begin(str(run.dir), first, environ={})
    clock.advance(600)
    checkpoint(run, 15)  # the periodic save before the node died; no end hook ran
    sched.jobs[first]["state"] = JobState.FAILED
    segment(run, clock, sched, COMPLETE, 30)
    state = run.state()
    lost, second = [s for s in state["segments"] if s.get("started")]
    assert lost["state"] == SegState.LOST and lost["end_step"] == 15 and lost["ended"] == clock.now - 3600
    assert second["start_step"] == 15 and state["state"] == RunState.COMPLETED


def test_a_requeued_job_begins_again_as_the_same_segment_without_a_second_successor(chain):
    make_run, clock, sched = chain
    run = make_run()
    job = run.state()["segments"][0]["job_id"]
    control.segment_begin(str(run.dir), job, environ={})
    successor = [s["job_id"] for s in run.state()["segments"] if s["state"] == SegState.QUEUED]
    clock.advance(600)
    checkpoint(run, 12)  # the requeue's TERM found no end hook run (a node failure): nothing else
    clock.advance(60)
    k, _, _ = control.segment_begin(str(run.dir), job, environ={})  # the same job id starts again
    state = run.state()
    assert k == 1 and [s["job_id"] for s in state["segments"]] == [job, *successor], "no second successor"
    seg = state["segments"][0]
    assert seg["state"] == SegState.RUNNING and seg["start_step"] == 12 and "ended" not in seg
    assert seg["requeues"] == [{"started": clock.now - 660, "ended": clock.now, "state": "LOST", "rc": None,
                                "start_step": None, "end_step": 12}]
    assert state["no_progress"] == 0 and lifecycle.used_hours(state) == pytest.approx(660 / 3600)
    # its second run ends; the one successor continues the chain
    clock.advance(1200)
    checkpoint(run, 30)
    control.segment_end(str(run.dir), job, CONTINUE)
    assert [s["state"] for s in run.state()["segments"]] == ["CONTINUE", "QUEUED"]
    assert lifecycle.used_hours(run.state()) == pytest.approx(1860 / 3600)
    segment(run, clock, sched, COMPLETE, 40)
    assert [(s["k"], s["state"]) for s in run.state()["segments"] if s.get("started")] == [(1, "CONTINUE"),
                                                                                           (2, "COMPLETE")]


def test_successor_submit_failures_at_begin_and_end(chain):
    make_run, clock, sched = chain
    run = make_run("f")
    sched.fail_submit = True
    job = run.state()["segments"][0]["job_id"]
    assert control.segment_begin(str(run.dir), job, environ={})[0] == 1
    assert "could not queue the successor" in run.state()["events"][-1]["what"]
    assert run.state()["state"] == RunState.RUNNING  # the segment trains on
    checkpoint(run, 3)
    control.segment_end(str(run.dir), job, CONTINUE)
    state = run.state()
    assert state["state"] == RunState.STOPPED and state["stop"]["kind"] == Stop.QUEUE_FAILED
    assert "hpcrl resume f" in state["reason"] and state["segments"][0]["state"] == SegState.CONTINUE
    sched.fail_submit = False
    control.resume("f")
    assert run.state()["state"] == RunState.PENDING


def test_cancel_then_resume_and_a_late_successor_does_nothing(chain):
    make_run, clock, sched = chain
    run = make_run("x")
    job = run.state()["segments"][0]["job_id"]
    control.segment_begin(str(run.dir), job, environ={})
    successor = run.state()["segments"][1]["job_id"]
    control.cancel("x")
    assert {sched.jobs[j]["state"] for j in (job, successor)} == {JobState.CANCELLED}
    checkpoint(run, 7)  # the SIGTERM made the trainer save
    control.segment_end(str(run.dir), job, CONTINUE)
    state = run.state()
    assert state["state"] == RunState.CANCELLED and state["segments"][0]["end_step"] == 7
    with pytest.raises(RunError, match="already CANCELLED"):
        control.cancel("x")
    assert control.segment_begin(str(run.dir), successor, environ={}) is None  # nothing to do
    control.resume("x")
    segment(run, clock, sched, COMPLETE, 20)
    state = run.state()
    assert state["state"] == RunState.COMPLETED
    assert [s for s in state["segments"] if s.get("started")][-1]["start_step"] == 7


def test_resume_hours_change_the_one_budget_record_and_the_next_submission(chain):
    make_run, clock, sched = chain
    run = make_run("h", "budget.max_segments=1", hours=1.0)
    segment(run, clock, sched, CONTINUE, 10)
    control.resume("h", hours=0.5, max_segments=2)
    newest = run.state()["segments"][-1]["job_id"]
    assert sched.jobs[newest]["hours"] == 0.5, "the backend was given the new hours"
    assert run.state()["budget"]["hours"] == 0.5 and run.spec()["spec"]["budget"]["hours"] == 0.5
    assert "budget" not in __import__("json").loads(run.layout.spec.read_text())["spec"], "one owner: state.json"


def test_status_reconciles_a_chain_whose_jobs_vanished_with_one_poll(chain):
    make_run, clock, sched = chain
    runs_ = [make_run(f"v{i}") for i in range(5)]
    for r in runs_[:3]:
        sched.jobs[r.state()["segments"][0]["job_id"]]["state"] = JobState.UNKNOWN  # purged by the scheduler
    states = control.refresh_many(runs_)
    assert sched.polls == 1
    assert [states[r.id]["state"] for r in runs_] == ["STOPPED"] * 3 + ["PENDING"] * 2
    assert states["v0"]["stop"]["kind"] == Stop.NO_JOBS and "hpcrl resume v0" in states["v0"]["reason"]


def test_scheduler_away_at_begin_the_job_keeps_trying_and_the_chain_goes_on(chain, monkeypatch):
    make_run, clock, sched = chain
    run = make_run("away", hours=1.0)
    job = run.state()["segments"][0]["job_id"]
    sched.jobs[job]["state"] = JobState.RUNNING
    sched.away = True
    k, deadline, pending = control.segment_begin(str(run.dir), job, environ={})
    assert pending and run.state()["state"] == RunState.RUNNING and run.state()["successor_pending"]
    # status meanwhile: the scheduler cannot be asked; the run is shown as it was, with the reason
    problems = {}
    assert control.refresh_many([run], problems)["away"]["state"] == RunState.RUNNING
    assert "scheduler unreachable" in problems["away"]
    waits = []

    def fake_sleep(s):  # the scheduler comes back after three tries
        waits.append(s)
        clock.advance(s)
        if len(waits) == 3:
            sched.away = False

    monkeypatch.setattr(control, "sleep", fake_sleep)
    assert control.keep_successor(str(run.dir), job, until=clock.now + 3600)
    assert waits == [2.0, 4.0, 8.0], "exponential back-off"
    state = run.state()
    assert [s["state"] for s in state["segments"]] == ["RUNNING", "QUEUED"] and not state["successor_pending"]
    assert any("after the scheduler came back" in e["what"] for e in state["events"])
    checkpoint(run, 10)
    before = sched.submits
    control.segment_end(str(run.dir), job, CONTINUE, environ={})
    assert sched.submits == before, "the end hook found the successor queued: no second one"
    segment(run, clock, sched, COMPLETE, 20)
    assert run.state()["state"] == RunState.COMPLETED


def test_a_job_whose_successor_stays_unqueued_is_not_judged_lost_until_its_end(chain, monkeypatch):
    make_run, clock, sched = chain
    run = make_run("gone", hours=1.0)
    job = run.state()["segments"][0]["job_id"]
    sched.fail_submit = True
    control.segment_begin(str(run.dir), job, environ={})
    sched.jobs[job]["state"] = JobState.UNKNOWN  # squeue does not list it (yet): not a lost chain
    assert control.refresh_many([run])["gone"]["state"] == RunState.RUNNING
    monkeypatch.setattr(control, "sleep", clock.advance)
    assert not control.keep_successor(str(run.dir), job, until=clock.now + 100)
    state = run.state()
    assert state["state"] == RunState.STOPPED and state["stop"]["kind"] == Stop.QUEUE_FAILED
    assert "hpcrl resume gone" in state["reason"] and clock.now <= run.state()["created"] + 100 + 60


# ---------------------------------------------------------------- pure rules


def test_a_trainer_without_the_protocol_continues_when_its_checkpoint_advanced():
    state = lifecycle.new_state("m", "tpu", "tpu", "maxtext", {"hours": 1, "total_hours": None, "max_segments": 9}, 0)
    lifecycle.queued(state, "q1", None, 0)
    lifecycle.begin(state, "q1", None, 1, chains=False)
    kw = dict(obeys_protocol=False, chains=False, exit_complete=0, exit_continue=85)
    assert lifecycle.end(state, "q1", 143, 50, 3600, **kw) == []  # killed at the walltime, but saved
    assert state["segments"][0]["state"] == SegState.CONTINUE
    assert state["reason"] == "waiting for the next segment to be started"
    assert lifecycle.next_segment(state, 3601) == [lifecycle.Queue(after=None)]


def test_preemption_back_off_and_retries_since_the_last_resume():
    outcomes = [(10, "preempted"), (20, "done"), (30, "preempted"), (40, "lost")]
    retry = ("preempted", "lost")
    assert lifecycle.retries_in_a_row({"resumed_at": None}, outcomes, retry) == 2
    assert lifecycle.retries_in_a_row({"resumed_at": 35}, outcomes, retry) == 1
    assert [lifecycle.backoff_due(100, n, 60, 1800) for n in (1, 2, 3, 10)] == [160, 220, 340, 1900]


def test_planned_segments():
    assert lifecycle.planned_segments({"hours": 4, "total_hours": 10, "max_segments": 20}) == 3
    assert lifecycle.planned_segments({"hours": 4, "total_hours": None, "max_segments": 20}) == 20


def _segment_keeping(run, clock, sched, work: int | None, note: str | None = None) -> None:
    """A segment that stops for continuation (85) without a checkpoint: it kept `work` (the
    trainer's protocol.write_progress count, None: never written) and left `note` as its reason."""
    job = [s for s in run.state()["segments"] if s["state"] == SegState.QUEUED][0]["job_id"]
    sched.jobs[job]["state"] = JobState.RUNNING
    control.segment_begin(str(run.dir), job, environ={})
    clock.advance(180)
    if work is not None:
        protocol.write_progress(run.dir, work)
    if note:
        protocol.report_error(run.dir, note)
    control.segment_end(str(run.dir), job, CONTINUE)
    sched.jobs[job]["state"] = JobState.COMPLETED


def test_kept_evaluation_work_is_progress_and_a_crash_loop_shows_the_trainers_numbers(chain):
    """#41 item 5: segments that stop inside a long first evaluation save no checkpoint but keep its
    batches (the progress count rises): not a crash loop. Two that keep nothing are one, and the
    run's reason names the segment length and the trainer's own note (start-up and evaluation
    times, what to change), not "(no log output)"."""
    make_run, clock, sched = chain
    run = make_run("ev", hours=0.05)
    for work in (16, 32, 48):
        _segment_keeping(run, clock, sched, work, note="stopped (SIGUSR1) before the first training step")
    state = run.state()
    assert state["state"] == RunState.RESUBMITTED and state["no_progress"] == 0, state["reason"]
    assert [(s.get("start_work"), s["end_work"]) for s in state["segments"] if s.get("started")] == [
        (None, 16), (16, 32), (32, 48)]
    note = ("stopped (deadline) before the first training step: the start-up took 170 s and eval_before 0 s of this "
            "segment (48 of 192 eval rows kept so far); raise --hours, or set args.eval_before=false")
    _segment_keeping(run, clock, sched, 48, note)
    assert run.state()["state"] == RunState.RESUBMITTED, "one segment without progress is not a loop"
    _segment_keeping(run, clock, sched, 48, note)
    state = run.state()
    assert state["state"] == RunState.FAILED and state["stop"]["kind"] == Stop.CRASH_LOOP
    assert state["reason"] == f"no checkpoint progress in 2 segments in a row (0.05 h each); last error: {note}"
    assert [s["state"] for s in state["segments"] if s.get("started")] == [SegState.CONTINUE] * 5
