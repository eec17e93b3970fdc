"""`status` and `logs` as a user sees them, on a real local run."""

import json
import subprocess
import sys
import time

from helpers import hpcrl, wait_for_run


def test_logs_follow_moves_across_segments_and_ends_with_the_run(fast_local):
    hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--hours", "0.003", "--name", "lg",
          "--set", "args.steps=60", "--set", "args.step_time_s=0.2")
    t0 = time.time()
    follow = subprocess.run([sys.executable, "-m", "hpcrl.cli", "logs", "lg", "-f"], capture_output=True, text=True,
                            timeout=120)
    assert follow.returncode == 0
    state = wait_for_run("lg", timeout=5)
    assert state["state"] == "COMPLETED" and time.time() - t0 < 120
    out = follow.stdout
    ran = [s for s in state["segments"] if s.get("started")]
    assert len(ran) >= 2
    for seg in ran:  # every segment's log, in order
        assert f"segment {seg['k']} job {seg['job_id']}" in out
    positions = [out.index(f"segment {s['k']} job {s['job_id']}") for s in ran]
    assert positions == sorted(positions)
    # the last trainer's exit ends the log; a walltime USR1 that reached the last segment's shell
    # just after its trainer exited is recorded after it as late (tests/test_late_signal.py)
    lines = [ln for ln in out.rstrip().splitlines() if not ln.startswith("hpcrl: USR1 arrived after the trainer had exited")]
    assert lines[-1] == "hpcrl: trainer exited with code 0", out[-2000:]
    assert "checkpoint and stop" not in out.rsplit("hpcrl: trainer exited with code 0", 1)[1]
    assert "\x1b[" not in out  # plain lines when not a terminal
    whole = hpcrl("logs", "lg").stdout  # #29: every segment, as the help says, each under its own line
    heads = [whole.index(f"==> segment {s['k']}/{len(ran)} (job {s['job_id']}, {s['state']}): ") for s in ran]
    assert heads == sorted(heads) and all(f"segment {s['k']} job {s['job_id']}" in whole for s in ran)
    first = hpcrl("logs", "lg", "--segment", "1").stdout
    assert f"job {ran[0]['job_id']}" in first and f"job {ran[1]['job_id']}" not in first
    bad = hpcrl("logs", "lg", "--segment", "99", check=False)
    assert bad.returncode == 2 and "--segment 99" in bad.stderr


def test_status_table_detail_json_and_cache_invalidation(fast_local):
    hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--hours", "0.01", "--name", "st",
          "--total-hours", "0.5", "--set", "args.steps=5", "--set", "args.step_time_s=0.05")
    wait_for_run("st")
    table = hpcrl("status").stdout.splitlines()
    assert table[0].split()[:4] == ["RUN", "SITE", "STATE", "SEG"]
    row = table[1].split()
    assert row[:4] == ["st", fast_local, "COMPLETED", "1/1"] and row[5] == "5"  # finished: the segments it ran
    assert "/0.5h" in table[1] and "loss=0.2" in table[1]
    detail = hpcrl("status", "st").stdout
    for word in ("segments:", "paths:", "run dir", "job.sh", "checkpoints", "logs", "metrics.jsonl", "COMPLETE"):
        assert word in detail
    js = json.loads(hpcrl("status", "--json").stdout)[0]
    assert {k: js[k] for k in ("id", "state", "segments", "step", "checkpoint_step")} == \
        {"id": "st", "state": "COMPLETED", "segments": 1, "step": 5, "checkpoint_step": 5}
    # A finished run's row is cached; a state change (as resume makes) must show at once.
    from hpcrl.atomicio import atomic_write_json
    from hpcrl.runs import Run

    run = Run.by_id("st")
    state = run.state()
    state["state"], state["reason"] = "STOPPED", "test"
    time.sleep(0.01)
    atomic_write_json(run.dir / "state.json", state)
    assert json.loads(hpcrl("status", "--json").stdout)[0]["state"] == "STOPPED"
