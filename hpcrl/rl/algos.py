"""Policy-gradient math for GRPO, Dr.GRPO, GSPO and GSPO-token on padded token tensors.

Shapes: B sequences (prompts x group) by T response tokens; `mask` is 1.0 on real response
tokens. Every function is pure so the unit tests can check it against hand computations.

The facts about each algorithm (its default clip and aggregation, which ratio it uses, whether
advantages are divided by the group's std) are in the registry hpcrl/schemas/builtin.py
ALGORITHMS; this module holds only the math those facts name (RATIOS, LOSS_AGGS).
"""

from __future__ import annotations

import torch

from ..schemas.builtin import ALGORITHMS, LOSS_AGGS, RATIOS


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean(group)) / (std(group) + eps); Dr.GRPO drops the std division.

    std is the unbiased estimate, as verl and TRL compute it.
    """
    grouped = rewards.view(-1, group_size).double()  # float32 means of 0.1s leave ~1e-9 residues
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
        centred = centred / (std + eps)
    # a group whose rewards are all equal carries no signal: exactly zero, not rounding noise / eps
    flat = grouped.max(dim=1, keepdim=True).values == grouped.min(dim=1, keepdim=True).values
    return torch.where(flat, torch.zeros_like(centred), centred).reshape(-1).to(rewards.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: int | None = None) -> torch.Tensor:
    """token-mean: over all tokens of the batch (verl's default); seq-mean-token-mean: per
    sequence then over sequences (the GRPO paper); seq-mean-token-sum-norm: token sums divided by
    a constant length (Dr.GRPO, no length bias)."""
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    if mode == "seq-mean-token-mean":
        return masked_mean(per_token, mask, dim=1).mean()
    if mode == "seq-mean-token-sum-norm":
        return ((per_token * mask).sum(dim=1) / float(norm_len or per_token.shape[1])).mean()
    raise ValueError(f"loss_agg must be one of {tuple(LOSS_AGGS)}, not {mode!r}")


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, algorithm: str) -> torch.Tensor:
    """Per-token log importance ratio as each algorithm defines it (B x T): its registry entry
    names one of RATIOS."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {tuple(ALGORITHMS)}, not {algorithm!r}")
    kind = ALGORITHMS[algorithm].ratio
    token = (logp - old_logp) * mask
    if kind == "token":
        return token
    seq = masked_mean(token, mask, dim=1).unsqueeze(1)  # log s_i = mean_t log(pi/pi_old)
    if kind == "sequence":
        return seq.expand_as(token)
    if kind == "sequence-token":
        # s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]: GSPO's value, per-token gradient path
        return seq.detach() + logp - logp.detach()
    raise ValueError(f"ratio must be one of {tuple(RATIOS)}, not {kind!r}")


def policy_loss(logp, old_logp, advantages, mask, algorithm="grpo", clip_low=None, clip_high=None,
                loss_agg="token-mean", ref_logp=None, beta=0.0, norm_len=None):
    """Clipped surrogate (+ beta * k3 KL to the reference). Returns (loss, stats dict of floats)."""
    default_low, default_high = ALGORITHMS[algorithm].clip if algorithm in ALGORITHMS else (0.2, 0.2)
    low = default_low if clip_low is None else clip_low
    high = default_high if clip_high is None else clip_high
    ratio = torch.exp(log_ratio(logp, old_logp, mask, algorithm))
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        if beta > 0:
            per_token = per_token + beta * kl
    loss = aggregate(per_token, mask, loss_agg, norm_len)
    with torch.no_grad():
        stats = {
            "pg_clipfrac": masked_mean((clipped < unclipped).float(), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "kl_ref": masked_mean(kl, mask).item() if kl is not None else None,
        }
    return loss, stats
