"""Two ranks under torchrun on the local backend, real processes and real signals: the segment's
USR1 reaches the ranks as the stop file, rank 0's 85 comes back through the exit file, the chain
goes on and completes; kill -9 of one rank takes the segment down and the successor resumes."""

import json
import os
import signal
from pathlib import Path

import pytest

from helpers import hpcrl, read_metrics, run_dir, started, wait_for_run, wait_until

pytest.importorskip("torch.distributed.run", reason="torchrun (torch) starts the ranks")

WALL = "0.01"  # 36 s per segment: USR1 at ~26 s (lead 10 s). torchrun starts in ~2 s on a quiet machine, but
# 14.4 s segments lost two starts in a row to a loaded one (verl tiers beside: load ~17): the run FAILED


@pytest.fixture
def ranks_local(home):
    """The local site with a 10 s signal lead: two ranks under torchrun stop through the stop file,
    torchrun tears down, then the end hook (a Python process) runs, all before the walltime's
    kill. With the 4 s of the other lifecycle tests' site, a loaded machine (load ~17) ran the end
    hook past the kill and the segment was LOST."""
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "rankslocal.yaml").write_text(
        "extends: local\nsignal_lead_s: 10\nexit_margin_s: 3\nkill_grace_s: 5\n", encoding="utf-8")
    return "rankslocal"


def _submit(site, name, *extra):
    return hpcrl("submit", "--site", site, "--trainer", "smoke", "--hours", WALL, "--name", name,
                 "--set", "resources.ranks_per_node=2", *extra)


def _ranks_of(rdir: Path) -> dict[int, int]:
    """RANK -> pid of this run's smoke ranks (torchrun's workers) alive now."""
    found = {}
    config = str(rdir / "smoke.json").encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"hpcrl.trainers.smoke" not in argv or config not in argv or b"torch.distributed.run" in argv:
                continue
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(proc.name)
    return found


def test_two_ranks_stop_by_the_stop_file_continue_through_segments_and_complete(ranks_local):
    _submit(ranks_local, "ranks2", "--set", "args.steps=200", "--set", "args.step_time_s=0.2",
            "--set", "args.save_every=1000")
    state = wait_for_run("ranks2", timeout=480)
    rdir = run_dir("ranks2")
    assert state["state"] == "COMPLETED", state
    ran = started(state)
    assert len(ran) >= 2, ran
    # stopped by the stop file (no periodic save: save_every is larger than the run), code 85 from
    # the exit file; a later segment may instead be cut by the walltime on a loaded machine (LOST:
    # its end hook did not run in time), and the chain still resumes from its checkpoint
    assert ran[0]["state"] == "CONTINUE" and ran[0]["rc"] == 85, ran[0]
    for seg in ran[1:-1]:
        assert (seg["state"], seg["rc"]) in (("CONTINUE", 85), ("LOST", None)), seg
    assert ran[-1]["state"] == "COMPLETE" and ran[-1]["rc"] == 0
    for prev, nxt in zip(ran, ran[1:]):
        assert nxt["start_step"] == prev["end_step"]
    assert [m["step"] for m in read_metrics(rdir)] == list(range(1, 201)), "rank 0 alone writes each step once"
    for seg in ran:
        log = (rdir / "logs" / f"job-{seg['job_id']}.log").read_text()
        assert "smoke: rank 0 of 2 " in log and "smoke: rank 1 of 2 " in log and "smoke: rank 1 done" in log, log
    first = (rdir / "logs" / f"job-{ran[0]['job_id']}.log").read_text()
    assert "USR1: checkpoint and stop (stop file for the ranks)" in first and "(SIGUSR1)" in first, first
    assert "torch.distributed.run" in (rdir / "job.sh").read_text()
    left = [p.name for p in rdir.iterdir() if p.name.startswith((".trainer-stop-", ".trainer-exit-", ".trainer-rc-"))]
    assert not left, left


def test_kill_9_of_one_rank_fails_the_segment_and_the_successor_resumes(ranks_local):
    _submit(ranks_local, "rkill", "--hours", "0.02", "--set", "args.steps=40", "--set", "args.step_time_s=0.2",
            "--set", "args.save_every=5")
    rdir = run_dir("rkill")
    ranks = wait_until(lambda: (lambda r: r if len(r) == 2 else None)(_ranks_of(rdir)), 240, "two ranks running")
    wait_until(lambda: len(read_metrics(rdir)) >= 12, 240, "a periodic checkpoint and a few more steps")
    os.kill(ranks[1], signal.SIGKILL)  # a rank dies (OOM killer, a segfault): no trap, no save
    state = wait_for_run("rkill", timeout=180)
    assert state["state"] == "COMPLETED", state
    first, second = started(state)[:2]
    # torchrun reports the dead rank as 1 (its own code, the exit file is not consulted) and ends rank 0 with
    # it: the segment failed by itself, not by its walltime (the job's record would say TIMEOUT)
    assert first["state"] == "FAILED" and first["rc"] == 1, first
    # rank 0, sent TERM by torchrun, saved where it was (the smoke trainer's save is instant); a real
    # trainer's ranks may not agree on a save with one of them gone: then the periodic one (10) is used
    assert second["start_step"] == first["end_step"] >= 10, (first, second)
    steps = [m["step"] for m in read_metrics(rdir)]
    assert steps[-1] == 40 and sorted(set(steps)) == list(range(1, 41))
    assert not _ranks_of(rdir)
    log = (rdir / "logs" / f"job-{first['job_id']}.log").read_text()
    assert "hpcrl: trainer exited with code 1" in log, log
    job = json.loads((rdir / ".queue" / f"{first['job_id']}.json").read_text())
    assert (job["state"], job["exit_code"]) == ("FAILED", 1), job


