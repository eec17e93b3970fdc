"""Helpers for running the real built-in trainer as a subprocess with the protocol's env vars."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Small enough for seconds per run on 2 CPU cores, and still every code path: warm-up steps,
# a reference model with a KL penalty, several epochs and mini-batches (old log-probs from the
# sampler), periodic background saves.
TINY_ARGS = {
    "model": "tiny", "tiny_hidden_size": 32, "tiny_layers": 1, "tiny_heads": 2, "tiny_max_int": 100,
    "prompt_template": "tiny", "countdown_min_count": 2, "countdown_max_count": 2, "countdown_max_number": 9,
    "countdown_max_target": 81, "countdown_train_size": 64, "countdown_test_size": 8,
    "sft_steps": 2, "sft_lr": 3e-3, "total_steps": 6, "lr": 1e-3, "beta": 0.05,
    "batch_size": 4, "group_size": 4, "ppo_epochs": 2, "mini_batches": 2, "max_response_length": 6,
    "eval_size": 8, "eval_batch_size": 8, "save_every": 2, "keep_last": 5, "threads": 1, "seed": 3,
}


def write_config(run_dir: Path, **overrides) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "trainer.json"
    path.write_text(json.dumps({**TINY_ARGS, **overrides}))
    return path


def trainer_env(run_dir: Path, segment: int = 1, deadline: float | None = None, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCRL_")}
    env.update(HPCRL_RUN_DIR=str(run_dir), HPCRL_CKPT_DIR=str(run_dir / "checkpoints"),
               HPCRL_SEGMENT=str(segment), HPCRL_METRICS=str(run_dir / "metrics.jsonl"),
               PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if deadline is not None:
        env["HPCRL_DEADLINE"] = f"{deadline:.3f}"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start_trainer(run_dir: Path, segment: int = 1, deadline=None, **extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hpcrl.rl.train", "--config", str(run_dir / "trainer.json")],
        env=trainer_env(run_dir, segment, deadline, **extra), cwd=str(run_dir),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_trainer(run_dir: Path, segment: int = 1, timeout: float = 240, **extra):
    proc = start_trainer(run_dir, segment, **extra)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, timeout: float, what: str, proc=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"trainer exited ({proc.returncode}) before {what}:\n{out}\n{err[-3000:]}")
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def last_step(run_dir: Path) -> int:
    steps = [r["step"] for r in read_metrics(run_dir) if r.get("phase") in ("sft", "train")]
    return max(steps, default=0)
