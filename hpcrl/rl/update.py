"""The policy update of one RL step: ppo_epochs passes of mini_batches optimizer steps over one
rollout batch, each accumulated over micro-batches and reduced over the ranks.

A mixin of RLTrainer. It reads only cfg, model, ref, optimizer, dist, device, auto_rows and the
`fsdp` flag, and takes the layout's differences from parallel.py, so it also runs on a bare
object with those attributes (tests/rl's gradient test builds one).
"""

from __future__ import annotations

import torch

from .. import envs
from . import algos, memory, parallel, policy
from .dist import generator


def _layout(t) -> parallel.Single:
    return parallel.of(t.dist, t.fsdp)


def _micro_loss(t, batch, sub, adv, ref_logp, single, all_tokens, global_rows):
    """(loss, its statistics, its weight in the mean over the mini-batch) of rows `sub` (t: the
    trainer, or any object with what the update reads)."""
    cfg = t.cfg
    mb = batch.select(sub)
    shared = _layout(t).same_path(policy.shares_prompts(t.model, mb.prompt_ids, mb.prompt_mask, cfg.group_size))
    with t._compute():
        logp = policy.response_logprobs(t.model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                        mb.response_mask, cfg.temperature, cfg.group_size, cfg.logit_chunk_tokens,
                                        shared)
    # one update per batch: the policy *is* the sampler, so old = logp without a pass
    old = logp.detach() if single or mb.old_logp is None else mb.old_logp
    loss, got = algos.policy_loss(
        logp, old, adv[sub], mb.response_mask, cfg.algorithm, cfg.clip_low, cfg.clip_high, cfg.loss_agg,
        None if ref_logp is None else ref_logp[sub], cfg.beta, norm_len=envs.sequence_tokens(cfg))
    # each micro loss is a mean over its own rows: weight it into the mean over all of idx
    weight = mb.response_mask.sum() / all_tokens if cfg.loss_agg == "token-mean" else len(sub) / global_rows
    return loss, got, weight


