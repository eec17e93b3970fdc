"""GRPO / Dr.GRPO / GSPO / GSPO-token math against values worked out by hand."""

import math

import pytest
import torch

from hpcrl.rl.algos import aggregate, group_advantages, k3_kl, policy_loss
from hpcrl.schemas.builtin import ALGORITHMS

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_group_advantages_by_hand():
    # mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 2.0]), 4)
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    # second group: mean 1, std sqrt(4 / 3)
    s = math.sqrt(4 / 3)
    assert adv[4:].tolist() == pytest.approx([-1 / s, 1 / s, -1 / s, 1 / s], abs=1e-5)


def test_dr_grpo_advantages_are_centred_only():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, scale_by_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_equal_rewards_give_exactly_zero_advantage():
    # 0.1 has no exact float: a naive (r - mean) / (std + eps) turns rounding residue into +-0.x
    adv = group_advantages(torch.full((8,), 0.1), 8)
    assert torch.count_nonzero(adv) == 0


def test_aggregations_by_hand():
    per_token = torch.tensor([[-1.0, -1.0, 5.0], [1.0, 7.0, 7.0]])  # masked entries must not count
    assert aggregate(per_token, MASK, "token-mean").item() == pytest.approx(-1 / 3)
    assert aggregate(per_token, MASK, "seq-mean-token-mean").item() == pytest.approx(0.0)
    assert aggregate(per_token, MASK, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx((-2 / 4 + 1 / 4) / 2)
    with pytest.raises(ValueError):
        aggregate(per_token, MASK, "nope")


def test_grpo_on_policy_loss_and_gradient():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.3, 0.3]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(logp, logp.detach(), adv, MASK, "grpo")
    assert loss.item() == pytest.approx(-1 / 3)   # -(1 + 1 - 1) / 3 tokens
    loss.backward()
    # d/dlogp of -ratio*A at ratio 1 is -A / n_tokens
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [1 / 3, 0.0, 0.0]]))
    assert stats["ratio_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("ratio, adv, expected", [
    (1.5, 1.0, -1.2),   # clipped at 1 + 0.2
    (1.5, -1.0, 1.5),   # pessimistic branch keeps the unclipped ratio
    (0.5, 1.0, -0.5),
    (0.5, -1.0, 0.8),   # clipped at 1 - 0.2
])
def test_grpo_clipping_by_hand(ratio, adv, expected):
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio))
    loss, _ = policy_loss(logp, old, torch.tensor([adv]), torch.ones(1, 1), "grpo")
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_gspo_sequence_ratio_and_tight_clip():
    # token log-ratios [ln 2, 0] -> sequence ratio exp(ln2 / 2) = sqrt 2, clipped at 1 + 4e-4
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), "gspo")
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    assert stats["pg_clipfrac"] == 1.0
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0  # clipped: no gradient
    loss, _ = policy_loss(logp.detach(), old, torch.tensor([-1.0]), torch.ones(1, 2), "gspo")
    assert loss.item() == pytest.approx(math.sqrt(2.0), rel=1e-6)  # negative advantage: unclipped


def test_gspo_token_equals_gspo_in_value_and_gradient():
    torch.manual_seed(0)
    old = torch.randn(3, 4) * 0.01 - 1.0
    base = old + torch.randn(3, 4) * 1e-5  # inside the tight clip range
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([0.5, -1.0, 2.0])
    results = {}
    for algo in ("gspo", "gspo_token"):
        logp = base.clone().requires_grad_()
        loss, _ = policy_loss(logp, old, adv, mask, algo)
        loss.backward()
        results[algo] = (loss.item(), logp.grad.clone())
    assert results["gspo"][0] == pytest.approx(results["gspo_token"][0], rel=1e-6)
    assert torch.allclose(results["gspo"][1], results["gspo_token"][1], atol=1e-7)
    assert torch.count_nonzero(results["gspo"][1] * (1 - mask)) == 0


def test_k3_kl_by_hand_and_beta_penalty():
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    expected = 0.5 - math.log(0.5) - 1  # exp(d) - d - 1 with d = ln(0.25 / 0.5)
    assert k3_kl(logp, ref).item() == pytest.approx(expected, rel=1e-6)
    assert k3_kl(logp, logp).item() == 0.0
    loss0, stats = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), "grpo", ref_logp=ref, beta=0.0)
    loss1, _ = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), "grpo", ref_logp=ref, beta=0.1)
    assert stats["kl_ref"] == pytest.approx(expected, rel=1e-6)
    assert loss1.item() - loss0.item() == pytest.approx(0.1 * expected, rel=1e-5)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_has_its_math_and_default_clip(name):
    # one registry entry (hpcrl/schemas/builtin.py) must be enough for the loss to run
    algo = ALGORITHMS[name]
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.3, 0.3]])).requires_grad_()
    old = torch.log(torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]]))  # ratios far outside any clip
    adv = torch.tensor([-1.0, -1.0])
    loss, stats = policy_loss(logp, old, adv, MASK, name, loss_agg=algo.loss_agg)
    explicit, _ = policy_loss(logp, old, adv, MASK, name, *algo.clip, loss_agg=algo.loss_agg)
    assert loss.item() == pytest.approx(explicit.item()) and math.isfinite(loss.item())
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, MASK, name + "_nope")
