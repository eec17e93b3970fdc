"""Scheduler faults at the segment boundaries (the failure is injected with a test double of
the backend's submit; everything else is real: run dir, state file, checkpoints)."""

import time

import pytest

from hpcrl import protocol
from hpcrl import control
from hpcrl.lifecycle import RunState, SegState
from hpcrl.backends.local import LocalBackend
from hpcrl.errors import BackendError
from hpcrl.spec import resolve

from helpers import publish_checkpoint


def _failing_submit(self, *a, **k):
    raise BackendError("sbatch failed: Socket timed out on send/recv operation")


@pytest.fixture
def run(home):
    resolved = resolve(None, "local", ["args.steps=5"], {"trainer": "smoke", "hours": 0.01})
    run = control.create_run(resolved, "faulty")
    with run.locked() as state:
        state["segments"].append({"job_id": "1", "state": SegState.QUEUED, "submitted": time.time()})
    return run


def test_successor_submit_failure_does_not_stop_the_running_segment(run, monkeypatch):
    monkeypatch.setattr(LocalBackend, "submit", _failing_submit)
    end = time.time() + 100
    k, deadline, pending = control.segment_begin(str(run.dir), "1", environ={"HPCRL_JOB_END_TIME": str(end)})
    assert pending, "the job script is told to keep trying"
    assert k == 1 and deadline == pytest.approx(end - 4)  # local site: exit_margin_s 4
    state = run.state()
    assert state["state"] == RunState.RUNNING
    assert "could not queue the successor" in state["events"][-1]["what"]
    # The segment made progress, then its end hook cannot queue the next one either.
    publish_checkpoint(run.dir / "checkpoints", 3, {"state.json": b"{}"})
    control.segment_end(str(run.dir), "1", protocol.EXIT_CONTINUE)
    state = run.state()
    assert state["state"] == RunState.STOPPED and "hpcrl resume faulty" in state["reason"]
    assert state["segments"][0]["end_step"] == 3 and state["segments"][0]["state"] == SegState.CONTINUE


def test_unreadable_end_time_falls_back_to_the_walltime(run, monkeypatch):
    def broken_end(self, *a):
        raise BackendError("squeue failed: slurm_load_jobs error")

    monkeypatch.setattr(LocalBackend, "end_time", broken_end)
    monkeypatch.setattr(LocalBackend, "submit", lambda self, *a, **k: "2")
    before = time.time()
    _, deadline, pending = control.segment_begin(str(run.dir), "1", environ={})
    assert not pending
    assert before + 36 - 4 - 1 <= deadline <= time.time() + 36 - 4
