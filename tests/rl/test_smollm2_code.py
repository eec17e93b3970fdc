"""Issue 41's first must-show on the real model: C-to-Python translation on SmolLM2-135M-Instruct.

Twelve C functions with assert tests for their Python versions (tests/data/c2py.jsonl) go through
`hpcrl data convert` as a user's file would; the built-in trainer trains SmolLM2 on them with
`reward: code` through `hpcrl submit` on the local site, cut into two segments by the walltime
signal. `hpcrl samples` then shows the model's answers and why each scored as it did, and the
code reward, given a stored answer and its row's tests again, gives the stored reward and reason.
A tier (tests/conftest.py TIERS): the model costs minutes of CPU. Where the wheel cannot be
installed the run skips and says so (test_smollm2.py's condition).
"""

import json
import os
import shutil
import signal
import sys
import time

import pytest

from helpers import RUN_END_STATES, hpcrl, log_tails, read_metrics, run_dir, run_state, started, wait_for_run, \
    wait_until
from rl_helpers import REPO
from test_smollm2 import needs_wheel

DATA = REPO / "tests" / "data" / "c2py.jsonl"
STEPS, PROMPTS, GROUP = 4, 2, 2  # 4 answers a step: the least that still gives GRPO groups to compare

# Sized for a 2-core CPU: 48 new tokens hold most of SmolLM2's fenced answers to these functions
# (measured: "```python\ndef abs_val(x): ..." in ~25 tokens, with prose around it when sampled);
# no evaluations (hpcrl eval's own test covers them); checkpoints only at the stop and the end
# (model + AdamW is ~1.6 GB a save). Every other argument is the built-in default, so the code
# reward here is compute_score's own (format score 0, a 5 s limit a sample).
SPEC = """\
name: c2py-smollm2
trainer: builtin
args:
  model: smollm2
  data: files
  train_files: {data}/train.parquet
  val_files: {data}/test.parquet
  reward: code
  algorithm: grpo
  total_steps: {steps}
  batch_size: {prompts}
  group_size: {group}
  lr: 2.0e-5
  beta: 0.0
  temperature: 0.7
  max_prompt_length: 160
  max_response_length: 48
  eval_before: false
  eval_after: false
  save_every: 0
  keep_last: 1
  threads: 2
resources: {{nodes: 1, cpus_per_task: 2, mem_gb: 6}}
budget: {{hours: 1, total_hours: 2, max_segments: 4}}
"""


def _rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]


def test_the_rows_tests_pass_their_python_version_and_fail_a_wrong_one():
    """The data is right: each row's asserts pass its reference translation, under the reward the
    run uses, and refuse a function of the same name that returns a constant."""
    from hpcrl.rewards.score import compute_score

    rows = _rows()
    assert len(rows) == 12 and len({r["name"] for r in rows}) == 12
    for r in rows:
        truth = json.dumps({"tests": r["py_tests"]})
        assert f"int {r['name']}(" in r["c_code"] and all(f"{r['name']}(" in t for t in r["py_tests"])
        good = compute_score("code", f"```python\n{r['py_reference']}\n```", truth)
        bad = compute_score("code", f"```python\ndef {r['name']}(*a):\n    return 3\n```", truth)
        assert (good["reason"], good["score"]) == ("ok", 1.0), (r["name"], good)
        assert (bad["reason"], bad["score"]) == ("wrong_answer", 0.0), (r["name"], bad)


def train_steps(rdir) -> list[dict]:
    return [m for m in read_metrics(rdir) if m.get("phase") == "train"]


def convert_rows(out):
    """tests/data/c2py.jsonl through `hpcrl data convert`, as a user's file would go: 10 train rows,
    2 test rows, each with its C function in the prompt and its asserts as the tests."""
    conv = hpcrl("data", "convert", "--from", DATA, "--prompt-field", "c_code", "--tests-field", "py_tests",
                 "--template", "Translate this C function to Python:\\n```c\\n{prompt}\\n```",
                 "--system", "Reply with one ```python block.", "--out", out, "--test-rows", "2")
    assert "kept 12, dropped 0" in conv.stdout and "wrote 10 rows" in conv.stdout, conv.stdout


def walltime_signal_after(name: str, step: int) -> None:
    """The walltime signal (the local backend's USR1 to the batch shell) once `step` is logged, not
    at a clock time: the split does not depend on the machine's speed. Bounds for a loaded machine,
    not a speed (test_smollm2.py saw 400 s steps beside the full suite)."""
    rdir = run_dir(name)
    wait_until(lambda: len(train_steps(rdir)) >= step or run_state(name)["state"] in RUN_END_STATES,
               timeout=2400, what=f"step {step} of run {name}", poll=0.5)
    assert len(train_steps(rdir)) >= step, log_tails(rdir)
    rec = json.loads((rdir / ".queue" / "1.json").read_text())
    os.kill(rec["pgid"], signal.SIGUSR1)


def _response_lines(rec) -> list[str]:
    """The response's lines as `hpcrl samples` prints them whole (indented 2, none wrapped)."""
    text = rec["turns"][-1]["content"]
    return [f"  {ln.expandtabs(4)}".rstrip() for ln in text.splitlines() if 0 < len(ln.strip()) and len(ln) < 70]


