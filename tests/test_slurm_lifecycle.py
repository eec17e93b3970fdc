"""The run lifecycle end to end on the real throwaway Slurm cluster, with 1-minute jobs.

Slurm checks limits on a 30 s tick and may send the USR1 warning far earlier than asked, so the
tests assert what the protocol guarantees (no step lost, checkpoint before every stop), not when.
"""

import os
import signal
import subprocess
import time

import pytest

from helpers import (hpcrl, read_metrics, run_dir, run_state, started, trainer_paused, wait_for_run, wait_for_step,
                     wait_until)

pytestmark = [pytest.mark.slurm]
ONE_MIN = "0.0167"


@pytest.fixture
def slurm_home(home, slurm_cluster):
    names = []
    yield names
    for name in names:  # leave nothing queued on the shared cluster
        subprocess.run(["scancel", "--name", name], capture_output=True)


def _squeue(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "--name", name, "-o", "%i %T"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.strip()]


def _submit(names, name, *args):
    names.append(name)
    return hpcrl("submit", "--site", "testcluster", "--trainer", "smoke", "--hours", ONE_MIN, "--name", name, *args)


def _kill_hard(job_id: str) -> None:
    """SIGKILL every process of the job, as a node failure would: no signal to trap, no end hook.
    (scancel --signal=KILL still ends the job with SIGTERM first on this Slurm.)"""
    # The job's node by name: on the Perlmutter-shaped cluster each node has its own spool dir.
    node = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True).stdout.strip()
    out = subprocess.run(["scontrol", "listpids", job_id, *([node] if node else [])],
                         capture_output=True, text=True, check=True).stdout
    pids = [int(line.split()[0]) for line in out.splitlines()[1:] if line.split()]
    assert pids, out
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# The plain chain (segments, resume, completion, Slurm's records of continuation segments) runs in
# tests/test_slurm_outage.py, with slurmctld away for a while in its first segment.


def test_hard_kill_no_signal_successor_resumes_from_periodic_checkpoint(slurm_home):
    # 3-minute jobs: Slurm's early USR1 (up to a 30 s tick before lead) cannot end it first.
    _submit(slurm_home, "sl-hard", "--hours", "0.05", "--set", "args.steps=30", "--set", "args.step_time_s=0.3",
            "--set", "args.save_every=5")
    rdir = run_dir("sl-hard")
    wait_for_step(rdir, 7, timeout=90)
    victim = next(s for s in run_state("sl-hard")["segments"] if s["state"] == "RUNNING")
    _kill_hard(victim["job_id"])
    state = wait_for_run("sl-hard", timeout=420)
    assert state["state"] == "COMPLETED", state
    segs = started(state)
    k = next(i for i, s in enumerate(segs) if s["job_id"] == victim["job_id"])
    assert segs[k]["state"] == "LOST" and segs[k]["rc"] is None
    resumed_at = segs[k + 1]["start_step"]
    assert resumed_at is not None and resumed_at % 5 == 0 and resumed_at >= 5, "from the last periodic checkpoint"
    assert sorted(set(m["step"] for m in read_metrics(rdir))) == list(range(1, 31))


def test_crash_at_same_step_fails_after_two_segments_and_queues_nothing(slurm_home):
    _submit(slurm_home, "sl-crash", "--set", "args.steps=50", "--set", "args.step_time_s=0.1",
            "--set", "args.crash_at_step=3")
    state = wait_for_run("sl-crash", timeout=300)
    assert state["state"] == "FAILED" and "no checkpoint progress" in state["reason"]
    # Slurm may deliver USR1 early (its 30 s tick): a segment can then stop for continuation at
    # step 2 before it reaches the crash; the run fails after two failures in a row without progress
    ran = started(state)
    assert [s["state"] for s in ran[-2:]] == ["FAILED", "FAILED"] and all(s["rc"] == 1 for s in ran[-2:])
    assert all(s["state"] in ("FAILED", "CONTINUE") for s in ran) and len(ran) <= 4
    time.sleep(2)
    assert not [ln for ln in _squeue("sl-crash") if "PENDING" in ln or "RUNNING" in ln]


