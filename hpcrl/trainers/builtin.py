"""Launcher side of the built-in trainer (hpcrl/rl). No torch: only argv, files and pins.

The trainer obeys the walltime protocol itself (SIGUSR1, SIGTERM, HPCRL_DEADLINE), so the
default checkpoint discovery of the base class (the protocol's LATEST pointer) applies.
"""

from __future__ import annotations

import json

from ..errors import SpecError, did_you_mean, one_of
from .base import Trainer, TrainerContext

# Mirrors hpcrl/rl/config.py DEFAULTS (this side may not import hpcrl.rl; a test keeps them equal).
# The comments there say what each key does.
DEFAULTS: dict = {
    "model": "tiny", "tiny_hidden_size": 128, "tiny_layers": 2, "tiny_heads": 4, "tiny_max_int": 1000,
    "data": "countdown", "train_files": None, "val_files": None,
    "countdown_train_size": 4096, "countdown_test_size": 256, "countdown_min_count": 3, "countdown_max_count": 4,
    "countdown_max_number": 99, "countdown_max_target": 999, "countdown_ops": "+-*/",
    "countdown_test_disjoint": True, "prompt_template": "base", "chat_template": "auto", "reward": "auto",
    "algorithm": "grpo", "loss_agg": None, "group_size": 8, "batch_size": 8, "ppo_epochs": 1, "mini_batches": 1,
    "micro_batch_size": 0,
    "clip_low": None, "clip_high": None, "beta": 0.0, "lr": 1e-6, "lr_warmup_steps": 0, "weight_decay": 0.0,
    "max_grad_norm": 1.0, "total_steps": 100, "sft_steps": 0, "sft_lr": 1e-3,
    "rollout": "hf", "temperature": 1.0, "top_p": 1.0, "max_prompt_length": 512, "max_response_length": 256,
    "vllm_gpu_memory_utilization": 0.4,
    "eval_before": True, "eval_after": True, "eval_every": 0, "eval_size": 256, "eval_batch_size": 64,
    "save_every": 50, "keep_last": 3, "async_save": True, "seed": 0, "dtype": "float32", "device": "auto",
    "threads": 0, "wandb_project": None,
}

CHOICES = {
    "algorithm": ("grpo", "dr_grpo", "gspo", "gspo_token"),
    "rollout": ("hf", "hf-generate", "vllm"),
    "data": ("countdown", "files"),
    "prompt_template": ("base", "tiny"),
    "dtype": ("float32", "bfloat16"),
    "device": ("auto", "cpu", "cuda"),
}

# The trainer's ML stack. torch is pinned: an unpinned torch may pull a multi-GB CUDA build.
BASE_REQUIREMENTS = ["torch==2.13.0", "transformers>=5.0,<5.20", "tokenizers>=0.21", "safetensors>=0.4", "xxhash>=3.0",
                     "numpy>=1.26", "pandas>=2.0", "pyarrow>=15"]
# With vLLM rollout the venv follows vLLM's own pins: the consistent GPU set that verl 0.9.1
# declares (notes/trainers.md) - a torch/transformers that vLLM was not built for fails at import.
VLLM_REQUIREMENTS = ["vllm==0.24.0", "torch==2.11.0", "transformers==5.9.0", "tokenizers>=0.21",
                     "safetensors>=0.4", "xxhash>=3.0", "numpy>=1.26", "pandas>=2.0", "pyarrow>=15"]


class BuiltinTrainer(Trainer):
    name = "builtin"
    defaults = DEFAULTS
    required = ()

    def validate_args(self, args: dict) -> dict:
        merged = super().validate_args(args)
        for key, allowed in CHOICES.items():
            if merged[key] not in allowed:
                raise SpecError(f"args.{key}: '{merged[key]}' is not allowed{did_you_mean(merged[key], allowed)}; "
                                f"use one of {one_of(allowed)}")
        if merged["data"] == "files" and not merged["train_files"]:
            raise SpecError("args.train_files: needed when args.data is 'files' (an absolute path to a parquet file)")
        return merged

    def requirements(self, args: dict, site: dict) -> list[str]:
        reqs = VLLM_REQUIREMENTS if (args or {}).get("rollout") == "vllm" else BASE_REQUIREMENTS
        if (args or {}).get("wandb_project"):
            reqs = reqs + ["wandb"]
        return list(reqs)

    def files(self, ctx: TrainerContext) -> dict[str, str]:
        return {"trainer.json": json.dumps(ctx.args, indent=1, sort_keys=True) + "\n"}

    def command(self, ctx: TrainerContext) -> list[str]:
        return [ctx.python, "-m", "hpcrl.rl.train", "--config", str(ctx.run_dir / "trainer.json")]

    def env(self, ctx: TrainerContext) -> dict[str, str]:
        # compute nodes usually have no internet: never let transformers try the hub
        return {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
