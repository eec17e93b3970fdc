"""Issue 41's must-show, on a real run: a code-tiny run of the built-in trainer through `hpcrl submit`
whose first segment is killed past its checkpoint, so the second resumes and trains some steps
again. `hpcrl samples` shows its responses and reasons; each step's samples are kept once (the
replayed steps' from the segment that survived), the steps contiguous across the boundary; and
the run's own reward, given a stored response again, gives its stored reward and reason."""

from __future__ import annotations

import json
import os
import signal

import pytest

from helpers import ROOT, hpcrl, log_tails, read_metrics, run_dir, started, trainer_paused, wait_for_run, \
    wait_for_step

# code-tiny, shrunk: a 1-layer model, 16 RL steps of 2 prompts x 4 samples, no warm-up or evaluations
ARGS = ["tiny_hidden_size=32", "tiny_layers=1", "tiny_heads=2", "sft_steps=0", "total_steps=16", "batch_size=2",
        "group_size=4", "code_tiny_train_size=32", "eval_before=false", "eval_after=false", "eval_every=0",
        "save_every=4", "async_save=false", "threads=1"]


def _checkpoint_step(rdir) -> int:
    from hpcrl.checkpoints.store import checkpoint_step_of

    steps = [checkpoint_step_of(p) for p in (rdir / "checkpoints").glob("step-*")]
    return max([s for s in steps if s is not None], default=0)


@pytest.mark.slow
def test_code_tiny_samples_through_submit_kept_once_per_step_across_a_lost_segment_and_rescored(fast_local):
    from hpcrl import samplestore

    sets = [a for kv in ARGS for a in ("--set", f"args.{kv}")]
    hpcrl("submit", ROOT / "hpcrl" / "recipes" / "code-tiny.yaml", "--site", fast_local, "--hours", "0.05",
          "--name", "smp", *sets)
    rdir = run_dir("smp")
    wait_for_step(rdir, 5, timeout=300)
    while True:  # killed past its checkpoint, so that segment 2 trains some of its steps again
        with trainer_paused(rdir):
            trained, saved = max(m["step"] for m in read_metrics(rdir) if m.get("phase") == "train"), \
                _checkpoint_step(rdir)
            if trained > saved:
                rec = json.loads((rdir / ".queue" / "1.json").read_text())
                os.killpg(rec["pgid"], signal.SIGKILL)
                break
        wait_for_step(rdir, trained + 1, timeout=120)
    state = wait_for_run("smp", timeout=400)
    assert state["state"] == "COMPLETED", log_tails(rdir)
    first, second = started(state)[:2]
    resumed = second["start_step"] or 0  # the checkpoint segment 2 found (saved, unless a save was cut)
    lost = {m["step"] for m in read_metrics(rdir) if m.get("phase") == "train" and m["segment"] == 1}
    assert first["state"] == "LOST" and max(lost) >= trained > saved >= resumed, (first, second, trained, saved)

    # every step once, contiguous across the boundary; the replayed ones are segment 2's
    directory = rdir / samplestore.SAMPLES_DIR
    assert sorted(samplestore.list_steps(directory)) == list(range(1, 17))
    kept = {s: samplestore.read_step(directory, s) for s in range(1, 17)}
    for s, recs in kept.items():
        assert [r["sample"] for r in recs] == list(range(8)) and {r["step"] for r in recs} == {s}
        assert {r["segment"] for r in recs} == {1 if s <= resumed else 2}, s
    assert not list(directory.glob(".*")), "no temporary left behind"

    # what a person reads: responses and their reasons
    out = hpcrl("samples", "smp").stdout
    assert out.startswith("run smp, step 16 (kept: 1-16): 8 of 8 samples")
    assert out.count("assistant:") == 8 and out.count("\nreward ") == 8
    reasons = {r["reason"] for recs in kept.values() for r in recs}
    assert reasons and reasons <= {"ok", "wrong_answer", "syntax_error", "error", "not_data"}, reasons
    assert all(f"reason {r['reason']}" in out for r in kept[16])
    assert max(len(line) for line in out.splitlines()) <= 80
    assert f"  samples      {directory}\n" in hpcrl("status", "smp").stdout, "status names where they are"
    one = json.loads(hpcrl("samples", "smp", "--step", "1", "--format", "jsonl").stdout.splitlines()[0])
    assert one == kept[1][0]

    # the run's reward, on a stored response again, gives the stored reward and reason
    from hpcrl.rewards.mix import Reward
    from hpcrl.rl import config, data, prepare

    cfg = config.load(rdir / "trainer.json")
    train = data.load_examples(prepare.prepare_data(cfg, rdir)[0])
    again = [r for s in (1, resumed + 1, 16) for r in kept[s]]
    examples = [train[r["row"]] for r in again]
    assert [e["messages"] + [r["turns"][-1]] for e, r in zip(examples, again)] == [r["turns"] for r in again]
    reward = Reward(cfg)
    values, _ = reward(examples, [r["turns"][-1]["content"] for r in again])
    assert values == [r["reward"] for r in again]
    assert [d["reason"] for d in reward.details] == [r["reason"] for r in again]
    assert [d["terms"] for d in reward.details] == [r["terms"] for r in again]
