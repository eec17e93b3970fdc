"""The whole run lifecycle on the local backend: real processes, real signals, short walltimes."""

import json
import os
import signal
import time

from helpers import hpcrl, read_metrics, run_dir, run_state, started, trainer_paused, wait_for_run, wait_for_step

WALL = "0.003"  # 10.8 s per segment: USR1 at ~6.8 s (lead 4 s), deadline at ~9.3 s


def _submit(site, name, *extra):
    return hpcrl("submit", "--site", site, "--trainer", "smoke", "--hours", WALL, "--name", name, *extra)


def _assert_no_step_lost(state, rdir, total):
    steps = [m["step"] for m in read_metrics(rdir)]
    assert steps == list(range(1, total + 1)), "every step ran exactly once across segments"
    ran = started(state)
    for prev, nxt in zip(ran, ran[1:]):
        assert nxt["start_step"] == prev["end_step"], f"segment {nxt['k']} resumed where {prev['k']} stopped"


def test_smoke_run_goes_through_three_segments_and_loses_no_step(fast_local):
    _submit(fast_local, "three", "--set", "args.steps=100", "--set", "args.step_time_s=0.2",
            "--set", "args.save_every=1000")
    state = wait_for_run("three")
    rdir = run_dir("three")
    assert state["state"] == "COMPLETED"
    ran = started(state)
    assert len(ran) >= 3
    for seg in ran[:-1]:
        assert seg["state"] == "CONTINUE" and seg["rc"] == 85
        job = json.loads((rdir / ".queue" / f"{seg['job_id']}.json").read_text())
        assert (job["state"], job["exit_code"]) == ("COMPLETED", 0), "the scheduler records a job that did its work"
        # each segment ended by its own checkpoint before the walltime (no periodic save here)
        assert seg["end_step"] > seg["start_step"] if seg["start_step"] else seg["end_step"] > 0
        assert seg["ended"] - seg["started"] < 10.8
    assert ran[-1]["state"] == "COMPLETE"
    _assert_no_step_lost(state, rdir, 100)
    assert not [s for s in state["segments"] if s["state"] == "QUEUED"]
    logs = sorted((rdir / "logs").glob("job-*.log"))
    assert any("USR1" in p.read_text() for p in logs)


def test_hard_kill_without_signal_successor_resumes_from_periodic_checkpoint(fast_local):
    _submit(fast_local, "hard", "--hours", "0.01", "--set", "args.steps=40", "--set", "args.step_time_s=0.2",
            "--set", "args.save_every=5")
    rdir = run_dir("hard")
    wait_for_step(rdir, 13, timeout=30)  # a periodic checkpoint exists and a few more steps ran
    rec = json.loads((rdir / ".queue" / "1.json").read_text())
    os.killpg(rec["pgid"], signal.SIGKILL)  # like a node failure: no trap, no end hook
    state = wait_for_run("hard")
    assert state["state"] == "COMPLETED"
    first, second = started(state)[:2]
    assert first["state"] == "LOST"
    assert second["start_step"] in (10, 15) and second["start_step"] % 5 == 0
    steps = [m["step"] for m in read_metrics(rdir)]
    assert steps[-1] == 40 and sorted(set(steps)) == list(range(1, 41))


