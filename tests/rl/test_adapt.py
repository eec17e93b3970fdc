"""Bring your own data and reward: `data convert`, reward terms, a model-based reward run."""

import json
import subprocess
import sys

import pytest

from hpcrl.rewards import mix as reward_mix
from hpcrl.rl import commands, convert, data
from hpcrl.rl.config import resolve
from rl_helpers import REPO, run_trainer, write_config

USER_ROWS = [
    {"task": "Write f(a, b) returning the sum.", "checks": ["assert f(1, 2) == 3", "assert f(0, 0) == 0"], "id": 1},
    {"task": "Echo twice.", "checks": [{"input": "ab", "output": "abab"}], "id": 2},
    {"task": "", "checks": ["assert True"], "id": 3},                # empty prompt: dropped
    {"task": "No tests here.", "checks": [], "id": 4},              # no tests: dropped
    {"task": "Tests as text.", "checks": "assert f(1) == 1\nassert f(2) == 2", "id": 5},
]


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "hpcrl.rl.commands", *argv], capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_convert_user_jsonl_into_a_run_that_trains(tmp_path):
    src = tmp_path / "mine.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in USER_ROWS))
    p = _cli("data", "convert", "--from", str(src), "--prompt-field", "task", "--tests-field", "checks",
             "--system", "Answer with Python code.", "--template", "Task {id}: {prompt}", "--out", str(tmp_path / "d"))
    assert p.returncode == 0, p.stderr
    assert "kept 3, dropped 2" in p.stdout and "empty prompt field 'task'" in p.stdout and "no tests" in p.stdout
    rows = data.load_examples(tmp_path / "d" / "train.parquet")
    assert [r["data_source"] for r in rows] == ["code"] * 3
    assert rows[0]["messages"] == [{"role": "system", "content": "Answer with Python code."},
                                   {"role": "user", "content": "Task 1: Write f(a, b) returning the sum."}]
    assert json.loads(rows[1]["ground_truth"]) == {"tests": [{"input": "ab", "output": "abab"}]}
    assert json.loads(rows[2]["ground_truth"])["tests"] == ["assert f(1) == 1", "assert f(2) == 2"]
    run = tmp_path / "run"
    write_config(run, data="files", train_files=str(tmp_path / "d" / "train.parquet"), reward="code",
                 sft_steps=0, total_steps=2, ppo_epochs=1, mini_batches=1, batch_size=2, eval_size=3,
                 code_timeout_s=3.0)
    rc, out, err = run_trainer(run)
    assert rc == 0, err[-2000:]
    train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in train if r.get("phase") == "train"]
    assert len(steps) == 2 and all("reward/pass_rate" in r and "timing_s/reward" in r for r in steps)
    assert any(k.startswith("reward/reason/") for k in steps[0])


@pytest.mark.parametrize("argv, match", [
    (["--prompt-field", "nope"], "field 'nope' is in no row of the file; its fields: checks, id, task"),
    (["--prompt-field", "task", "--template", "x {oops"], "--template 'x {oops'"),
    (["--prompt-field", "task", "--template", "{}"], "is not a field name"),
    (["--prompt-field", "task", "--template", "{missing}"], "field 'missing' is in no row"),
])
def test_convert_bad_inputs_are_one_line_errors(tmp_path, argv, match):
    src = tmp_path / "mine.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in USER_ROWS))
    p = _cli("data", "convert", "--from", str(src), "--out", str(tmp_path / "o"), *argv)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("hpcrl: error: ")
    assert match in p.stderr, p.stderr


def test_convert_empty_missing_and_csv_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    for f, match in (("empty.jsonl", "the file has no rows"), ("absent.csv", "no such file")):
        p = _cli("data", "convert", "--from", str(tmp_path / f), "--prompt-field", "q", "--out", str(tmp_path / "o"))
        assert p.returncode == 2 and match in p.stderr and p.stderr.count("\n") == 1
    (tmp_path / "qa.csv").write_text("question,answer\nwhat is 2+2?,4\nwhat is 3+3?,6\n,7\n")
    assert commands.main(["data", "convert", "--from", str(tmp_path / "qa.csv"), "--prompt-field", "question",
                          "--answer-field", "answer", "--out", str(tmp_path / "o"), "--test-rows", "1"]) == 0
    train, test = (data.load_examples(tmp_path / "o" / f"{s}.parquet") for s in ("train", "test"))
    assert len(train) == 1 and len(test) == 1 and {train[0]["ground_truth"], test[0]["ground_truth"]} == {"4", "6"}