class Update:
    def _compute(self):
        """The forward passes' dtype: autocast over the float32 masters (fsdp: its mp_policy casts)."""
        return _layout(self).compute(self.device, self.cfg.dtype)

    def _loss_scale(self) -> float:
        return _layout(self).loss_scale

    def _reduce_grads(self) -> None:
        _layout(self).reduce_grads(self.model.parameters())

    def _rows_per_pass(self, rows: int) -> int:
        if self.cfg.micro_batch_size:
            return self.cfg.micro_batch_size
        return memory.even_split(rows, self.auto_rows or max(1, rows))

    def _update(self, batch, adv, row0: int = 0) -> dict:
        """ppo_epochs passes of mini_batches optimizer steps over one rollout batch.

        The mini-batches are cut from the global batch (rows row0.. are this rank's), in an order
        drawn from the (seed, step, epoch) stream, so they are the same on any number of ranks."""
        cfg = self.cfg
        total = cfg.batch_size * cfg.group_size
        size = total // cfg.mini_batches
        single = cfg.ppo_epochs * cfg.mini_batches == 1
        ref_logp = None
        if self.ref is not None:
            with _layout(self).gathered(self.ref):  # as the policy's no-grad passes below
                ref_logp = self._logprobs_no_grad(self.ref, batch)
        mismatch = {} if single else self._old_logprobs(batch)
        losses, last = [], {}
        for epoch in range(cfg.ppo_epochs):
            order = (torch.randperm(total, generator=generator("cpu", cfg.seed, self.step, "epoch", epoch))
                     if cfg.mini_batches > 1 else torch.arange(total))
            for start in range(0, total, size):
                chunk = order[start:start + size]
                local = chunk[(chunk >= row0) & (chunk < row0 + adv.shape[0])] - row0
                loss, last = self._optimizer_step(batch, local, adv, ref_logp, single, global_rows=len(chunk))
                losses.append(loss)
        if self.dist.enabled:  # the last mini-batch's statistics, averaged over the ranks that had rows
            got = [d for d in self.dist.gather(last) if d]
            last = {k: (None if any(d[k] is None for d in got) else sum(d[k] for d in got) / len(got))
                    for k in got[0]}
        kl = last.pop("kl_ref")
        # 6 significant digits, not places: early in a run at a small lr the KL is ~1e-7, and 0.0
        # would read as no reference at all (`plot` said "beta 0" of a run with beta 0.04: #41)
        return {"loss": round(sum(losses) / len(losses), 6), "kl": float(f"{kl:.6g}") if kl is not None else 0.0,
                **{k: round(v, 6) for k, v in last.items()}, **mismatch}

    def _old_logprobs(self, batch) -> dict:
        """batch.old_logp: the ratio's denominator, the trainer's own forward, never the sampler's
        log-probs: another engine's kernels (vLLM, bf16) differ from the trainer's, and a ratio
        built on them measures that mismatch (GSPO's 3e-4 clip would clip on it alone). The
        sampler's are only compared, as rollout/logp_mismatch (returned)."""
        sampled = batch.old_logp
        with _layout(self).gathered(self.model):  # the ranks' row counts (passes) may differ
            batch.old_logp = self._logprobs_no_grad(self.model, batch)
        return self._logp_mismatch(sampled, batch)

    def _logp_mismatch(self, sampled, batch) -> dict:
        """The sampler's log-probs against the trainer's: mean |difference| per response token over
        the global batch (every rank calls it: a collective, even with no sampler log-probs)."""
        mask = batch.response_mask
        local = [0.0, 0.0] if sampled is None else [((sampled - batch.old_logp).abs() * mask).sum().item(),
                                                    mask.sum().item()]
        have = self.dist.max([float(sampled is not None)])[0]
        if not have:
            return {}
        total, count = self.dist.sum(local)
        return {"rollout/logp_mismatch": round(total / max(count, 1.0), 6)}

    def _optimizer_step(self, batch, idx, adv, ref_logp, single, global_rows=None) -> tuple[float, dict]:
        """One optimizer step on rows `idx` (this rank's part of a mini-batch of `global_rows`),
        gradients accumulated over micro-batches, then summed over ranks: every weight below is
        this rank's share of the global mini-batch, so the sum is the global mean."""
        micro = self._rows_per_pass(max(1, len(idx)))
        all_tokens = batch.response_mask[idx].sum()
        all_tokens = all_tokens.new_tensor(self.dist.sum([all_tokens.item()])[0])
        passes = _layout(self).passes(-(-len(idx) // micro))
        all_tokens = all_tokens.clamp(min=1.0)
        self.optimizer.zero_grad(set_to_none=True)
        total, stats = 0.0, {}
        for k in range(passes):
            sub = idx[k * micro:(k + 1) * micro]
            dummy = len(sub) == 0  # this rank has no rows left: one row of its batch, weighted 0
            loss, got, weight = _micro_loss(self, batch, torch.arange(1) if dummy else sub, adv, ref_logp, single,
                                            all_tokens, global_rows or len(idx))
            if dummy:
                weight = weight * 0.0
            else:
                stats = got
            (loss * (weight * self._loss_scale())).backward()
            total += loss.item() * float(weight)
        self._reduce_grads()
        total = self.dist.sum([total])[0]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        return total, stats

    @torch.no_grad()
    def _logprobs_no_grad(self, model, batch):
        cfg = self.cfg
        rows = batch.response_ids.shape[0]
        micro = self._rows_per_pass(rows)
        parts = []
        for start in range(0, rows, micro):
            mb = batch.select(torch.arange(start, min(start + micro, rows)))
            with self._compute():
                parts.append(policy.response_logprobs(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                                      mb.response_mask, cfg.temperature, cfg.group_size,
                                                      cfg.logit_chunk_tokens))
        return torch.cat(parts)
