"""The set-up decisions of the built-in trainer that follow from the model's shape and the device:
activation checkpointing, the vLLM engine's share of the device, the rows per forward/backward,
and the rollout engine itself."""

from __future__ import annotations

from .. import envs
from . import memory, metrics, policy
from .rollout import HFGenerateRollout, HFRollout


def checkpoint_activations(model) -> str:
    """Non-reentrant activation checkpointing (the variant FSDP2 and autocast support); what it covers."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # transformers recomputes only in training mode (from_pretrained leaves eval); the rollout
    # and the evaluation switch to eval for their own passes and back
    model.train()
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing for m in model.modules())
    return f"gradient checkpointing: {layers} decoder layers recompute their activations in the backward"


def plan_engine(cfg, model, device, dist, par, has_ref: bool, say) -> tuple[int, float | None]:
    """(bytes, gpu_memory_utilization) of this rank's vLLM engine on a GPU, derived from the
    model's shape unless the spec sets the share: its weights in the compute dtype and the KV
    cache of the rank's whole rollout at once, within what training's peak (the state with its
    largest pass, or the weight sync) leaves; (0, the spec's) elsewhere."""
    total = memory.device_bytes(device)
    if cfg.rollout != "vllm" or total is None:
        return 0, cfg.vllm_gpu_memory_utilization
    if cfg.vllm_gpu_memory_utilization:
        return int(total * cfg.vllm_gpu_memory_utilization), cfg.vllm_gpu_memory_utilization
    plan = memory.engine_plan(model.config, [p.numel() for p in model.parameters()], cfg, dist.world, par.sharded,
                              has_ref, total, policy.logit_chunk_tokens(model, cfg.logit_chunk_tokens))
    say(f"vLLM engine per rank: {plan[0] / 2 ** 30:.1f} GiB (gpu_memory_utilization {plan[1]:.2f}, "
        "from the memory estimate; set vllm_gpu_memory_utilization to choose)")
    return plan


def auto_rows(cfg, model, device, dist, par, has_ref: bool, train_ids, engine_bytes: int, say) -> int | None:
    """The most rows per forward/backward when micro_batch_size is 0: none on a CPU (the whole
    mini-batch), what the memory allows on a GPU (hpcrl/rl/memory.py). Decided from the shapes
    alone, so every rank and every segment splits alike."""
    total = memory.device_bytes(device)
    if cfg.micro_batch_size or total is None:
        return None
    prompt = max((len(p) for p in train_ids), default=1)
    chunk = policy.logit_chunk_tokens(model, cfg.logit_chunk_tokens)

    def pass_of(rows):
        return memory.pass_bytes(model.config, rows, prompt, envs.sequence_tokens(cfg), cfg.dtype,
                                 cfg.gradient_checkpointing, chunk)
    params = sum(p.numel() for p in model.parameters())  # the full count, sharded or not
    state = memory.state_bytes(params, par.state_ranks, has_ref)
    total -= engine_bytes  # a colocated vLLM holds its share of the device for the whole run
    # the rows a rank holds per optimizer step (whole groups per rank: some ranks may hold more
    # than the mean, so the search runs up to the whole batch and the message names the most)
    local = -(-cfg.batch_size // dist.world) * cfg.group_size // cfg.mini_batches
    most = memory.max_rows(total, state, pass_of, cfg.batch_size * cfg.group_size)
    rows = memory.even_split(max(1, local), most)
    say(memory.describe(rows, pass_of(rows), total, state))
    return most


def make_rollout(cfg, model, tok, model_dir, device, dist, gpu_memory_utilization):
    """The generation engine: vLLM (its own weights, synced after each update) or the HF engines
    that run the training model itself."""
    if cfg.rollout == "vllm":
        from .vllm_rollout import VllmRollout

        engine = VllmRollout(model_dir, tok, cfg, device, world=dist.world, rank=dist.rank,
                             local_rank=dist.local_rank, gpu_memory_utilization=gpu_memory_utilization)
        metrics.say(f"rank {dist.rank}: {engine.placement()}")  # every rank: where its own engine is
        return engine
    engine = HFGenerateRollout if cfg.rollout == "hf-generate" else HFRollout
    # no sampler log-probs: the old policy's are the trainer's own forward's (update.py)
    return engine(model, tok, cfg.temperature, cfg.top_p, cfg.max_response_length, record_logprobs=False)
