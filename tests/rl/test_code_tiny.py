"""code-tiny learns through the sandboxed code reward: chance after the format warm-up, well above
it after GRPO. Every reward of the run is computed by executing the completed function."""

import json

import pytest
import yaml

from rl_helpers import REPO, run_trainer, write_config


@pytest.mark.slow
def test_code_tiny_learns_through_the_sandbox(tmp_path):
    recipe = yaml.safe_load((REPO / "hpcrl" / "recipes" / "code-tiny.yaml").read_text())["args"]
    run = tmp_path / "run"
    # the recipe, shortened: fewer RL steps and evaluations, one thread each for torch
    write_config(run, **{**recipe, "total_steps": 250, "eval_every": 0, "save_every": 0, "threads": 1,
                         "code_tiny_train_size": 256, "ppo_epochs": 1, "mini_batches": 1, "keep_last": 2})
    rc, out, err = run_trainer(run, timeout=400)
    assert rc == 0, err[-2000:]
    assert "pass rate (accuracy) before RL -> after" in err + out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ev = {r["phase"]: r for r in rows if r.get("phase", "").startswith("eval")}
    before, after = ev["eval_sft"]["eval/accuracy"], ev["eval_after"]["eval/accuracy"]
    print(f"code-tiny accuracy (all tests pass) after warm-up {before:.2f} -> after GRPO {after:.2f}")
    assert before <= 0.4          # chance: greedy decoding lands on one of 12 expressions for 5 tasks
    assert after >= 0.6 and after >= before + 0.3
    train = [r for r in rows if r.get("phase") == "train"]
    assert all(r["reward/reason/ok"] + r.get("reward/reason/wrong_answer", 0) + r.get("reward/reason/syntax_error", 0)
               + r.get("reward/reason/error", 0) == pytest.approx(1.0, abs=1e-3) for r in train if "reward/reason/ok" in r)