@needs_wheel
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_c_to_python_on_smollm2_through_submit_samples_shown_and_rescored(fast_local, tmp_path):
    from hpcrl import samplestore
    from hpcrl.rewards.score import compute_score

    t0 = time.monotonic()
    data = tmp_path / "c2py"
    convert_rows(data)
    spec = tmp_path / "c2py.yaml"
    spec.write_text(SPEC.format(data=data, steps=STEPS, prompts=PROMPTS, group=GROUP), encoding="utf-8")
    hpcrl("submit", spec, "--site", fast_local, "--name", "c2py")
    rdir = run_dir("c2py")

    walltime_signal_after("c2py", 2)
    state = wait_for_run("c2py", timeout=2400)
    assert state["state"] == "COMPLETED", log_tails(rdir)
    segs = started(state)
    resumed = segs[1]["start_step"] or 0
    assert len(segs) >= 2 and segs[0]["state"] == "CONTINUE" and 2 <= resumed < STEPS, segs
    assert [m["step"] for m in train_steps(rdir)] == list(range(1, STEPS + 1)), "every step once across segments"

    # every step's samples kept, across the resume: each step's from the segment that trained it
    directory = rdir / samplestore.SAMPLES_DIR
    assert sorted(samplestore.list_steps(directory)) == list(range(1, STEPS + 1))
    kept = {s: samplestore.read_step(directory, s) for s in range(1, STEPS + 1)}
    n = PROMPTS * GROUP
    for s, recs in kept.items():
        assert [r["sample"] for r in recs] == list(range(n)) and {r["step"] for r in recs} == {s}
        assert {r["segment"] for r in recs} == {1 if s <= resumed else 2}, (s, resumed)
        assert all(r["turns"][-1]["role"] == "assistant" and r["data_source"] == "code" for r in recs)
    everything = [r for s in sorted(kept) for r in kept[s]]
    reasons = sorted({r["reason"] for r in everything})
    # the model's verdicts (ok, wrong_answer, syntax_error, error, ...), none of the harness failing
    assert reasons and all(isinstance(x, str) for x in reasons), reasons
    assert not set(reasons) & {"crash", "refused", "bad_tests", "no_tests"}, reasons

    # what a person reads: the newest step's answers, each with its reward and reason
    out = hpcrl("samples", "c2py").stdout
    assert out.startswith(f"run c2py, step {STEPS} (kept: 1-{STEPS}): {n} of {n} samples"), out[:200]
    assert out.count("assistant:") == n and out.count("\nreward ") == n
    assert "Translate this C function to Python:" in out
    for r in kept[STEPS]:
        assert f"reason {r['reason']}" in out and f"reward {r['reward']:.3f}" in out
        shown = _response_lines(r)
        assert not shown or any(ln in out.splitlines() for ln in shown), (shown, out)
    assert max(len(line) for line in out.splitlines()) <= 80
    # one reason's samples over every step, and the records themselves
    some = reasons[0]
    by_reason = hpcrl("samples", "c2py", "--reason", some, "--limit", "100").stdout
    assert f", reason {some};" in " ".join(by_reason.split()), by_reason[:300]  # the head line, maybe wrapped
    assert by_reason.count("\nreward ") == sum(r["reason"] == some for r in everything)
    jsonl = [json.loads(ln) for ln in hpcrl("samples", "c2py", "--format", "jsonl").stdout.splitlines()]
    assert jsonl == everything
    assert [json.loads(ln) for ln in hpcrl("samples", "c2py", "--step", "1", "--format", "jsonl").stdout
            .splitlines()] == kept[1]

    # re-scored: the stored answer and its row's tests, through verl's entry point (the defaults the
    # spec kept) and through the trainer's own reward built from the run's config, give the stored
    # reward, reason and terms exactly, for every sample of both segments
    from hpcrl.rewards.mix import Reward
    from hpcrl.rl import config, data as rl_data, prepare

    train = rl_data.load_examples(prepare.prepare_data(config.load(rdir / "trainer.json"), rdir)[0])
    for r in everything:
        assert r["ground_truth"] == train[r["row"]]["ground_truth"]
        assert r["turns"][:-1] == train[r["row"]]["messages"]
        again = compute_score("code", r["turns"][-1]["content"], r["ground_truth"])
        assert (again["score"], again["reason"]) == (r["reward"], r["reason"]), (r, again)
        assert {k: v for k, v in again.items() if k not in ("score", "reason")} == r["extras"]
    reward = Reward(config.load(rdir / "trainer.json"))
    values, _ = reward([train[r["row"]] for r in everything], [r["turns"][-1]["content"] for r in everything])
    assert values == [r["reward"] for r in everything]
    assert [(d["reason"], d["terms"]) for d in reward.details] == [(r["reason"], r["terms"]) for r in everything]

    counts = {k: sum(r["reason"] == k for r in everything) for k in reasons}
    # the last checkpoint (model + AdamW, ~1.7 GB) and the run's copy of the model (~0.5 GB) are not
    # kept past a passing test: pytest keeps three sessions' tmp_path, and the suite runs often
    shutil.rmtree(rdir / "checkpoints")
    shutil.rmtree(rdir / "model")
    print(f"C-to-Python on SmolLM2: {len(segs)} segments (resumed at step {resumed}), {len(everything)} samples, "
          f"reasons {counts}, {time.monotonic() - t0:.0f} s", file=sys.stderr)
