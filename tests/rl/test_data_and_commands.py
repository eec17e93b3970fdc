"""Datasets, `hpcrl data` / `hpcrl model`, the tiny model, and the launcher-side adapter."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from hpcrl.errors import HpcrlError, SpecError
from hpcrl.rl import config, data
from hpcrl.rl.commands import cmd_data, cmd_model
from hpcrl.rewards.score import countdown_score
from hpcrl.trainers.builtin import BuiltinTrainer

from helpers import adapter_context

REPO = Path(__file__).resolve().parents[2]


def test_countdown_rows_are_solvable_and_held_out():
    train, test = data.countdown_rows(300, 40, seed=1, min_count=3, max_count=4, max_number=30, max_target=200)
    assert len(train) == 300 and len(test) == 40
    for row in train + test:
        gt = row["reward_model"]["ground_truth"]
        assert 3 <= len(gt["numbers"]) <= 4 and 1 <= gt["target"] <= 200
        # the generator's own equation scores full marks: every problem is solvable
        assert countdown_score(f"<answer>{row['extra_info']['solution']}</answer>", gt) == 1.0
    key = lambda r: (tuple(sorted(r["reward_model"]["ground_truth"]["numbers"])), r["reward_model"]["ground_truth"]["target"])
    assert not {key(r) for r in test} & {key(r) for r in train}
    assert len({key(r) for r in test}) == 40
    again, _ = data.countdown_rows(300, 40, seed=1, min_count=3, max_count=4, max_number=30, max_target=200)
    assert again == train  # deterministic in the seed


def test_countdown_space_too_small_is_an_error():
    with pytest.raises(ValueError, match="too small"):
        data.countdown_rows(10, 500, min_count=2, max_count=2, max_number=3, max_target=9)


def test_cmd_data_countdown_writes_verl_schema(tmp_path, capsys):
    assert cmd_data(["countdown", "--out", str(tmp_path), "--train", "50", "--test", "10", "--seed", "2"]) == 0
    df = pd.read_parquet(tmp_path / "train.parquet")
    assert len(df) == 50 and len(pd.read_parquet(tmp_path / "test.parquet")) == 10
    assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    row = df.iloc[0]
    assert row["data_source"] == "countdown" and row["ability"] == "math"
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].endswith("<think>")
    assert set(row["reward_model"]["ground_truth"]) == {"target", "numbers"}
    assert "wrote 50 rows" in capsys.readouterr().out


def test_cmd_data_gsm8k_converts_and_rejects_bad_files(tmp_path):
    src = tmp_path / "gsm8k_test.jsonl"
    src.write_text(json.dumps({"question": "What is 1000 + 234?", "answer": "1000+234=1234\n#### 1,234"}) + "\n")
    assert cmd_data(["gsm8k", "--from", str(src), "--out", str(tmp_path / "out")]) == 0
    df = pd.read_parquet(tmp_path / "out" / "test.parquet")  # split taken from the file name
    assert df.iloc[0]["reward_model"]["ground_truth"] == "1234"
    assert df.iloc[0]["data_source"] == "openai/gsm8k"
    assert df.iloc[0]["prompt"][0]["content"].endswith('output the final answer after "####".')
    with pytest.raises(HpcrlError, match="no such file"):
        cmd_data(["gsm8k", "--from", str(tmp_path / "absent.jsonl"), "--out", str(tmp_path)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no final answer"}\n')
    with pytest.raises(HpcrlError, match="####"):
        cmd_data(["gsm8k", "--from", str(bad), "--out", str(tmp_path)])
    bad.write_text("not json\n")
    with pytest.raises(HpcrlError, match="not a JSON line"):
        cmd_data(["gsm8k", "--from", str(bad), "--out", str(tmp_path)])


@pytest.mark.parametrize("argv, match", [
    (["countdown", "--out", "x", "--min-count", "5", "--max-count", "3"], "min-count"),
    (["countdown"], "required"),
    (["nosuchdataset"], "invalid choice"),
])
def test_cmd_data_bad_flags_are_one_line_errors(argv, match):
    with pytest.raises(HpcrlError, match=match) as e:
        cmd_data(argv)
    assert "\n" not in str(e.value)


def test_cmd_model_tiny_builds_a_loadable_model(tmp_path):
    with pytest.raises(HpcrlError, match="divisible"):
        cmd_model(["tiny", "--out", str(tmp_path / "m"), "--hidden-size", "30", "--heads", "4"])
    assert cmd_model(["tiny", "--out", str(tmp_path / "m"), "--hidden-size", "32", "--heads", "2",
                      "--layers", "1", "--max-int", "50"]) == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "m", local_files_only=True)
    text = "numbers 3 5 target 15 answer <answer> 3 * 5 </answer>"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text  # the reward parses decoded text: the round trip must be exact
    assert tok.convert_ids_to_tokens(ids)[-4:] == ["3", "*", "5", "</answer>"]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "m").config.model_type == "llama"


def test_adapter_validates_files_and_command(tmp_path):
    t = BuiltinTrainer()
    with pytest.raises(SpecError, match="did you mean 'group_size'"):
        t.validate_args({"groupsize": 4})
    with pytest.raises(SpecError, match="did you mean 'gspo'"):
        t.validate_args({"algorithm": "gspoo"})
    args = t.validate_args({"total_steps": 7})
    ctx = adapter_context(t, args, tmp_path, python="/venv/bin/python", run_id="r1")
    files = t.files(ctx)
    assert config.resolve(json.loads(files["trainer.json"]))["total_steps"] == 7
    assert t.command(ctx) == ["/venv/bin/python", "-m", "hpcrl.rl.train", "--config", str(tmp_path / "trainer.json")]
    assert "torch==2.13.0" in t.requirements(args, {})
    assert any(r.startswith("vllm==") for r in t.requirements({**args, "rollout": "vllm"}, {}))
    assert not any("TOKEN" in v or "KEY" in k for k, v in t.env(ctx).items() if "TOKENIZERS" not in k)


def test_adapter_imports_no_ml_stack():
    code = ("import sys, hpcrl.trainers.builtin, hpcrl.rewards.score, hpcrl.rewards.sandbox;"
            "bad = [m for m in ('torch', 'transformers', 'pandas', 'vllm') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_trainer_rejects_bad_config_with_one_line(tmp_path):
    cfg = tmp_path / "trainer.json"
    cfg.write_text(json.dumps({"algorithm": "ppo2"}))
    res = subprocess.run([sys.executable, "-m", "hpcrl.rl.train", "--config", str(cfg)], cwd=REPO,
                         capture_output=True, text=True, env={"HPCRL_RUN_DIR": str(tmp_path), "PATH": "/usr/bin"})
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "args.algorithm" in res.stderr


@pytest.mark.parametrize("name", ["countdown-tiny", "countdown-grpo", "gsm8k-grpo", "gsm8k-gspo", "code-tiny",
                                  "mbpp-code-grpo"])
def test_recipes_validate_against_both_schemas(name):
    import yaml

    spec = yaml.safe_load((REPO / "hpcrl" / "recipes" / f"{name}.yaml").read_text())
    assert spec["trainer"] == "builtin" and spec["name"] == name
    args = BuiltinTrainer().validate_args(spec["args"])
    assert config.resolve(args)["algorithm"] in ("grpo", "gspo")
    assert set(spec) <= {"name", "trainer", "args", "resources", "budget", "env", "requirements",
                         "scheduler_flags", "site"}


def test_prepare_expands_env_vars_in_paths(tmp_path, monkeypatch):
    from hpcrl.rl import prepare

    monkeypatch.setenv("MYSCRATCH", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert prepare.prepare_model({"model": "$MYSCRATCH/m"}, tmp_path) == tmp_path / "m"
    with pytest.raises(FileNotFoundError, match="huggingface-cli download"):
        prepare.prepare_model({"model": "$MYSCRATCH/absent"}, tmp_path)