def test_reward_terms_weights_and_extra_metrics(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return {'score': float(solution_str == ground_truth), 'hit': solution_str == ground_truth,\n"
                 "            'reason': 'same' if solution_str == ground_truth else 'diff'}\n"
                 "def batch(data_sources, solution_strs, ground_truths, extra_infos):\n"
                 "    return [len(s) for s in solution_strs]\n")
    cfg = resolve({"reward": f"{f} + 0.5*{f}:batch + 2*length", "length_norm_chars": 10})
    ex = [{"data_source": "x", "ground_truth": "ab", "extra_info": {}, "messages": []}] * 2
    scores, metrics = reward_mix.Reward(cfg)(ex, ["ab", "abcd"])
    assert scores == pytest.approx([1 + 0.5 * 2 - 2 * 0.2, 0 + 0.5 * 4 - 2 * 0.4])
    assert metrics["reward/hit"] == 0.5 and metrics["reward/reason/same"] == 0.5
    assert metrics["reward/length"] == pytest.approx(-0.3)
    with pytest.raises(ValueError, match="reward"):
        resolve({"reward": "code +  + length"})
    with pytest.raises(ValueError, match="model: without a path"):
        resolve({"reward": "model: "})


def test_model_reward_run_with_a_tiny_local_reward_model(tmp_path):
    rm = tmp_path / "rm"
    assert commands.main(["model", "tiny", "--out", str(rm), "--hidden-size", "32", "--layers", "1", "--heads", "2",
                          "--max-int", "100", "--reward-head"]) == 0
    run = tmp_path / "run"
    write_config(run, reward=f"model:{rm} + 0.1*countdown", reward_model_normalize="batch", total_steps=2,
                 sft_steps=1, save_every=0)
    rc, out, err = run_trainer(run)
    assert rc == 0, err[-2000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in steps if r.get("phase") == "train"]
    assert len(train) == 2
    assert all("reward/model.rm" in r and "reward/countdown" in r for r in train)  # the model term named short
    assert any(r.get("phase") == "eval_after" for r in steps)


def test_convert_template_checks_fields_by_name():
    assert convert.template_fields("Q: {prompt} ({meta.level})") == ["prompt", "meta.level"]
    rows, dropped = convert.convert([{"q": "hi", "meta": {"level": 3}}, {"q": "x", "meta": {}}], "q",
                                    answer_field=None, template="{prompt} L{meta.level}")
    assert rows[0]["prompt"][0]["content"] == "hi L3" and dropped == {"no template field 'level'": 1}


def test_a_templates_backslash_n_is_a_newline_and_accuracy_beside_a_custom_reward_is_explained(tmp_path):
    """#29: docs/adapt.md's `--template "Translate:\\n{prompt}"` reaches the program as backslash
    + n (a shell's double quotes keep it): the prompt gets a newline, not a literal backslash-n.
    And a custom reward's evaluation line says what its "accuracy" counts."""
    src = tmp_path / "mine.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in USER_ROWS))
    p = _cli("data", "convert", "--from", str(src), "--prompt-field", "task", "--tests-field", "checks",
             "--template", "Translate to Python:\\n{prompt}", "--out", str(tmp_path / "d"))
    assert p.returncode == 0, p.stderr
    rows = data.load_examples(tmp_path / "d" / "train.parquet")
    assert rows[0]["messages"][-1]["content"] == "Translate to Python:\nWrite f(a, b) returning the sum."
    reward = tmp_path / "half.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    run = tmp_path / "run"
    write_config(run, reward=f"{reward}:score", sft_steps=0, total_steps=1, eval_size=4)
    rc, out, err = run_trainer(run)
    assert rc == 0, err[-2000:]
    line = next(ln for ln in out.splitlines() if "eval_before step 0" in ln)
    assert "accuracy=0.000 (the share of answers scoring >= 1.0: a custom reward's scale may never reach it)" in line