def test_kill9_figures_never_overstate_lost_work_replay_and_one_row_per_step(fast_local):
    """#29 item 3: segment 1 trains past its last save and is killed -9. Its lost steps count 0
    in goodput (it saved nothing: 0%), the successor's re-training reads "replaying N -> M" in
    status, and `hpcrl metrics` holds one row per step (the replayed records superseded)."""
    from hpcrl.status import text as status_text
    from hpcrl.runs import Run

    _submit(fast_local, "k9", "--hours", "0.01", "--set", "args.steps=30", "--set", "args.step_time_s=0.2",
            "--set", "args.save_every=100")
    rdir = run_dir("k9")
    killed_at = wait_for_step(rdir, 8, timeout=60)  # no checkpoint yet: everything it trained is lost
    rec = json.loads((rdir / ".queue" / "1.json").read_text())
    os.killpg(rec["pgid"], signal.SIGKILL)
    state = wait_for_run("k9")
    assert state["state"] == "COMPLETED"
    first, second = started(state)[:2]
    assert first["state"] == "LOST" and first["end_step"] is None and second["start_step"] is None
    lost_at = max(m["step"] for m in read_metrics(rdir) if m["segment"] == 1)
    assert lost_at >= killed_at
    text = hpcrl("status", "k9").stdout
    seg_line = next(ln for ln in text.splitlines() if ln.split()[:3] == ["1", first["job_id"], "LOST"])
    assert seg_line.split()[-1] == "0%", text
    assert f"lost past the last checkpoint: segment 1 {lost_at} steps" in text
    rows = [json.loads(ln) for ln in hpcrl("metrics", "k9", "--format", "jsonl").stdout.splitlines()]
    train = [r["step"] for r in rows if r["phase"] == "train"]
    assert train == list(range(1, 31)) and all(r["segment"] != 1 for r in rows), "one row per step, the survivors"
    # status while segment 2 re-trained: the run's own records and state, cut at its step 3
    run = Run.by_id("k9")
    records = [m for m in read_metrics(rdir) if m["segment"] == 1 or (m["segment"] == 2 and m["step"] <= 3)]
    (run.dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in records))
    then = {**state, "state": "RUNNING", "segments": [first, {**second, "state": "RUNNING", "ended": None}]}
    row = status_text.summary(run, then)
    assert row["replaying"] == (3, lost_at) and status_text.step_cell(row) == f"3 (replaying -> {lost_at})"
    assert f"steps: replaying 3 -> {lost_at}: this segment re-trains" in status_text.detail(run, then, row)
    from hpcrl.status import eta as status_eta

    assert status_eta.at_risk(records, then, None, time.time())["steps"] == 3  # no checkpoint yet: all 3 at risk


def test_crash_at_same_step_fails_after_two_segments_without_progress(fast_local):
    _submit(fast_local, "crash", "--set", "args.steps=50", "--set", "args.step_time_s=0.05",
            "--set", "args.crash_at_step=3")
    state = wait_for_run("crash")
    assert state["state"] == "FAILED"
    ran = started(state)
    assert len(ran) == 2 and all(s["state"] == "FAILED" and s["rc"] == 1 for s in ran)
    assert "no checkpoint progress" in state["reason"] and "simulated crash at step 3" in state["reason"]
    assert not [s for s in state["segments"] if s["state"] in ("QUEUED", "RUNNING")]
    time.sleep(1)
    queue = run_dir("crash") / ".queue"
    live = [json.loads(p.read_text())["state"] for p in queue.glob("*.json")]
    assert "PENDING" not in live and "RUNNING" not in live


def test_a_failure_repeated_before_the_first_step_ends_the_run_after_that_segment(fast_local, tmp_path):
    """#29: segment 1 trains, saves, then fails; segment 2 fails with the same error before its
    first step. Today's rule ran a third segment (the crash loop needs two without progress);
    a start-up failure that repeats its predecessor's error ends the run at once."""
    flag = tmp_path / "broken"
    _submit(fast_local, "rep", "--set", "args.steps=200", "--set", "args.step_time_s=0.2",
            "--set", "args.save_every=5", "--set", f"args.fail_if_exists={flag}")
    wait_for_step(run_dir("rep"), 6, timeout=120)
    flag.touch()
    state = wait_for_run("rep")
    assert state["state"] == "FAILED" and state["stop"]["kind"] == "repeated", state["reason"]
    assert state["reason"].startswith(f"segment 2 failed before its first step with the error segment 1 had: "
                                      f"smoke: error: {flag} exists")
    first, second = started(state)
    assert first["state"] == second["state"] == "FAILED" and first["end_step"] >= 5
    assert second["start_step"] == second["end_step"] == first["end_step"]
    assert not [s for s in state["segments"] if s["state"] in ("QUEUED", "RUNNING")]
    assert not [m for m in read_metrics(run_dir("rep")) if m["segment"] == 2], "segment 2 trained no step"


