"""The one-turn environment is the trainer as it was: step for step the same losses, rewards and
reward figures, the same samples and the same checkpoints, byte for byte, as the RL step before
environments (tests/rl/legacy_step.py, kept verbatim as the reference), on a rule reward and on
the sandboxed code reward."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl import protocol

from helpers import read_metrics
from rl_helpers import REPO, run_trainer, trainer_env, write_config

LEGACY = Path(__file__).resolve().parent / "legacy_step.py"
# what differs between two runs of the same step by the clock alone
VOLATILE = ("time", "step_time_s", "tokens_per_s", "peak_rss_mb")

CASES = {
    # a length term makes every group's rewards differ, so the advantages (and the update) are not zero
    "countdown": {"reward": "countdown + 0.1*length", "length_norm_chars": 10},
    "code": {"model": "tiny", "tiny_max_int": 20, "tiny_vocab": "code", "data": "code-tiny",
             "code_tiny_train_size": 64, "code_tiny_test_size": 10, "reward": "code + 0.01*length",
             "chat_template": False, "prompt_template": "base", "max_response_length": 4, "eval_size": 10,
             "eval_batch_size": 10},
}


def _sandbox_env() -> dict:
    # the trainer's environment drops HPCRL_*: pass on the conftest's allowance of a plain sandbox
    return {"HPCRL_SANDBOX_PLAIN": "1"} if os.environ.get("HPCRL_SANDBOX_PLAIN") == "1" else {}


def _legacy(run_dir: Path):
    argv = [sys.executable, str(LEGACY), "--config", str(run_dir / "trainer.json")]
    proc = subprocess.run(argv, env=trainer_env(run_dir, **_sandbox_env()), cwd=str(run_dir), capture_output=True,
                          text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def _figures(run_dir: Path) -> dict:
    steps = [{k: v for k, v in r.items() if k not in VOLATILE and not k.startswith("timing_s/")}
             for r in read_metrics(run_dir) if r.get("phase") in ("sft", "train", "eval_before", "eval_after")]
    digests = {f"{d.name}/{f.name}": hashlib.sha256(f.read_bytes()).hexdigest()
               for d in sorted((run_dir / "checkpoints").glob("step-*")) for f in sorted(d.glob("*.safetensors"))}
    samples = {f.name: f.read_bytes() for f in sorted((run_dir / "samples").glob("*.jsonl"))}
    return {"steps": steps, "digests": digests, "samples": samples}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_one_turn_environment_equals_the_step_before_environments(case, tmp_path):
    new, old = tmp_path / "env", tmp_path / "legacy"
    for run_dir in (new, old):
        write_config(run_dir, **CASES[case])
    rc, out, err = run_trainer(new, **_sandbox_env())
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    rc, out, err = _legacy(old)
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    a, b = _figures(new), _figures(old)
    train = [r for r in a["steps"] if r.get("phase") == "train"]
    assert len(train) == 6 and len(a["digests"]) == 12 and len(a["samples"]) == 6  # 6 RL steps, 4 saves
    assert any(r["reward_std"] > 0 for r in train) and any(r["loss"] != 0 for r in train)  # a real update
    for x, y in zip(a["steps"], b["steps"]):
        assert x == y, f"step {x.get('step')} ({x.get('phase')}) differs from the step before environments"
    assert len(a["steps"]) == len(b["steps"])
    assert a["digests"] == b["digests"]
    assert a["samples"] == b["samples"]
    assert not any(k.startswith("env/") for r in train for k in r)  # the one-turn records are as they were
    if case == "code":  # the code reward really ran programs in the sandbox (wrong answers are verdicts on runs)
        assert any(r.get("reward/reason/wrong_answer", 0) + r.get("reward/reason/ok", 0) > 0 for r in train)
