"""Rows per forward/backward when the spec leaves `micro_batch_size` at 0, on a GPU.

Why: a whole mini-batch in one pass is what a CPU run wants (its models are small and a pass is
never memory-bound), but on a GPU the response logits alone grow as rows x response tokens x
vocabulary: gpu-check's 0.5B model with Qwen's 151,936-token vocabulary, 128 rows of 256 tokens,
ran out of an H200's 140 GiB in its first backward (113.8 GiB held, 18.6 more asked;
BENCHMARKS.md). So on a GPU the default is the most rows whose activations, estimated from the
model's shape, fit in half the memory left after the model's own state, split into even passes.

The estimate is deliberately plain arithmetic (no trial forward): it has to be right before the
first step, on every rank alike, and the same in every segment (a different split would change
the summation order, so a resumed run would no longer equal an uninterrupted one).
"""

from __future__ import annotations

import math

from .. import envs

# bytes per response position per vocabulary entry at the loss: the compute-dtype logits, their
# float32 copy, the temperature-scaled copy, the log-softmax kept for the backward, and the
# backward's two vocabulary-wide gradients. Pessimistic in float32 on a CPU (~9 measured); the
# H200's out-of-memory run needs at least 12.6 to be explained (BENCHMARKS.md): erring low would
# send a GPU run out of memory.
LOGIT_BYTES = 20


def layer_bytes_per_token(config, dtype_bytes: int) -> int:
    """What one token leaves for the backward in one decoder layer: the projections' inputs and
    outputs in the compute dtype (q, k, v, attention output, o's input: ~10 x hidden with the
    norms' outputs; SwiGLU's gate, up, activation and product: 4 x intermediate) and the float32
    residual stream and norm inputs that autocast keeps (4 x hidden)."""
    h, i = config.hidden_size, config.intermediate_size
    return dtype_bytes * (10 * h + 4 * i) + 4 * 4 * h


def row_bytes(config, prompt_tokens: int, response_tokens: int, dtype: str, checkpointing: bool = False,
              logits: bool = True) -> int:
    """One row's activations through the training forward and backward (with its response
    logits unless `logits` is false: see pass_bytes). With gradient checkpointing each layer
    keeps only its float32 input, and the backward rebuilds one layer's activations at a time
    (counted twice: the rebuilt layer and its gradients' buffers). Against measured peaks on a
    CPU in float32 at a small vocabulary (scripts/bench_act_mem.py): 0.95-1.02x without
    checkpointing, 0.85-1.18x with it (the allocator's noise is larger than its activations)."""
    dtype_bytes = 2 if dtype in ("bfloat16", "float16") else 4
    layer = layer_bytes_per_token(config, dtype_bytes)
    per_token = (config.num_hidden_layers * 4 * config.hidden_size + 2 * layer if checkpointing
                 else config.num_hidden_layers * layer)
    head = response_tokens * config.vocab_size * LOGIT_BYTES if logits else 0
    return (prompt_tokens + response_tokens) * per_token + head


def pass_bytes(config, rows: int, prompt_tokens: int, response_tokens: int, dtype: str,
               checkpointing: bool = False, chunk_tokens: int | None = None) -> int:
    """One forward/backward of `rows` rows: their activations, and the logits of at most
    `chunk_tokens` response tokens at once (policy.logit_chunk_tokens; None: all of them)."""
    tokens = rows * response_tokens if chunk_tokens is None else min(rows * response_tokens, chunk_tokens)
    return (rows * row_bytes(config, prompt_tokens, response_tokens, dtype, checkpointing, logits=False)
            + tokens * config.vocab_size * LOGIT_BYTES)


def state_bytes(n_params: int, shards: int, reference: bool) -> int:
    """A rank's model state: float32 weights, gradients and AdamW's two moments (16 bytes a
    parameter), the float32 reference when the KL term needs one; divided over fsdp's shards."""
    return n_params * (16 + (4 if reference else 0)) // shards


