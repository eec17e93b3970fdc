"""Loading the policy, turning prompts into token ids, and response log-probabilities."""

from __future__ import annotations

import torch

from . import memory


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        cpu_only_or_fail()
        return torch.device("cpu")
    return torch.device(name)


def cpu_only_or_fail() -> None:
    """On a GPU site (the segment script exports HPCRL_GPUS_REQUIRED=1 where it checks the GPUs:
    a site that states its driver) a torch that cannot see the GPUs it was given stops the trainer
    with the reason: it never trains on the CPU without a word. Elsewhere the CPU is the device
    (a CPU site; a test cluster whose GPUs are stand-ins)."""
    import os

    from .. import gpucheck
    from .gpucheck import torch_build

    if os.environ.get("HPCRL_GPUS_REQUIRED") == "1":
        _, line = gpucheck.verdict(gpucheck.gpus_given(), *torch_build(), gpucheck.driver_cuda())
        raise NoGPU(line)


class NoGPU(RuntimeError):
    """The job was given GPUs that this torch cannot see (the message: gpucheck's one line)."""


def load_policy(model_dir, device: torch.device):
    """(model, tokenizer) from a local HF directory; never reaches the hub.

    The parameters are always float32 (the master weights, and AdamW's state with them): `dtype`
    is the compute dtype (see `autocast`, and fsdp.shard's mixed-precision policy). Weights held
    in bfloat16 would lose every update below half an ulp: at lr 1e-6 an Adam step (~1e-6) is
    below half the ulp of a weight of ~0.01 (~3e-5), so most updates would round away."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars would flood the segment log
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).to(device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    keep_declared_dtype(model, model_dir)
    return model, tokenizer


def keep_declared_dtype(model, model_dir) -> None:
    """The config keeps the model's own dtype (loading in float32 rewrote it): checkpoints'
    config.json then says what `hpcrl export` writes by default, and from_pretrained loads."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
        model.config.dtype = getattr(torch, name)


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def autocast(device: torch.device, dtype: str):
    """The forward passes' compute dtype over float32 master weights (ddp and one process; fsdp
    casts through its MixedPrecisionPolicy instead). float32: no autocast at all."""
    import contextlib

    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


def prompt_text(tokenizer, messages, chat_template="auto") -> str:
    """Chat-formatted when the tokenizer has a template (or forced); else the contents joined."""
    use = bool(getattr(tokenizer, "chat_template", None)) if chat_template == "auto" else bool(chat_template)
    if use:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


def encode_prompts(tokenizer, examples, chat_template="auto", max_prompt_length=512):
    """Token ids per example; prompts longer than max_prompt_length keep their tail (the question's end)."""
    out = []
    for ex in examples:
        ids = tokenizer(prompt_text(tokenizer, ex["messages"], chat_template), add_special_tokens=False).input_ids
        if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False):
            ids = [tokenizer.bos_token_id] + ids
        out.append(ids[-max_prompt_length:])
    return out


