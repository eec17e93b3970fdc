"""A chain of 1-minute segments on the real Slurm cluster, during which the scheduler goes away
for a while, for real: slurmctld of the test cluster is stopped
(SIGSTOP: it neither answers nor forgets anything, like a hung or restarting controller) for
longer than a segment's end hook could wait, then continued. The running segment keeps training,
`status` says the scheduler is unreachable instead of failing (and judges nothing), and when
slurmctld is back the chain continues and completes with every step once. (A successor that
cannot be queued at all is retried with back-off by the job itself: tests/test_lifecycle.py
drives that path on a fake clock.)"""

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import hpcrl, last_step, read_metrics, run_dir, run_state, started, wait_for_run, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.stops_slurmctld]


def _slurmctld_pid() -> int:
    conf = os.environ.get("SLURM_CONF", "")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"slurmctld") and conf.encode() in cmd:
            return int(proc.name)
    pytest.skip(f"no slurmctld of this test cluster ({conf}) found")


@contextlib.contextmanager
def slurmctld_away():
    pid = _slurmctld_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_chain_on_slurm_survives_slurmctld_away_longer_than_a_hook_waits(home, slurm_cluster):
    from slurm_fixture import cluster_to_myself

    name = "sl-away"
    whole_cluster = contextlib.ExitStack()  # Slurm tests on other workers would see the outage too:
    whole_cluster.enter_context(cluster_to_myself())  # the cluster is this test's until it is back
    try:
        hpcrl("submit", "--site", "testcluster", "--trainer", "smoke", "--hours", "0.0167", "--name", name,
              "--set", "args.steps=140", "--set", "args.step_time_s=0.5", "--set", "args.save_every=1000")
        rdir = run_dir(name)

        def running_untouched_with_successor():
            # Slurm sometimes sends a segment's USR1 right at its start (see test_slurm_lifecycle):
            # such a segment stops for continuation at once, and its successor is the one to take
            segs = run_state(name)["segments"]
            running = [s for s in segs if s["state"] == "RUNNING"]
            if len(running) != 1 or segs[-1]["state"] != "QUEUED" or (running[0].get("start_step") or 0) + 3 > last_step(rdir):
                return False
            log = rdir / "logs" / f"job-{running[0]['job_id']}.log"
            return log.exists() and "USR1" not in log.read_text()

        wait_until(running_untouched_with_successor, 150, "a segment training, no USR1 yet, its successor queued",
                   poll=0.3)
        with slurmctld_away():
            t0 = time.time()
            row = json.loads(hpcrl("status", "--json", timeout=120).stdout)[0]
            took = time.time() - t0
            assert row["state"] in ("RUNNING", "CHECKPOINTING"), row
            assert row["note"] and "scheduler unreachable" in row["note"], row
            assert took < 60, f"status took {took:.0f} s with the scheduler away"
            before = last_step(rdir)
            time.sleep(max(0.0, 30 - (time.time() - t0)))  # longer than the hooks' exit margin (8 s)
            assert last_step(rdir) > before, "the running segment kept training"
            assert run_state(name)["state"] in ("RUNNING", "RESUBMITTED"), "nothing was judged while away"
        whole_cluster.close()
        state = wait_for_run(name, timeout=300)
        assert state["state"] == "COMPLETED", state
        assert [m["step"] for m in read_metrics(rdir)] == list(range(1, 141)), "every step once"
        ran = started(state)
        assert len(ran) >= 2
        for prev, nxt in zip(ran, ran[1:]):
            assert prev["state"] == "CONTINUE" and prev["rc"] == 85 and nxt["start_step"] == prev["end_step"]
        # Slurm's own record of a continuation segment is a job that did its work, not a failure
        from hpcrl.backends.slurm import SlurmBackend

        def records():
            infos = SlurmBackend({}).query([s["job_id"] for s in ran])
            return [(infos[s["job_id"]].state.value, infos[s["job_id"]].exit_code) for s in ran]

        # a record without its exit code yet (one job's, once, right after the outage) is waited for
        wait_until(lambda: all(code is not None for _, code in records()), 60, "Slurm's records' exit codes",
                   poll=2, describe=records)
        assert records() == [("COMPLETED", 0)] * len(ran)
        time.sleep(1)
        queue = subprocess.run(["squeue", "-h", "--name", name, "-o", "%T"], capture_output=True, text=True).stdout
        assert all(st in ("COMPLETED", "CANCELLED") for st in queue.split()), queue
    finally:
        whole_cluster.close()  # closing twice is harmless
        subprocess.run(["scancel", "--name", name], capture_output=True)
