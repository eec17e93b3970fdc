"""Ranks on two nodes for real: `hpcrl submit --nodes 2` on the Perlmutter-shaped test cluster runs
one torchrun per node under srun, meeting in a c10d rendezvous on the first node (each node has its
own hostname and address there). The trainer is the smoke trainer under torchrun, which the
built-in trainer's launch is identical to (only the module differs): rank 0 trains, the rank on
the other node keeps step with it.

- A 2-node x 1-rank run goes through segments (USR1 -> the stop file -> rank 0's 85 in the exit
  file -> continue) and completes.
- A rank killed on the second node takes the step down on both nodes (srun --kill-on-bad-exit), the
  segment fails; the run, resumed on one node (`hpcrl resume --nodes 1`), continues from its last
  checkpoint as a single process and completes.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import hpcrl, read_metrics, run_dir, started, wait_for_run, wait_until
from hpcrl.runs import Run

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]
pytest.importorskip("torch.distributed.run", reason="torchrun (torch) starts the ranks")


@pytest.fixture
def ranks_site(home, pm_cluster):
    (Path(os.environ["HPCRL_SITES_DIR"]) / "tcranks.yaml").write_text(yaml.safe_dump({"extends": "testcluster"}))
    names: list[str] = []
    yield names
    for name in names:
        subprocess.run(["scancel", "--name", name], capture_output=True)


def _logs(run_id: str, state: dict) -> list[str]:
    layout = Run.by_id(run_id).layout
    return [layout.log(s["job_id"]).read_text() for s in started(state)]


def _ranks_in(netns: str, run_id: str) -> list[int]:
    """pids of this run's smoke ranks (not torchrun itself) in that node's network namespace."""
    want = f"net:[{os.stat(netns).st_ino}]"
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.readlink(proc / "ns" / "net") != want:
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hpcrl.trainers.smoke" in argv and b"torch.distributed.run" not in argv and \
                any(f"/{run_id}/smoke.json".encode() in a for a in argv):
            found.append(int(proc.name))
    return found


def test_two_nodes_one_rank_each_through_segments_to_completion(ranks_site, pm_cluster):
    head, other = pm_cluster.nodes[:2]
    ranks_site.append("ranks2n")
    hpcrl("submit", "--site", "tcranks", "--trainer", "smoke", "--nodes", "2", "--hours", "0.0167", "--name", "ranks2n",
          "--set", "args.steps=160", "--set", "args.step_time_s=0.25", "--set", "args.save_every=1000")
    state = wait_for_run("ranks2n", timeout=360)
    logs = _logs("ranks2n", state)
    assert state["state"] == "COMPLETED", f"{state}\n{''.join(logs)[-3000:]}"
    ran = started(state)
    assert len(ran) >= 2, ran
    for seg in ran[:-1]:
        assert seg["state"] == "CONTINUE" and seg["rc"] == 85, seg  # the code from the exit file
    for prev, nxt in zip(ran, ran[1:]):
        assert nxt["start_step"] == prev["end_step"] > 0
    assert [m["step"] for m in read_metrics(run_dir("ranks2n"))] == list(range(1, 161))
    for log in logs:
        # one torchrun per node: rank 0 on the first node, where the rendezvous is; rank 1 on the other
        assert f"hpcrl: torchrun rendezvous at {head}:" in log, log
        assert f"smoke: rank 0 of 2 on {head} " in log and f"smoke: rank 1 of 2 on {other} " in log, log
    assert "USR1: checkpoint and stop (stop file for the ranks)" in logs[0] and "(SIGUSR1)" in logs[0], logs[0]
    script = (run_dir("ranks2n") / "job.sh").read_text()
    assert "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 " in script


def test_rank_killed_on_the_second_node_fails_the_segment_and_resume_on_one_node_continues(ranks_site, pm_cluster):
    head, other = pm_cluster.nodes[:2]
    ranks_site.append("ranks2k")
    hpcrl("submit", "--site", "tcranks", "--trainer", "smoke", "--nodes", "2", "--hours", "0.05", "--name", "ranks2k",
          "--max-segments", "1", "--set", "args.steps=120", "--set", "args.step_time_s=0.25",
          "--set", "args.save_every=20")
    rdir = run_dir("ranks2k")
    victims = wait_until(lambda: _ranks_in(pm_cluster.netns(other), "ranks2k"), 120, f"the rank on {other}")
    wait_until(lambda: len(read_metrics(rdir)) >= 30, 90, "a periodic checkpoint and more steps")
    for pid in victims:
        os.kill(pid, signal.SIGKILL)  # the rank on the second node dies: no trap, no save
    state = wait_for_run("ranks2k", timeout=150)
    first = started(state)[0]
    # torchrun on that node reports it, srun --kill-on-bad-exit ends the first node's torchrun: the
    # segment fails by itself, well inside its 3-minute walltime (Slurm would have said TIMEOUT)
    assert state["state"] == "STOPPED" and first["state"] == "FAILED" and first["rc"] == 1, state
    sacct = subprocess.run(["sacct", "-X", "-P", "-n", "-o", "State", "-j", first["job_id"]],
                           capture_output=True, text=True).stdout.strip()
    assert sacct.startswith("FAILED"), sacct
    assert not _ranks_in(pm_cluster.netns(head), "ranks2k") and not _ranks_in(pm_cluster.netns(other), "ranks2k")
    assert first["end_step"] >= 20

    out = hpcrl("resume", "ranks2k", "--nodes", "1", "--max-segments", "3").stdout
    assert "resumed run ranks2k" in out
    state = wait_for_run("ranks2k", timeout=200)
    logs = _logs("ranks2k", state)
    assert state["state"] == "COMPLETED", f"{state}\n{logs[-1][-2000:]}"
    second = started(state)[1]
    assert second["start_step"] == first["end_step"] and second["end_step"] == 120, second
    assert "smoke: rank 1 of 2" in logs[0] and "smoke: rank" not in logs[1], "one node, one rank: a plain process"
    assert "torch.distributed.run" not in (rdir / "job.sh").read_text() and "#SBATCH --nodes=1" in (rdir / "job.sh").read_text()
    assert any("resources: 2 node(s) x 1 rank(s) -> 1 node(s) x 1 rank(s)" in e["what"] for e in state["events"]), \
        state["events"]
    steps = [m["step"] for m in read_metrics(rdir)]
    assert sorted(set(steps)) == list(range(1, 121))