def test_cancel_then_resume_completes_from_checkpoint(fast_local):
    _submit(fast_local, "cr", "--hours", "0.01", "--set", "args.steps=30", "--set", "args.step_time_s=0.2")
    time.sleep(3)
    out = hpcrl("cancel", "cr")
    assert "cancelled" in out.stdout
    state = wait_for_run("cr")
    assert state["state"] == "CANCELLED"
    stopped_at = started(state)[-1]["end_step"]
    assert stopped_at and stopped_at < 30  # the SIGTERM made the trainer save where it was
    assert hpcrl("cancel", "cr", check=False).returncode == 2
    hpcrl("resume", "cr")
    state = wait_for_run("cr", states=("COMPLETED",))
    last = started(state)[-1]
    assert last["start_step"] == stopped_at and last["end_step"] == 30


# the built-in trainer on its tiny model (tests/rl/rl_helpers.TINY_ARGS, without periodic saves):
# the only checkpoint a stop can resume from is the one the stop itself makes
STOP_ARGS = ["model=tiny", "tiny_hidden_size=32", "tiny_layers=1", "tiny_heads=2", "tiny_max_int=100",
             "prompt_template=tiny", "countdown_min_count=2", "countdown_max_count=2", "countdown_max_number=9",
             "countdown_max_target=81", "countdown_train_size=64", "countdown_test_size=8", "sft_steps=0",
             "total_steps=30", "batch_size=4", "group_size=4", "max_response_length=6", "eval_size=8",
             "save_every=1000", "threads=1", "seed=3"]


def test_stop_saves_at_the_last_trained_step_runs_nothing_after_and_resume_continues(fast_local):
    """#29: `hpcrl stop` on a running built-in run: the trainer saves where it is (the walltime's
    USR1), no successor runs, the run is STOPPED, and resume continues from that very step."""
    sets = [a for kv in STOP_ARGS for a in ("--set", f"args.{kv}")]
    hpcrl("submit", "--site", fast_local, "--trainer", "builtin", "--hours", "0.05", "--name", "stp", *sets)
    rdir = run_dir("stp")
    wait_for_step(rdir, 3, timeout=240)
    with trainer_paused(rdir):  # the 30 tiny steps would otherwise race a slow `hpcrl stop` to the end
        out = hpcrl("stop", "stp").stdout
    assert out.startswith("stopping run stp: its segment saves a checkpoint and exits"), out
    state = wait_for_run("stp", timeout=120)
    assert state["state"] == "STOPPED" and state["stop"]["kind"] == "user_stop", state["reason"]
    (seg,) = started(state)
    trained = max(m["step"] for m in read_metrics(rdir) if m.get("phase") in (None, "train"))
    assert seg["state"] == "CONTINUE" and seg["end_step"] == trained < 30, (seg, trained)
    assert state["stop"]["step"] == trained
    assert [s["state"] for s in state["segments"][1:]] == ["CANCELLED"], "the queued successor never ran"
    assert json.loads(hpcrl("status", "stp", "--json").stdout)[0]["state"] == "STOPPED"
    from hpcrl.status import text as status_text
    from hpcrl.runs import Run

    (g,) = status_text.goodput_of(Run.by_id("stp"), state)
    # by the time it held (its start-up is most of it here), not by the 3 minutes it was not asked to use
    # (train_s and used_s are shown to 0.1 s: the tolerance is that rounding's, far below what 3 minutes would give)
    assert abs(g["goodput"] - g["train_s"] / g["used_s"]) <= 0.051 / g["used_s"] + 0.0005, g
    again = hpcrl("stop", "stp", check=False)
    assert again.returncode == 2 and "run 'stp' is already STOPPED; nothing to stop" in again.stderr
    hpcrl("resume", "stp")
    state = wait_for_run("stp", states=("COMPLETED",), timeout=300)
    first, second = started(state)
    assert second["start_step"] == trained and second["end_step"] == 30
    steps = [m["step"] for m in read_metrics(rdir) if m.get("phase") in (None, "train")]
    assert steps == list(range(1, 31)), "no step lost, none trained twice"


def test_second_submit_of_same_run_is_refused(fast_local):
    _submit(fast_local, "dup", "--set", "args.steps=5", "--set", "args.step_time_s=0.1")
    again = hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--name", "dup", check=False)
    assert again.returncode == 2 and "already exists" in again.stderr and "hpcrl resume dup" in again.stderr
    assert len(run_state("dup")["segments"]) <= 2  # nothing more was queued
