"""Issue 42's multi-turn must-show on the real model: code repair on SmolLM2-135M-Instruct.

tests/data/c2py.jsonl's C functions (three asserts each: with `env: code-repair` the first is
visible, the other two held out) go through `hpcrl data convert`; the built-in trainer trains
SmolLM2 on them with the code-repair environment (a failing answer gets the failing visible test
back as the next user turn, up to two model turns; the reward is the held-out tests on the last
answer) through `hpcrl submit` on the local site, cut into two segments by the walltime signal.
Resumed exactly: an uninterrupted run of the same spec, submitted beside it, has the same
per-step records, the same kept episodes and the same final weights (its first version found the
stop's checkpoint carrying the data position of step 2, abandoned in its rollout: the resumed run
skipped a batch of rows; tests/rl/test_trainer_protocol.py now pins that). `hpcrl samples` then shows
whole episodes, the model's turns and the environment's feedback between them.
A tier (tests/conftest.py TIERS): the model costs minutes of CPU. Where the wheel cannot be
installed the run skips and says so (test_smollm2.py's condition).
"""

import hashlib
import json
import shutil
import sys
import time

import pytest

from helpers import hpcrl, log_tails, run_dir, started, wait_for_run
from test_smollm2 import needs_wheel
from test_smollm2_code import convert_rows, train_steps, walltime_signal_after
STEPS, PROMPTS, GROUP = 3, 2, 2  # 4 episodes a step: the least that still gives GRPO groups to compare

# Sized for a 2-core CPU: two runs side by side, a thread each, three steps (~2 minutes quiet).
# 32 new tokens a turn: SmolLM2's fenced answers to these functions take ~25 tokens bare, more
# with the prose it samples around them, so many first answers are cut or wrong and get a second
# turn (what this test is for). A turn's feedback quotes the failing test and up to 600 characters of the sandbox's message (~150 tokens): env_max_tokens leaves room for
# it and a second answer, so episodes end by their turns, not by the token budget. No
# evaluations; checkpoints only at the stop and the end (model + AdamW is ~1.6 GB a save).
# The reward (on the last answer, with the held-out tests) adds a small length term: in a few steps
# SmolLM2's answers at this length pass almost no held-out test (a first try: every reward 0, so
# every advantage and loss 0), and the exact resume is only worth checking with real updates.
SPEC = """\
name: repair-smollm2
trainer: builtin
args:
  model: smollm2
  data: files
  train_files: {data}/train.parquet
  val_files: {data}/test.parquet
  reward: code + 0.1*length
  length_norm_chars: 100
  env: code-repair
  env_max_turns: 2
  env_max_tokens: 320
  algorithm: grpo
  total_steps: {steps}
  batch_size: {prompts}
  group_size: {group}
  lr: 2.0e-5
  beta: 0.0
  temperature: 0.7
  max_prompt_length: 160
  max_response_length: 32
  eval_before: false
  eval_after: false
  save_every: 0
  keep_last: 1
  threads: 1
resources: {{nodes: 1, cpus_per_task: 1, mem_gb: 6}}
budget: {{hours: 2, total_hours: 4, max_segments: 4}}  # 2 h: the uninterrupted run is one segment
"""

# a step's record, as test_env_multi_turn.py's exact resume compares them (timings aside)
KEYS = ("step", "loss", "reward_mean", "reward_std", "kl", "response_len_mean", "env/turns_mean", "env/turns_max",
        "env/env_tokens_mean", "env/cut_by_tokens", "env/term/heldout")


def _final_weights(rdir) -> str:
    """A digest of the last checkpoint's model weights (every file of its model state)."""
    ckpts = sorted((rdir / "checkpoints").glob("step-*"))
    assert ckpts and ckpts[-1].name == f"step-{STEPS:08d}", ckpts
    files = sorted(p for p in ckpts[-1].rglob("model*.safetensors") if p.is_file())
    assert files, list(ckpts[-1].rglob("*"))
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(ckpts[-1]).as_posix().encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


