"""A job Slurm requeues (node failure, preemption, `scontrol requeue`) begins again with the same
job id; its successor, queued at its first start, keeps waiting for it (afterany counts the job's
final end). hpcrl handles the second start: the segment's record keeps the first start as an
attempt, and no second successor is queued (one successor per segment, the chain is not doubled).
Real `scontrol requeue` on the test cluster (JobRequeue=1, cred_expire=10: the job restarts within
about 20 s)."""

from __future__ import annotations

import subprocess

import pytest

from helpers import hpcrl, read_metrics, run_dir, run_state, started, wait_for_run, wait_for_step, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]


@pytest.fixture
def names(home, slurm_cluster):
    names: list[str] = []
    yield names
    for name in names:
        subprocess.run(["scancel", "--name", name], capture_output=True)


def _sacct(*args: str) -> list[list[str]]:
    """sacct rows (JobID, State); -D lists each start of a requeued job."""
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-S", "now-1hour", "-o", "JobID,State", *args],
                         capture_output=True, text=True, check=True).stdout
    return [ln.split("|") for ln in out.splitlines() if ln.strip()]


def test_a_requeued_segment_starts_again_without_a_second_successor(names):
    names.append("rq")
    # 3-minute jobs: Slurm's own USR1 (>= 2 minutes in) comes after the run has finished.
    hpcrl("submit", "--site", "testcluster", "--trainer", "smoke", "--hours", "0.05", "--name", "rq",
          "--set", "args.steps=40", "--set", "args.step_time_s=0.3", "--set", "args.save_every=5")
    rdir = run_dir("rq")
    wait_for_step(rdir, 6, timeout=120)
    first = run_state("rq")
    job = next(s["job_id"] for s in first["segments"] if s["state"] == "RUNNING")
    successor = [s["job_id"] for s in first["segments"] if s["state"] == "QUEUED"]
    assert len(successor) == 1, first["segments"]
    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, text=True)
    wait_until(lambda: any(s.get("requeues") for s in run_state("rq")["segments"]), 180,
               f"job {job} to begin again after its requeue", poll=0.5)

    state = wait_for_run("rq", timeout=300)
    assert state["state"] == "COMPLETED", state
    # the chain: the requeued job and the one successor it queued at its first start, nothing more
    assert [s["job_id"] for s in state["segments"]] == [job, successor[0]], state["segments"]
    seg = state["segments"][0]
    assert seg["k"] == 1 and seg["state"] == "COMPLETE" and len(seg["requeues"]) == 1, seg
    attempt = seg["requeues"][0]
    assert attempt["started"] < seg["started"] and attempt["state"] in ("CONTINUE", "FAILED", "LOST"), attempt
    assert seg["start_step"] >= 5, "the second start resumed from a checkpoint of the first"
    assert [s["k"] for s in started(state)] == [1], started(state)
    assert any("requeued by the scheduler" in e["what"] for e in state["events"]), state["events"]
    shown = hpcrl("status", "rq").stdout  # the user sees it too, not only state.json
    assert f"requeued: segment 1 (job {job}) once, the last after {attempt['state'].lower()} at step " in shown, shown
    assert sorted(set(m["step"] for m in read_metrics(rdir))) == list(range(1, 41))
    log = (rdir / "logs" / f"job-{job}.log").read_text()
    assert "DUE TO JOB REQUEUE" in log and log.count(f"segment 1 job {job} ") == 2, log
    # Slurm's own record: the job started twice (REQUEUED, then COMPLETED) and ran no other job of
    # the run (the successor was cancelled while pending, when the run completed)
    assert [st for _, st in _sacct("-j", job)] == ["REQUEUED", "COMPLETED"], _sacct("-j", job)
    mine = {j for j, _ in _sacct("--name", "rq") if int(j) >= int(job)}  # not earlier tests' runs named rq
    assert mine <= {job, successor[0]}, _sacct("--name", "rq")
