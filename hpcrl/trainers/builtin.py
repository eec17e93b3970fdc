"""Launcher side of the built-in trainer (hpcrl/rl). No torch: only argv, files and pins.

The trainer obeys the walltime protocol itself (SIGUSR1, SIGTERM, HPCRL_DEADLINE), so the
default checkpoint discovery of the base class (the protocol's LATEST pointer) applies. Its
arguments are the table in hpcrl/schemas/builtin.py, which the trainer checks trainer.json with
too.
"""

from __future__ import annotations

import json

from ..errors import SpecError
from ..schemas.builtin import SCHEMA
from .base import Trainer, TrainerContext

# The trainer's ML stack. torch is pinned: an unpinned torch may pull a multi-GB CUDA build.
BASE_REQUIREMENTS = ["torch==2.13.0", "transformers>=5.0,<5.20", "tokenizers>=0.21", "safetensors>=0.4", "xxhash>=3.0",
                     "numpy>=1.26", "pandas>=2.0", "pyarrow>=15"]
# With vLLM rollout the venv follows vLLM's own pins: the consistent GPU set that verl 0.9.1
# declares (notes/trainers.md) - a torch/transformers that vLLM was not built for fails at import.
VLLM_REQUIREMENTS = ["vllm==0.24.0", "torch==2.11.0", "transformers==5.9.0", "tokenizers>=0.21",
                     "safetensors>=0.4", "xxhash>=3.0", "numpy>=1.26", "pandas>=2.0", "pyarrow>=15"]


class BuiltinTrainer(Trainer):
    name = "builtin"
    schema = SCHEMA
    package, package_version = "torch", None
    ranks = "gpu"  # torch.distributed: one rank per GPU (gloo CPU ranks where there are none)

    def check_world(self, args: dict, world: int) -> None:
        # the ranks share a step's prompts with whole GRPO groups on one rank: a rank without a
        # prompt would have nothing to train on
        if world > 1 and int(args["batch_size"]) < world:
            raise SpecError(f"args.batch_size {args['batch_size']}: fewer prompts per step than the {world} ranks "
                            f"(resources.nodes x ranks_per_node); raise batch_size to at least {world} or use fewer ranks")

    def requirements(self, args: dict, site: dict) -> list[str]:
        reqs = VLLM_REQUIREMENTS if (args or {}).get("rollout") == "vllm" else BASE_REQUIREMENTS
        if (args or {}).get("wandb_project"):
            reqs = reqs + ["wandb"]
        return list(reqs)

    def files(self, ctx: TrainerContext) -> dict[str, str]:
        return {"trainer.json": json.dumps(ctx.args, indent=1, sort_keys=True) + "\n"}

    def total_steps(self, args: dict) -> int | None:
        # the loop counts the warm-up's steps in "step" too (RLTrainer.total)
        a = {**SCHEMA.defaults, **(args or {})}
        return int(a["sft_steps"]) + int(a["total_steps"])

    def command(self, ctx: TrainerContext) -> list[str]:
        return [ctx.python, *self.entry(ctx)]

    def entry(self, ctx: TrainerContext) -> list[str]:
        return ["-m", "hpcrl.rl.train", "--config", str(ctx.run_dir / "trainer.json")]

    def env(self, ctx: TrainerContext) -> dict[str, str]:
        # compute nodes usually have no internet: never let transformers try the hub
        return {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