@needs_wheel
@pytest.mark.slow
@pytest.mark.timeout(3600)  # two runs side by side; bounds for a loaded machine, not a speed
def test_code_repair_on_smollm2_through_submit_resumes_exactly_and_shows_its_turns(fast_local, tmp_path):
    from hpcrl import samplestore

    t0 = time.monotonic()
    data = tmp_path / "c2py"
    convert_rows(data)
    spec = tmp_path / "repair.yaml"
    spec.write_text(SPEC.format(data=data, steps=STEPS, prompts=PROMPTS, group=GROUP), encoding="utf-8")
    # the uninterrupted run beside the cut one: the same spec, one segment
    hpcrl("submit", spec, "--site", fast_local, "--name", "whole")
    hpcrl("submit", spec, "--site", fast_local, "--name", "cut")
    rdir, whole = run_dir("cut"), run_dir("whole")

    walltime_signal_after("cut", 1)
    state = wait_for_run("cut", timeout=3000)
    assert state["state"] == "COMPLETED", log_tails(rdir)
    segs = started(state)
    resumed = segs[1]["start_step"] or 0
    assert len(segs) == 2 and segs[0]["state"] == "CONTINUE" and 1 <= resumed < STEPS, segs
    assert [m["step"] for m in train_steps(rdir)] == list(range(1, STEPS + 1)), "every step once across segments"
    state_whole = wait_for_run("whole", timeout=2400)
    assert state_whole["state"] == "COMPLETED" and len(started(state_whole)) == 1, log_tails(whole)

    # episodes of more than one turn were trained on (the point of the environment), none cut by tokens
    train = train_steps(rdir)
    assert all(1.0 <= m["env/turns_mean"] <= 2 and m["env/turns_max"] <= 2 for m in train), train
    assert any(m["env/turns_mean"] > 1 for m in train), [m["env/turns_mean"] for m in train]

    # resumed exactly: step for step the uninterrupted run's records, episodes and final weights
    records = lambda d: [{k: m.get(k) for k in KEYS} for m in train_steps(d)]
    assert records(rdir) == records(whole)
    directory = rdir / samplestore.SAMPLES_DIR
    assert sorted(samplestore.list_steps(directory)) == list(range(1, STEPS + 1))
    kept = {s: samplestore.read_step(directory, s) for s in range(1, STEPS + 1)}
    theirs = {s: samplestore.read_step(whole / samplestore.SAMPLES_DIR, s) for s in range(1, STEPS + 1)}
    n = PROMPTS * GROUP
    for s, recs in kept.items():
        assert [r["sample"] for r in recs] == list(range(n)) and {r["step"] for r in recs} == {s}
        assert {r["segment"] for r in recs} == {1 if s <= resumed else 2}, (s, resumed)
        drop = lambda rs: [{k: v for k, v in r.items() if k != "segment"} for r in rs]
        assert drop(recs) == drop(theirs[s]), s
    assert _final_weights(rdir) == _final_weights(whole)

    # the episodes as kept: prompt, then the model's turn, the feedback, the model's next turn
    everything = [r for s in sorted(kept) for r in kept[s]]
    long = [r for r in everything if r["extras"]["turns"] == 2]
    assert long, "no episode of two turns was kept"
    for r in everything:
        assert r["turns"][-1]["role"] == "assistant" and set(r["terms"]) <= {"heldout"}
        after = r["turns"][[t["role"] for t in r["turns"]].index("assistant"):]  # after the prompt
        assert [t["role"] for t in after] == ["assistant", "user", "assistant"][:2 * r["extras"]["turns"] - 1], r
        if r["extras"]["turns"] == 2:
            assert "Fix the code" in after[1]["content"] and "Translate this C" not in after[1]["content"]
    assert not {r["reason"] for r in everything} & {"crash", "refused", "bad_tests", "no_tests"}

    # what a person reads: a step's episodes whole, the model's two turns and the feedback between
    out = hpcrl("samples", "cut", "--step", str(long[0]["step"])).stdout
    step_recs = kept[long[0]["step"]]
    assert out.count("\nreward ") == n
    roles = [ln[:-1] for ln in out.splitlines() if ln in ("system:", "user:", "assistant:")]
    assert roles == [t["role"] for r in step_recs for t in r["turns"]], roles  # every turn, in order
    for r in step_recs:
        if r["extras"]["turns"] == 2:  # the feedback's first line (a prompt turn's first lines are shown)
            first = r["turns"][-2]["content"].splitlines()[0]
            assert first.startswith(("Your code failed", "Your answer has no program")), first
            assert " ".join(first.split())[:40] in " ".join(out.split()), (first, out)
    assert "turns 2" in out and max(len(line) for line in out.splitlines()) <= 80
    jsonl = [json.loads(ln) for ln in hpcrl("samples", "cut", "--format", "jsonl").stdout.splitlines()]
    assert jsonl == everything  # the records whole, every turn of every episode

    turns = {k: sum(r["extras"]["turns"] == k for r in everything) for k in (1, 2)}
    reasons = sorted({r["reason"] for r in everything})
    # the checkpoints (~1.7 GB each) and the runs' copies of the model (~0.5 GB) are not kept past a
    # passing test: pytest keeps three sessions' tmp_path, and the suite runs often
    for d in (rdir, whole):
        shutil.rmtree(d / "checkpoints")
        shutil.rmtree(d / "model", ignore_errors=True)
    print(f"code repair on SmolLM2: resumed at step {resumed}, {len(everything)} episodes, turns {turns}, "
          f"reasons {reasons}, {time.monotonic() - t0:.0f} s", file=sys.stderr)