def test_second_submit_refused_and_cancel_removes_running_and_queued_jobs(slurm_home):
    _submit(slurm_home, "sl-cancel", "--set", "args.steps=1000", "--set", "args.step_time_s=0.5")
    r = hpcrl("submit", "--site", "testcluster", "--trainer", "smoke", "--name", "sl-cancel", check=False)
    assert r.returncode == 2 and "already exists" in r.stderr
    live = lambda: [ln for ln in _squeue("sl-cancel") if "PENDING" in ln or "RUNNING" in ln]
    wait_until(lambda: len(live()) >= 2, 90, "the running segment and its queued successor", poll=0.5,
               describe=live)
    assert len(live()) == 2
    hpcrl("cancel", "sl-cancel")
    state = wait_for_run("sl-cancel", timeout=120)
    assert state["state"] == "CANCELLED"
    time.sleep(1)
    assert not [ln for ln in _squeue("sl-cancel") if "PENDING" in ln or "RUNNING" in ln]


def test_a_failure_repeated_before_the_first_step_ends_the_run_with_no_second_queue_wait(slurm_home, tmp_path):
    """#29 on the real scheduler: the segment that repeats its predecessor's error before its first
    step is the last; its queued successor is cancelled, no third job runs."""
    flag = tmp_path / "broken"
    _submit(slurm_home, "sl-rep", "--hours", "0.05", "--set", "args.steps=300", "--set", "args.step_time_s=0.3",
            "--set", "args.save_every=5", "--set", f"args.fail_if_exists={flag}")
    wait_for_step(run_dir("sl-rep"), 6, timeout=120)
    flag.touch()
    state = wait_for_run("sl-rep", timeout=300)
    assert state["state"] == "FAILED" and state["stop"]["kind"] == "repeated", state["reason"]
    assert len(started(state)) == 2 and f"smoke: error: {flag} exists" in state["reason"]
    assert not _squeue("sl-rep")


def test_a_reward_file_that_cannot_import_is_refused_at_submit_on_slurm(slurm_home, tmp_path):
    file = tmp_path / "r.py"
    file.write_text("import nosuchpkg_sl29\ndef score(*a, **k):\n    return 0.0\n")
    slurm_home.append("sl-imp")
    r = hpcrl("submit", "--site", "testcluster", "--trainer", "builtin", "--hours", ONE_MIN, "--name", "sl-imp",
              "--set", f"args.reward={file}:score", check=False)
    assert r.returncode == 2 and "fails to import in the trainer's python" in r.stderr, r.stderr
    assert not _squeue("sl-imp")


def test_stop_saves_at_the_last_trained_step_runs_nothing_after_and_resume_continues(slurm_home):
    """#29 on the real scheduler: `hpcrl stop` reaches the batch shell's USR1 trap (scancel
    --signal=USR1 --batch, as the walltime's --signal=B:USR1), the built-in trainer saves at its
    last trained step, the queued successor is cancelled, resume continues from that step."""
    from test_local_lifecycle import STOP_ARGS

    sets = [a for kv in STOP_ARGS for a in ("--set", f"args.{kv}")]
    slurm_home.append("sl-stp")
    hpcrl("submit", "--site", "testcluster", "--trainer", "builtin", "--hours", "0.1", "--name", "sl-stp", *sets)
    rdir = run_dir("sl-stp")
    wait_for_step(rdir, 3, timeout=300)
    with trainer_paused(rdir):  # the 30 tiny steps would otherwise race a slow `hpcrl stop` to the end
        hpcrl("stop", "sl-stp")
    state = wait_for_run("sl-stp", timeout=180)
    assert state["state"] == "STOPPED" and state["stop"]["kind"] == "user_stop", state["reason"]
    (seg,) = started(state)
    trained = max(m["step"] for m in read_metrics(rdir) if m.get("phase") in (None, "train"))
    assert seg["state"] == "CONTINUE" and seg["end_step"] == trained < 30, (seg, trained)
    assert not _squeue("sl-stp"), "nothing queued after the stopped segment"
    hpcrl("resume", "sl-stp")
    state = wait_for_run("sl-stp", states=("COMPLETED",), timeout=400)
    assert started(state)[1]["start_step"] == trained
    steps = [m["step"] for m in read_metrics(rdir) if m.get("phase") in (None, "train")]
    assert steps == list(range(1, 31))