def test_resume_on_another_world_size_rewrites_spec_and_script_and_continues(ranks_local):
    hpcrl("submit", "--site", ranks_local, "--trainer", "smoke", "--hours", WALL, "--name", "grow", "--max-segments", "1",
          "--set", "args.steps=250", "--set", "args.step_time_s=0.2", "--set", "args.save_every=1000")
    state = wait_for_run("grow", timeout=240)
    rdir = run_dir("grow")
    assert state["state"] == "STOPPED" and "torch.distributed.run" not in (rdir / "job.sh").read_text()
    before = (rdir / "spec.json").read_text(), (rdir / "job.sh").read_text()
    for args, message in ((["--nodes", "2"], "the local site is this one machine"),
                          (["--set", "resources.ranks_per_node=0"], "resources.ranks_per_node: must be at least 1"),
                          (["--set", "args.steps=5"], "hpcrl resume changes only resources.KEY"),
                          (["--set", "resources.rank=2"], "resources.rank: unknown key")):
        r = hpcrl("resume", "grow", *args, check=False)
        assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert ((rdir / "spec.json").read_text(), (rdir / "job.sh").read_text()) == before, "a refused resume changes nothing"
    assert "resources: 1 node x 1 per node = 1 rank" in hpcrl("status", "grow").stdout
    hpcrl("resume", "grow", "--set", "resources.ranks_per_node=2", "--max-segments", "12")
    assert "resources: 1 node x 2 per node = 2 ranks" in hpcrl("status", "grow").stdout  # what comes next
    assert json.loads((rdir / "spec.json").read_text())["spec"]["resources"]["ranks_per_node"] == 2
    assert "--nproc-per-node 2 --standalone" in (rdir / "job.sh").read_text()
    state = wait_for_run("grow", timeout=600)
    assert state["state"] == "COMPLETED", state
    ran = started(state)
    assert ran[1]["start_step"] == ran[0]["end_step"] > 0
    assert "smoke: rank 1 of 2" in (rdir / "logs" / f"job-{ran[1]['job_id']}.log").read_text()
    assert [m["step"] for m in read_metrics(rdir)] == list(range(1, 251))


TINY = {  # tests/rl/rl_helpers.py TINY_ARGS: the built-in trainer on a tiny model, ~16 steps/s on 2 ranks here
    "model": "tiny", "tiny_hidden_size": 32, "tiny_layers": 1, "tiny_heads": 2, "tiny_max_int": 100,
    "prompt_template": "tiny", "countdown_min_count": 2, "countdown_max_count": 2, "countdown_max_number": 9,
    "countdown_max_target": 81, "countdown_train_size": 64, "countdown_test_size": 8,
    "sft_steps": 2, "sft_lr": 3e-3, "lr": 1e-3, "beta": 0.05, "batch_size": 4, "group_size": 4, "ppo_epochs": 2,
    "mini_batches": 2, "max_response_length": 6, "eval_size": 8, "eval_batch_size": 8, "keep_last": 3,
    "threads": 1, "seed": 3,
}


def test_builtin_trainer_on_two_ranks_through_hpcrl_submit_stops_by_usr1_and_completes(ranks_local, tmp_path):
    pytest.importorskip("transformers", reason="the built-in trainer")
    spec = tmp_path / "b2.json"
    spec.write_text(json.dumps({"trainer": "builtin", "args": {**TINY, "total_steps": 198, "save_every": 0}}))
    hpcrl("submit", str(spec), "--site", ranks_local, "--hours", "0.2", "--name", "b2",
          "--set", "resources.ranks_per_node=2")
    rdir = run_dir("b2")
    wait_until(lambda: len(_ranks_of_trainer(rdir)) == 2, 240, "two trainer ranks")
    wait_until(lambda: max((m.get("step", 0) for m in read_metrics(rdir)), default=0) >= 50, 240, "step 50")
    # the walltime's warning now (not in a minute, whatever this machine's speed): USR1 to the batch
    # shell only, as the local backend (and Slurm's --signal=B:USR1) sends it
    os.kill(json.loads((rdir / ".queue" / "1.json").read_text())["pgid"], signal.SIGUSR1)
    state = wait_for_run("b2", timeout=180)
    assert state["state"] == "COMPLETED", state
    first, last = started(state)[0], started(state)[-1]
    assert (first["state"], first["rc"]) == ("CONTINUE", 85) and 50 <= first["end_step"] < 200, first
    assert last["end_step"] == 200
    log1 = (rdir / "logs" / f"job-{first['job_id']}.log").read_text()
    assert "stop file for the ranks" in log1 and "(SIGUSR1)" in log1 and "exit 85" in log1, log1
    assert "--nproc-per-node 2 --standalone -m hpcrl.rl.train" in (rdir / "job.sh").read_text()
    train = sorted({m["step"] for m in read_metrics(rdir) if m.get("phase") in ("sft", "train")})
    assert train == list(range(1, 201))


def _ranks_of_trainer(rdir: Path) -> list[int]:
    config = str(rdir / "trainer.json").encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if b"hpcrl.rl.train" in argv and config in argv and b"torch.distributed.run" not in argv:
            found.append(int(proc.name))
    return found
