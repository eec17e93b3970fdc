"""#41 item 5: no segment is lost to a slow start. The built-in trainer's eval_before is kept batch
by batch, so an evaluation longer than a segment goes on in the next one (not again from its first
row, not logged twice), and the lifecycle counts those kept batches as progress: such a run
completes instead of failing with "no checkpoint progress in 2 segments".

The walltime is the local backend's own USR1 (what `hpcrl stop` and the signal lead send, here
through its `.usr1` file): each of the first two segments gets it once its evaluation has kept a
batch, so the stop lands by the order of events, not by how fast this machine is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from helpers import ROOT, hpcrl, protocol_env, read_metrics, run_dir, run_state, started, wait_for_run, wait_until

from hpcrl import protocol

# the tiny model (tests/rl/rl_helpers.TINY_ARGS' shape) with an evaluation of 12 batches of 16
# rows answered 96 tokens long (seconds, where a training step is a tenth of one): a stop sent
# after its first kept batch lands inside it
EVAL_ROWS = 192
ARGS = {"model": "tiny", "tiny_hidden_size": 32, "tiny_layers": 1, "tiny_heads": 2, "tiny_max_int": 100,
        "prompt_template": "tiny", "countdown_min_count": 2, "countdown_max_count": 2, "countdown_max_number": 19,
        "countdown_max_target": 81, "countdown_train_size": 64, "countdown_test_size": EVAL_ROWS, "sft_steps": 0,
        "total_steps": 3, "batch_size": 4, "group_size": 4, "max_response_length": 96, "eval_size": EVAL_ROWS,
        "eval_batch_size": 16, "eval_after": False, "save_every": 1000, "threads": 1, "seed": 3}
SETS = [a for k, v in ARGS.items() for a in ("--set", f"args.{k}={str(v).lower() if isinstance(v, bool) else v}")]


def _kept_rows(rdir) -> int:
    """Rows of eval_before kept so far by the trainer (every rank's file; all of them once done)."""
    done = rdir / "eval_progress" / "eval_before-0.json"
    if done.exists():
        return EVAL_ROWS
    rows = set()
    for path in (rdir / "eval_progress").glob("eval_before-0.rank*.json"):
        try:
            rows.update(i for b in json.loads(path.read_text())["batches"] for i in b["rows"])
        except (OSError, ValueError):
            pass  # being replaced: read again on the next poll
    return len(rows)


def _running(run_id: str, k: int):
    state = run_state(run_id)
    seg = next((s for s in started(state) if s.get("k") == k), None)
    return seg if seg is not None and seg["state"] == "RUNNING" else None


def test_an_eval_before_longer_than_a_segment_goes_on_in_the_next_and_the_run_completes(fast_local):
    hpcrl("submit", "--site", fast_local, "--trainer", "builtin", "--hours", "0.05", "--name", "slow", *SETS)
    rdir = run_dir("slow")
    for k in (1, 2):
        seg = wait_until(lambda: _running("slow", k), 300, f"segment {k} running")
        before = _kept_rows(rdir)
        # a bound for a hung run, not a time: the stop goes once this segment kept a batch
        wait_until(lambda: _kept_rows(rdir) > before or not _running("slow", k), 300, f"segment {k} keeping a batch")
        assert _running("slow", k) and before < _kept_rows(rdir) < EVAL_ROWS, (
            f"segment {k} kept no batch of eval_before before its stop (kept {_kept_rows(rdir)} of {EVAL_ROWS} rows)")
        (rdir / ".queue" / f"{seg['job_id']}.usr1").write_text("usr1\n")
        wait_until(lambda: not _running("slow", k), 300, f"segment {k} stopping")
    state = wait_for_run("slow", timeout=300)
    assert state["state"] == "COMPLETED", state["reason"]
    ran = started(state)
    for seg in ran[:2]:
        # stopped inside its evaluation: no checkpoint, and yet progress (kept rows) - not a crash loop
        assert seg["state"] == "CONTINUE" and seg["end_step"] is None, seg
        assert seg["end_work"] > (seg.get("start_work") or 0), seg
        log = (rdir / "logs" / f"job-{seg['job_id']}.log").read_text()
        assert "eval_before abandoned: stop requested (SIGUSR1);" in log, log[-2000:]
    assert ran[-1]["state"] == "COMPLETE" and ran[-1]["end_step"] == 3
    evals = [r for r in read_metrics(rdir) if r.get("phase") == "eval_before"]
    assert len(evals) == 1, "eval_before is logged once, however many segments it took"
    assert evals[0]["eval/n"] == EVAL_ROWS and evals[0]["segment"] >= 3
    # the last part of the evaluation did not start over: the segment that finished it decoded
    # fewer rows than the split holds (its log says how many were kept before it)
    last_eval = next(s for s in ran if s["k"] == evals[0]["segment"])
    log = (rdir / "logs" / f"job-{last_eval['job_id']}.log").read_text()
    assert "rows kept by earlier segments" in log, log[-2000:]
    assert [r["step"] for r in read_metrics(rdir) if r.get("phase") == "train"] == [1, 2, 3]


def test_a_stop_before_anything_was_kept_says_how_long_start_up_and_eval_took_and_what_to_change(tmp_path):
    """The trainer's own reason for a segment that kept nothing (its deadline already passed when
    the evaluation began): the numbers and the two fixes, in trainer_error.txt for the launcher (a
    crash loop of such segments shows it: tests/test_lifecycle.py)."""
    rdir = tmp_path / "run"
    rdir.mkdir()
    (rdir / "trainer.json").write_text(json.dumps(ARGS))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HPCRL_")},
           **protocol_env(rdir, 1, deadline=time.time()), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    # a bound for a hung trainer, not a time
    proc = subprocess.run([sys.executable, "-m", "hpcrl.rl.train", "--config", str(rdir / "trainer.json")],
                          env=env, cwd=rdir, capture_output=True, text=True, timeout=600)
    assert proc.returncode == protocol.EXIT_CONTINUE, proc.stderr[-3000:]
    said = (rdir / protocol.ERROR_FILE).read_text().strip()
    assert said.startswith("stopped (deadline) before the first training step: the start-up took "), said
    assert said.endswith(f"(0 of {EVAL_ROWS} eval rows kept so far); raise --hours, or set args.eval_before=false "
                         "(or a smaller args.eval_size)"), said
    assert not list(rdir.glob("checkpoints/step-*")) and protocol.read_progress(rdir) is None
