"""Helpers for running the real built-in trainer as a subprocess with the protocol's env vars
(waiting, metrics and checkpoint helpers are the shared ones in tests/helpers.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import protocol_env

REPO = Path(__file__).resolve().parents[2]
HOOKED = Path(__file__).resolve().parent / "hooked_train.py"

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
    env.update(protocol_env(run_dir, segment, deadline), PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start_trainer(run_dir: Path, segment: int = 1, deadline=None, step_delay_s: float = 0.0,
                  save_pause_s: float = 0.0, deadline_in_s: float | None = None, hooks: tuple = (),
                  **extra) -> subprocess.Popen:
    """`python -m hpcrl.rl.train` on run_dir's trainer.json; with a step delay, a save pause, a
    deadline counted from the end of the imports or other hooks (hooked_train.py's flags), the
    same trainer through hooked_train.py (test-only hooks patched in)."""
    config = ["--config", str(run_dir / "trainer.json")]
    if step_delay_s or save_pause_s or deadline_in_s is not None or hooks:
        later = [] if deadline_in_s is None else [f"--deadline-in-s={deadline_in_s}"]
        argv = [sys.executable, str(HOOKED), f"--step-delay-s={step_delay_s}", f"--save-pause-s={save_pause_s}",
                *later, *hooks, *config]
    else:
        argv = [sys.executable, "-m", "hpcrl.rl.train", *config]
    return subprocess.Popen(argv, env=trainer_env(run_dir, segment, deadline, **extra), cwd=str(run_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_trainer(run_dir: Path, segment: int = 1, timeout: float = 600, **extra):
    # a bound for a hung trainer, not a time: a one-line refusal took over 240 s once, its start-up
    # (torch's imports, the model) at ~4% of a core beside the full suite and the verl tiers
    proc = start_trainer(run_dir, segment, **extra)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


# Several ranks: the distributed tests' arguments. A length term gives every group's samples
# different rewards (the tiny model never solves countdown in a few steps, and all-zero rewards
# would leave the advantages, and so most of the comparison, at zero).
DIST_ARGS = {**TINY_ARGS, "reward": "countdown + 0.1*length", "length_norm_chars": 10}


def start_torchrun(run_dir: Path, nproc: int = 2, segment: int = 1, deadline=None, step_delay_s: float = 0.0,
                   save_pause_s: float = 0.0, eval_delay_s: float = 0.0, **extra) -> subprocess.Popen:
    """`torchrun --standalone --nproc-per-node N -m hpcrl.rl.train` with the stop and exit files the
    segment script sets under a multi-process launcher (RUN_DIR/stop, RUN_DIR/exit)."""
    config = ["--config", str(run_dir / "trainer.json")]
    hooks = [f"--step-delay-s={step_delay_s}", f"--save-pause-s={save_pause_s}", f"--eval-delay-s={eval_delay_s}"]
    script = [str(HOOKED), *hooks] if step_delay_s or save_pause_s or eval_delay_s else ["-m", "hpcrl.rl.train"]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *script, *config]
    env = trainer_env(run_dir, segment, deadline, HPCRL_STOP_FILE=run_dir / "stop", HPCRL_EXIT_FILE=run_dir / "exit",
                      **extra)
    (run_dir / "stop").unlink(missing_ok=True)
    (run_dir / "exit").unlink(missing_ok=True)
    return subprocess.Popen(argv, env=env, cwd=str(run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def exit_file_code(run_dir: Path):
    path = run_dir / "exit"
    return int(path.read_text()) if path.exists() else None


def checkpoint_model(path: Path, kind: str = "model") -> dict:
    """A checkpoint's model tensors (kind="ref": its KL reference's), from model.safetensors or
    (written in parts by fsdp ranks) from the files Hugging Face's index names."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / f"{kind}.safetensors").exists():
        return load_file(path / f"{kind}.safetensors")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(path / name.replace("model", kind, 1)))
    assert set(out) == set(index["weight_map"])
    return out



def as_two_ranks(fn) -> list:
    """fn(rank, gather) in two threads playing two ranks, where gather(obj) gives each both ranks'
    objects in rank order (a collective); each rank's result, or the exception it raised."""
    import threading

    seen, barrier, results = {}, threading.Barrier(2, timeout=30), [None, None]

    def gather(rank, obj):
        seen[rank] = obj
        barrier.wait()
        out = [seen[0], seen[1]]
        barrier.wait()  # nobody overwrites a slot before both have read it
        return out

    def run(rank):
        try:
            results[rank] = fn(rank, lambda obj: gather(rank, obj))
        except Exception as e:
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results

# code-tiny's learning, measured on sampled rollouts rather than on the 5 greedy eval answers
# (one task = 0.2 of accuracy there): the share of samples passing every test in the first RL steps
# (policy right after the format warm-up, about chance: 7 of 60 task-answer pairs pass) against the
# last ones. 64 samples a step: the windows hold 1600 and 3200 samples.
CODE_TINY_FIRST, CODE_TINY_LAST = 25, 50


def code_tiny_train_windows(rows: list) -> tuple:
    """(mean all_passed over the first CODE_TINY_FIRST RL steps, over the last CODE_TINY_LAST)."""
    train = [r["reward/all_passed"] for r in rows if r.get("phase") == "train"]
    first, last = train[:CODE_TINY_FIRST], train[-CODE_TINY_LAST:]
    return sum(first) / len(first), sum(last) / len(last)
