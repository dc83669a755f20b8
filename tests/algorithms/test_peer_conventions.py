"""The peers' conventions lmrl offers as options (issue 19): TRL's batch-std advantages, verl / OpenRLHF KL
clamping, k3+, OpenRLHF's population-std whitening, TRL RLOO's whole-sequence clipped ratio."""

from __future__ import annotations

import math

import pytest
import torch

from lmrl.algorithms import (
    batch_std_advantages,
    grpo_advantages,
    kl_penalty,
    masked_whiten,
    policy_loss,
    sequence_kl,
)

F64 = torch.float64


# --------------------------------------------------------------------------------- batch-std advantages

def test_batch_std_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=F64)
    std = math.sqrt(8 * 0.25 / 7)  # batch mean 0.5, unbiased
    dev = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25], dtype=F64)
    torch.testing.assert_close(batch_std_advantages(r, 4, eps=0.0), dev / std, rtol=1e-12, atol=1e-12)
    # TRL's formula with its eps: (r - group mean) / (r.std() + 1e-4)
    trl = (r - r.view(-1, 4).mean(1).repeat_interleave(4)) / (r.std() + 1e-4)
    torch.testing.assert_close(batch_std_advantages(r, 4, eps=1e-4), trl, rtol=1e-12, atol=1e-12)
    # a given std (another rank's share of the batch) replaces the batch's own
    torch.testing.assert_close(batch_std_advantages(r, 4, eps=0.0, std=2.0), dev / 2.0)


def test_batch_std_advantages_equal_rewards_are_exactly_zero():
    r = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.3, 0.7], dtype=torch.float32)
    adv = batch_std_advantages(r, 2)
    assert (adv[:4] == 0).all() and adv[4] < 0 < adv[5]
    assert (batch_std_advantages(torch.full((6,), 0.1), 3) == 0).all()  # a whole batch of equal rewards
    # differs from per-group scaling exactly by the ratio of the stds
    g = grpo_advantages(r.double(), 2, eps=0.0)[4:]
    torch.testing.assert_close(batch_std_advantages(r.double(), 2, eps=0.0)[4:] * r.double().std(),
                               g * r.double()[4:].std())


# ------------------------------------------------------------------------------------- KL clamping, k3+

def test_kl_clamp_conventions_by_hand():
    logp = torch.tensor([0.0, -1.0, -30.0], dtype=F64)
    ref = torch.tensor([-30.0, -1.5, 0.0], dtype=F64)
    lr = logp - ref  # 30, 0.5, -30
    k3 = torch.expm1(-lr) + lr
    # lmrl: no clamping
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), lr)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), k3)
    # verl: k1 and k2 untouched; k3 from the log-ratio clamped to [-20, 20], then clamped to [-10, 10]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1", "verl"), lr)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2", "verl"), 0.5 * lr**2)
    # row 0: e^-20 + 19 -> 10; row 2: e^20 - 21 -> 10
    torch.testing.assert_close(kl_penalty(logp, ref, "k3", "verl"), torch.tensor([10.0, k3[1].item(), 10.0], dtype=F64))
    # the log-ratio clamp keeps a huge log-ratio from overflowing: unclamped k3 is inf there
    far = torch.tensor([-1000.0], dtype=F64)
    assert kl_penalty(far, torch.zeros(1, dtype=F64), "k3").isinf().all()
    assert kl_penalty(far, torch.zeros(1, dtype=F64), "k3", "verl").item() == 10.0
    # openrlhf: every estimator clamped to [-10, 10]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1", "openrlhf"), torch.tensor([10.0, 0.5, -10.0], dtype=F64))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2", "openrlhf"), torch.tensor([10.0, 0.125, 10.0], dtype=F64))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3", "openrlhf"), torch.tensor([10.0, k3[1].item(), 10.0],
                                                                                    dtype=F64))


def test_kl_clamp_stops_the_gradient_of_clamped_entries():
    logp = torch.tensor([0.0, -1.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-30.0, -1.5], dtype=F64)
    kl_penalty(logp, ref, "k1", "openrlhf").sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 1.0], dtype=F64))


