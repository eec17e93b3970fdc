"""The built-in trainer's arguments: every key with its default and why. Stdlib only.

hpcrl/trainers/builtin.py (launcher side) keeps an identical table - it may not import hpcrl.rl -
and a test asserts the two agree.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULTS: dict = {
    # --- model and data
    "model": "tiny",            # "tiny": build a small Llama into RUN_DIR/model; else a local HF model dir
    "tiny_hidden_size": 128,    # tiny model only: width, depth, heads, largest whole-number token
    "tiny_layers": 2,
    "tiny_heads": 4,
    "tiny_max_int": 1000,
    "data": "countdown",        # "countdown": generate into RUN_DIR/data; "files": use train_files/val_files
    "train_files": None,        # parquet (verl schema) when data: files
    "val_files": None,
    "countdown_train_size": 4096,
    "countdown_test_size": 256,
    "countdown_min_count": 3,   # how many numbers per problem (TinyZero: 3-4)
    "countdown_max_count": 4,
    "countdown_max_number": 99,
    "countdown_max_target": 999,
    "countdown_ops": "+-*/",
    "countdown_test_disjoint": True,  # test problems never seen in training (false: independent draws, as TinyZero)
    "prompt_template": "base",  # countdown prompt: "base" (TinyZero's text) or "tiny" (for the word-level model)
    "chat_template": "auto",    # auto: use the tokenizer's chat template when it has one; true / false to force
    "reward": "auto",           # auto (by data_source) | countdown | gsm8k | gsm8k_flexible | module:function | /file.py:function
    # --- algorithm
    "algorithm": "grpo",        # grpo | dr_grpo | gspo | gspo_token
    "loss_agg": None,           # None: the algorithm's own (grpo token-mean, gspo seq-mean-token-mean, dr_grpo sum-norm)
    "group_size": 8,            # completions per prompt (GRPO's G)
    "batch_size": 8,            # prompts per step, so batch_size * group_size completions
    "ppo_epochs": 1,            # optimisation passes over each rollout batch
    "mini_batches": 1,          # optimizer steps per pass
    "micro_batch_size": 0,      # rows per forward/backward (gradient accumulation); 0: a whole mini-batch
    "clip_low": None,           # None: 0.2 (grpo) or 3e-4 (gspo)
    "clip_high": None,          # None: 0.2 (grpo) or 4e-4 (gspo)
    "beta": 0.0,                # k3 KL penalty to the frozen reference (0: no reference model kept)
    "lr": 1e-6,
    "lr_warmup_steps": 0,       # linear warm-up of the learning rate, in RL steps
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "total_steps": 100,         # RL steps (not counting sft_steps)
    # --- optional supervised warm-up (format only) that runs before RL as part of the recipe
    "sft_steps": 0,
    "sft_lr": 1e-3,
    # --- rollout
    "rollout": "hf",            # hf (KV-cache sampling loop, prompts shared per group) | hf-generate | vllm
    "temperature": 1.0,
    "top_p": 1.0,
    "max_prompt_length": 512,
    "max_response_length": 256,
    "vllm_gpu_memory_utilization": 0.4,
    # --- evaluation
    "eval_before": True,        # evaluate on the val split before training (segment 1 only)
    "eval_after": True,
    "eval_every": 0,            # 0: only before/after
    "eval_size": 256,           # rows of the val split used
    "eval_batch_size": 64,
    # --- checkpoints and runtime
    "save_every": 50,           # steps between periodic checkpoints (a stop always saves)
    "keep_last": 3,
    "async_save": True,         # write periodic checkpoints in a background thread
    "seed": 0,
    "dtype": "float32",         # float32 | bfloat16
    "device": "auto",           # auto | cpu | cuda
    "threads": 0,               # torch CPU threads; 0: leave torch's default
    "wandb_project": None,      # log to wandb too when set and wandb is importable (offline without internet)
}

CHOICES = {
    "algorithm": ("grpo", "dr_grpo", "gspo", "gspo_token"),
    "loss_agg": (None, "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "rollout": ("hf", "hf-generate", "vllm"),
    "data": ("countdown", "files"),
    "prompt_template": ("base", "tiny"),
    "dtype": ("float32", "bfloat16"),
    "device": ("auto", "cpu", "cuda"),
}
ALGO_LOSS_AGG = {"grpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
                 "gspo": "seq-mean-token-mean", "gspo_token": "seq-mean-token-mean"}


class ConfigError(ValueError):
    """A bad trainer argument; the message names the key."""


def resolve(args: dict) -> dict:
    """Defaults merged with `args`; unknown keys and bad choices raise ConfigError."""
    unknown = sorted(set(args) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown trainer argument(s) {unknown}; allowed: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **args}
    for key, allowed in CHOICES.items():
        if cfg[key] not in allowed:
            raise ConfigError(f"args.{key}: {cfg[key]!r} is not one of {[a for a in allowed if a]}")
    if cfg["data"] == "files" and not cfg["train_files"]:
        raise ConfigError("args.train_files: needed when data is 'files'")
    for key in ("group_size", "batch_size", "ppo_epochs", "mini_batches", "max_response_length"):
        if int(cfg[key]) < 1:
            raise ConfigError(f"args.{key}: must be >= 1, got {cfg[key]}")
    if (cfg["batch_size"] * cfg["group_size"]) % cfg["mini_batches"]:
        raise ConfigError("args.mini_batches: must divide batch_size * group_size")
    cfg["loss_agg"] = cfg["loss_agg"] or ALGO_LOSS_AGG[cfg["algorithm"]]
    return cfg


def load(path) -> dict:
    """The trainer.json written by the launcher (or by hand), resolved."""
    try:
        args = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read trainer config {path}: {e}") from None
    if not isinstance(args, dict):
        raise ConfigError(f"{path}: expected a JSON object of trainer arguments")
    return resolve(args)