def max_rows(device_bytes: int, state: int, pass_of, limit: int) -> int:
    """The most rows, up to `limit`, whose pass (pass_of(rows) bytes) fits in half of what the
    state leaves (the other half: the reference's and the rollout's passes, the allocator's
    fragmentation); at least 1."""
    budget = (device_bytes - state) // 2
    rows = 1
    while rows < limit and pass_of(rows + 1) <= budget:
        rows += 1
    return rows


def even_split(rows: int, most: int) -> int:
    """Rows per pass for `rows` in the fewest passes of at most `most`, as even as they go
    (100 rows at most 60: two passes of 50, not 60 and 40)."""
    if rows <= most:
        return max(1, rows)
    return math.ceil(rows / math.ceil(rows / most))


def describe(rows_per_pass: int, per_pass: int, device_bytes: int, state: int) -> str:
    gib = 2 ** 30
    return (f"micro_batch_size 0 on a GPU: at most {rows_per_pass} rows per forward/backward "
            f"(~{per_pass / gib:.2f} GiB of activations a pass estimated from the model's shape; "
            f"{device_bytes / gib:.0f} GiB of the device for training, {state / gib:.1f} GiB model state; "
            "set micro_batch_size to choose)")


def device_bytes(device) -> int | None:
    """A CUDA device's total memory; None elsewhere (a CPU run takes the whole mini-batch)."""
    if device.type != "cuda":
        return None
    import torch

    return torch.cuda.get_device_properties(device).total_memory


# ---------------------------------------------------------------- the colocated vLLM engine

# what a vLLM engine holds beyond its weights, KV cache and start-up profile (profile_bytes):
# CUDA graphs' memory pools (vLLM logs 0.3-1 GiB at its default capture sizes), NCCL's and
# cuBLAS's buffers. Not measured here (no GPU): a round, pessimistic figure.
ENGINE_OVERHEAD = 2 * 2 ** 30
SAFETY = 0.92  # of the device: the allocator's fragmentation and the CUDA context

# The tokens one engine step schedules (vLLM's max_num_batched_tokens), bounded as TRL's colocate
# mode bounds it (trl/trainer/grpo_trainer.py, vllm_mode "colocate": max_num_batched_tokens=4096,
# "Latest vLLM v1 memory profiler is misled by the high default value (i.e., 32768) - thinking
# there's not enough memory"). Why: at start-up vLLM runs one forward of that many tokens and
# subtracts its activation peak from the engine's budget (gpu_memory_utilization) before it sizes
# the KV cache; at the default that peak alone can exceed a colocated engine's share, and the engine
# refuses to start. Chunked prefill (vLLM V1's default) splits a longer prefill over steps, so the
# bound costs throughput on long prompts only. profile_bytes counts that peak in the engine's share.
BATCHED_TOKENS = 4096