def test_k3_plus_has_k3_value_and_k2_gradient():
    logp = torch.tensor([-1.0, -0.2, -3.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.1, -1.0], dtype=F64)
    value = kl_penalty(logp, ref, "k3+")
    torch.testing.assert_close(value, kl_penalty(logp, ref, "k3"))
    value.sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref).detach())  # d/dlogp ½(logp - ref)²
    # with verl's clamp: the clamped k3 value, still k2's gradient
    lp = torch.tensor([-30.0], dtype=F64, requires_grad=True)
    v = kl_penalty(lp, torch.tensor([0.0], dtype=F64), "k3+", "verl")
    v.backward()
    assert v.item() == 10.0 and lp.grad.item() == -30.0
    assert sequence_kl(logp, ref, torch.ones(3, dtype=torch.bool), "k3+").item() == pytest.approx(
        kl_penalty(logp, ref, "k3").sum().item())


def test_policy_loss_passes_the_kl_clamp():
    logp = torch.tensor([[0.0, -1.0]], dtype=F64)
    ref = torch.tensor([[-30.0, -1.5]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.zeros(1, dtype=F64)
    loss, m = policy_loss(logp, logp, adv, mask, ref_logp=ref, kl_coef=1.0, kl_estimator="k1", kl_clamp="openrlhf")
    assert loss.item() == pytest.approx((10.0 + 0.5) / 2) and m.kl == pytest.approx(5.25)
    with pytest.raises(ValueError, match="kl_clamp: unknown value 'trl'"):
        policy_loss(logp, logp, adv, mask, ref_logp=ref, kl_coef=1.0, kl_clamp="trl")
    with pytest.raises(ValueError, match="clamp: unknown 'trl'"):
        kl_penalty(logp, ref, "k1", "trl")


# ---------------------------------------------------------------------------------- population whitening

def test_masked_whiten_population_std():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 99.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    pop = masked_whiten(x, mask, eps=0.0, unbiased=False)
    unb = masked_whiten(x, mask, eps=0.0)
    want = (torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64) - 2.5) / math.sqrt(1.25)
    torch.testing.assert_close(pop[mask], want)
    torch.testing.assert_close(unb[mask], want * math.sqrt(1.25) / math.sqrt(5 / 3))
    assert (pop[~mask] == 0).all()


# ------------------------------------------------------------------- whole-sequence ratio (TRL RLOO)

def _trl_rloo_loss(logp, old, adv, mask, eps):
    """TRL RLOOTrainer's surrogate, written from its description: one ratio per sequence, mean over sequences."""
    seq_ratio = torch.exp(((logp - old) * mask).sum(-1))
    return -torch.minimum(seq_ratio * adv, seq_ratio.clamp(1 - eps, 1 + eps) * adv).mean()


def test_sequence_sum_ratio_matches_trl_rloo_value_and_gradient():
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.2, 0.0], [-1.1, -0.9, -0.4]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.05, -0.5, -2.0], [-0.1, -0.3, 0.0], [-1.2, -1.0, -0.5]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, ratio_level="sequence-sum",
                          aggregation="seq-mean-token-sum")
    ref = _trl_rloo_loss(logp, old, adv, mask.to(F64), 0.2)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    g, = torch.autograd.grad(loss, logp)
    g_ref, = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(g, torch.where(mask, g_ref, 0.0), rtol=1e-12, atol=1e-12)
    # by hand: sequence ratios e^0.05 (inside), e^-0.1 (A < 0, inside [0.8, 1.2]), e^0.3 = 1.35 (A > 0: clipped)
    assert m.clipfrac == pytest.approx(3 / 8)  # the 3 tokens of the clipped sequence, of 8
    assert m.ratio_max == pytest.approx(math.exp(0.3))
    assert loss.item() == pytest.approx(-(math.exp(0.05) * 1.0 - 0.5 * math.exp(-0.1) + 1.2 * 2.0) / 3)
    assert (g[2] == 0).all() and g[0, 0].item() == pytest.approx(-math.exp(0.05) / 3)


def test_sequence_sum_on_policy_is_reinforce_per_sequence():
    logp = torch.tensor([[-1.0, -0.5], [-0.3, -0.2]], dtype=F64, requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, m = policy_loss(logp, logp.detach(), adv, mask, ratio_level="sequence-sum", aggregation="seq-mean-token-sum")
    assert m.clipfrac == 0.0 and m.ratio_mean == 1.0 and m.approx_kl == 0.0
    g, = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(g, torch.tensor([[-0.5, -0.5], [0.5, 0.5]], dtype=F64))  # -A / B per token