def left_pad(seqs, pad_id: int, device=None):
    """(ids, attention_mask) with sequences right-aligned, as generation expects."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=1.0,
                      group_size: int = 1, chunk_tokens: int = 0, shared: bool | None = None):
    """log pi(y_t | x, y_<t) for every response token (B x R), with the positions generate used.

    Position ids come from the attention mask: with left padding the default arange would shift
    every position and the log-probs would not match the sampler's. `response_mask` is accepted
    for symmetry but not needed: a position only attends to earlier ones, so the tokens after an
    eos (masked out of every loss) cannot change the log-probs before it.

    When rows come in runs of `group_size` copies of one prompt (a GRPO batch), the prompt is
    run once per group and its keys/values are shared by the group's responses: the prompt's
    share of the forward and backward work shrinks by group_size. Gradients flow through the
    shared keys/values, so the result equals the full forward up to float rounding.

    When the response tokens' logits would be large (more tokens than `chunk_tokens`; 0: as many
    as ~1 GiB of logits, `logit_chunk_tokens`), the model returns its final hidden states and the
    LM head and log-softmax run over one chunk of tokens at a time (`_chunked_logp`).

    `shared`: whether to take the shared-prompt path, decided by the caller (shares_prompts()
    agreed over the ranks, where each forward is a collective); None: decided here.
    """
    r = response_ids.shape[1]
    chunk = logit_chunk_tokens(model, chunk_tokens)
    run = _runner(model, hidden=response_ids.numel() > chunk)
    if shared is None:
        shared = shares_prompts(model, prompt_ids, prompt_mask, group_size)
    if shared:
        out = _shared_prompt(model, run, prompt_ids, prompt_mask, response_ids, group_size)
    else:
        # the last response token predicts nothing we score: it is not fed at all
        ids = torch.cat([prompt_ids, response_ids[:, :-1]], dim=1)
        attn = pos = None
        if not bool(prompt_mask.all()):  # no padding: plain causal attention, no mask to build
            attn = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], r - 1)], dim=1)
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
        # only the positions that predict response tokens go through the LM head (a 150k vocabulary
        # over the prompt too would be most of the activation memory)
        out = run(r, input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False)[:, -r:]
    if run.hidden:
        return _chunked_logp(model.get_output_embeddings(), out, response_ids, temperature, chunk)
    return _logp(out, response_ids, temperature)


# the response logits held at once when they are computed in chunks (several float32 copies of
# chunk tokens x vocabulary: hpcrl/rl/memory.py's LOGIT_BYTES)
LOGIT_CHUNK_BYTES = 2 ** 30


def logit_chunk_tokens(model, configured: int = 0) -> int:
    """Response tokens whose logits are computed at once: `configured`, or as many as fit in
    LOGIT_CHUNK_BYTES (353 at Qwen's 151,936 entries; 185,000 at the tiny model's 289: never
    chunked). A model whose decoder has no final `norm` to hook is never chunked."""
    try:
        hookable = getattr(model.get_decoder(), "norm", None) is not None and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        hookable = False
    if not hookable:
        return 2 ** 62
    return configured or max(1, LOGIT_CHUNK_BYTES // (model.config.vocab_size * memory.LOGIT_BYTES))


def _runner(model, hidden: bool):
    """run(keep, **model_kwargs) -> the last `keep` positions' logits (keep 0: all), or with
    `hidden` their final hidden states (the decoder's final norm's output, taken by a forward
    hook inside the model's own forward, where fsdp has the root's weights gathered; the LM head
    then runs on one position only)."""
    if not hidden:
        def run(keep, **kw):
            return model(**kw, logits_to_keep=keep).logits
    else:
        norm = model.get_decoder().norm

        def run(keep, **kw):
            got = []
            handle = norm.register_forward_hook(lambda mod, args, out: got.append(out))
            try:
                model(**kw, logits_to_keep=1)
            finally:
                handle.remove()
            return got[-1][:, -keep:] if keep else got[-1]
    run.hidden = hidden
    return run


def _logp(logits, response_ids, temperature):
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # log-softmax and pick fused, one kernel each way: gather minus logsumexp ran 2.3-3x slower
    # forward and backward, at the tiny vocabulary and at SmolLM2's (the same peak memory; BENCHMARKS)
    picked = torch.nn.functional.cross_entropy(logits.flatten(0, 1), response_ids.flatten(), reduction="none")
    return -picked.view(response_ids.shape)


def _head_logp(head, hidden, ids, temperature):
    return _logp(head(hidden).unsqueeze(0), ids.unsqueeze(0), temperature).squeeze(0)


def _chunked_logp(head, hidden, response_ids, temperature, chunk: int):
    """The LM head and log-softmax over `chunk` response tokens at a time. With gradients each
    chunk is recomputed in the backward (torch.utils.checkpoint), so only one chunk's vocabulary-
    wide logits exist at any time, forward or backward: at a 150k vocabulary they are most of a
    row's activations (2.9 of 3.6 GiB for 1024 tokens with gradient checkpointing). The price is
    the head's matmul once more in the backward."""
    from torch.utils.checkpoint import checkpoint

    flat, ids = hidden.reshape(-1, hidden.shape[-1]), response_ids.reshape(-1)
    parts = []
    for start in range(0, ids.shape[0], chunk):
        args = (head, flat[start:start + chunk], ids[start:start + chunk], temperature)
        parts.append(checkpoint(_head_logp, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else _head_logp(*args))
    return torch.cat(parts).view(response_ids.shape)


def recomputes_layers(model) -> bool:
    """Gradient checkpointing is on and active (training mode): transformers then drops any KV
    cache passed to a layer, so the group-shared prompt (keys/values carried in a cache) cannot
    be used and the full forward is taken."""
    return bool(getattr(model, "is_gradient_checkpointing", False)) and model.training


def shares_prompts(model, prompt_ids, prompt_mask, group_size: int) -> bool:
    """Whether response_logprobs runs each group's prompt once (two forwards) or the rows whole (one)."""
    return (group_size > 1 and not recomputes_layers(model) and rows_share_prompts(prompt_ids, prompt_mask, group_size)
            and _plain_kv_cache(model))


def rows_share_prompts(prompt_ids, prompt_mask, group_size: int) -> bool:
    """True when the rows are runs of group_size identical prompts (how rollouts lay them out)."""
    rows = prompt_ids.shape[0]
    if group_size <= 1 or rows % group_size:
        return False
    ids = prompt_ids.view(rows // group_size, group_size, -1)
    mask = prompt_mask.view(rows // group_size, group_size, -1)
    return bool((ids == ids[:, :1]).all()) and bool((mask == mask[:, :1]).all())


def new_kv_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _plain_kv_cache(model) -> bool:
    """Prompt sharing needs a cache that keeps every key/value (no sliding window, no offloading)."""
    from transformers.cache_utils import DynamicLayer

    try:
        return all(type(layer) is DynamicLayer for layer in new_kv_cache(model).layers)
    except Exception:  # a model whose config the cache cannot read: take the plain path
        return False


def prefill_shared(model, prompt_ids, prompt_mask, run=None):
    """Run each distinct prompt once with a fresh KV cache.

    Returns (logits at the last prompt position [G x V] (with a hidden `run`: the final hidden
    state there), cache, last position ids [G x 1], padded) where `padded` says whether later
    calls need an attention mask (some prompt is left padded).
    """
    run = run or _runner(model, hidden=False)
    padded = not bool(prompt_mask.all())
    pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    cache = new_kv_cache(model)
    out = run(1, input_ids=prompt_ids, attention_mask=prompt_mask if padded else None, position_ids=pos,
              past_key_values=cache, use_cache=True)
    return out[:, -1], cache, pos[:, -1:], padded


def _shared_prompt(model, run, prompt_ids, prompt_mask, response_ids, n: int):
    first, cache, last_pos, padded = prefill_shared(model, prompt_ids[::n], prompt_mask[::n], run)
    first = first.unsqueeze(1).repeat_interleave(n, dim=0)  # predicts response token 0
    r = response_ids.shape[1]
    if r == 1:
        return first
    cache.batch_repeat_interleave(n)  # differentiable: the group's gradients sum into the prompt
    pos = last_pos.repeat_interleave(n, dim=0) + torch.arange(1, r, device=prompt_ids.device)
    attn = None
    if padded:
        attn = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], r - 1)], dim=1)
    out = run(0, input_ids=response_ids[:, :-1], attention_mask=attn, position_ids=pos, past_key_values=cache,
              use_cache=True)
    return torch.cat([first, out], dim=1)