def _dtype_bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def kv_bytes_per_token(config, dtype: str) -> int:
    """Keys and values of one token in every layer (grouped-query attention: the KV heads)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * _dtype_bytes(dtype)


def engine_rows(cfg, world: int) -> int:
    """The sequences one rank's engine generates at once (vLLM's max_num_seqs, bounded to them as
    TRL's colocate mode does): the rank's training prompts' groups, or its evaluation batch, for
    every rank of its tensor-parallel group."""
    tp = cfg.get("vllm_tensor_parallel_size") or 1
    return max(-(-cfg["batch_size"] // world) * cfg["group_size"],
               min(cfg["eval_batch_size"], -(-cfg["eval_size"] // world))) * tp


def batched_tokens(seqs: int) -> int:
    """vLLM's max_num_batched_tokens for an engine of `seqs` sequences: BATCHED_TOKENS, and never
    below max_num_seqs (vLLM refuses a step budget smaller than its sequence count)."""
    return max(BATCHED_TOKENS, seqs)


def profile_bytes(config, seqs: int, dtype: str, tp: int = 1) -> int:
    """vLLM's start-up profile, which it takes out of the engine's budget before the KV cache: a
    forward of batched_tokens(seqs) tokens (per token the attention's q, k, v, the MLP's gate and
    up projections and their product, split by tensor parallelism, and the residual stream's few
    copies) and the sampler's float32 logits over the vocabulary for `seqs` rows (logits,
    probabilities and a sorted copy for top-p; every rank of a tensor-parallel group holds them)."""
    b = _dtype_bytes(dtype)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inter = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    per_token = (3 * inter + (heads + 2 * kv_heads) * head_dim) * b // tp + 4 * config.hidden_size * b
    return batched_tokens(seqs) * per_token + 3 * seqs * config.vocab_size * 4


def engine_bytes(config, n_params: int, dtype: str, rows: int, tokens: int, tp: int = 1,
                 seqs: int | None = None) -> int:
    """One rank's engine: its share of the weights in the compute dtype, the KV cache of `rows`
    sequences of `tokens` at once, its start-up profile for `seqs` sequences (default: `rows`) and
    the overhead (tensor parallelism splits weights and KV)."""
    return ((n_params * _dtype_bytes(dtype) + rows * tokens * kv_bytes_per_token(config, dtype)) // tp
            + profile_bytes(config, rows if seqs is None else seqs, dtype, tp) + ENGINE_OVERHEAD)


def sync_bytes(largest_tensor: int, dtype: str) -> int:
    """The weight sync's peak beyond the model state (gradients freed first): one tensor gathered
    whole in the compute dtype, and as much again for vLLM's layer-wise reload of it."""
    return 2 * largest_tensor * _dtype_bytes(dtype)


def engine_share(device: int, want: int, least: int, training: int) -> int:
    """The bytes an engine gets: all it wants (KV cache for the rank's whole rollout at once)
    within what training's peak (`training`: state and its largest pass or sync) leaves of the
    device; at least `least` (the weights and one whole sequence's KV cache), else ValueError."""
    room = int(device * SAFETY) - training
    if room < least:
        gib = 2 ** 30
        raise ValueError(f"rollout: vllm: training needs ~{training / gib:.1f} GiB of the {device / gib:.0f} GiB "
                         f"device and the engine at least {least / gib:.1f} GiB more: lower micro_batch_size, "
                         "shard with parallel: fsdp, or set vllm_tensor_parallel_size")
    return min(want, room)


def utilization(share: int, device: int) -> float:
    """vLLM's gpu_memory_utilization for an engine of `share` bytes (rounded up to 0.01)."""
    return min(1.0, math.ceil(100 * share / device) / 100)


def engine_plan(config, numels: list, cfg: dict, world: int, sharded: bool, reference: bool, device: int,
                chunk_tokens: int | None = None) -> tuple[int, float]:
    """(bytes, gpu_memory_utilization) of one rank's vLLM engine: what it wants (weights and the
    KV cache of the rank's whole rollout at once: its training prompts' groups, or an evaluation
    batch, times the tensor-parallel group) within what training's peak leaves of the device: the
    state with its largest pass (micro_batch_size; 0: the automatic rows take half of what the
    state leaves) or the weight sync, whichever is larger. The engine is counted as resident the
    whole time (no credit for sleep mode): an estimate that fits without it fits with it."""
    n_params, tp, dtype = sum(numels), cfg.get("vllm_tensor_parallel_size") or 1, cfg["dtype"]
    tokens = cfg["max_prompt_length"] + envs.sequence_tokens(cfg)  # a multi-turn episode's context too
    rows = engine_rows(cfg, world)
    want = engine_bytes(config, n_params, dtype, rows, tokens, tp)
    least = engine_bytes(config, n_params, dtype, 1, tokens, tp, seqs=rows)  # the same engine, one sequence's KV
    state = state_bytes(n_params, world if sharded else 1, reference)
    if cfg["micro_batch_size"]:
        train = state + pass_bytes(config, cfg["micro_batch_size"], cfg["max_prompt_length"],
                                   envs.sequence_tokens(cfg), dtype, cfg["gradient_checkpointing"], chunk_tokens)
    else:
        train = state + (int(device * SAFETY) - state) // 2
    peak = max(train, state + sync_bytes(max(numels), dtype))
    share = engine_share(device, want, least, peak)
    return share, utilization(share, device)
