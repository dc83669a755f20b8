"""SAPO, GMPO, Clip-Cov, KL-Cov (lmrl/algorithms/surrogates.py) and the masked IS weights: values worked out by
hand, on-policy gradients, selection rules."""

from __future__ import annotations

import math

import pytest
import torch

from lmrl.algorithms import (
    clip_cov_loss,
    gmpo_loss,
    kl_cov_loss,
    masked_is_weights,
    policy_loss,
    sapo_loss,
    token_covariance,
)

F64 = torch.float64


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_by_hand():
    # token 0: rho = 1, A = 1 (tau 1); token 1: rho = 2, A = -1 (tau_neg 1.05)
    logp = torch.tensor([[-1.0, -1.0 + math.log(2.0)]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = sapo_loss(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05)
    s1 = _sig(1.05 * (2.0 - 1.0))
    assert loss.item() == pytest.approx((-4 * 0.5 * 1.0 + (4 / 1.05) * s1) / 2, abs=1e-12)
    g, = torch.autograd.grad(loss, logp)
    # d/dlogp: -4 sig (1 - sig) rho A / 2 tokens
    torch.testing.assert_close(g, torch.tensor([[-4 * 0.25 / 2, 4 * s1 * (1 - s1) * 2.0 / 2]], dtype=F64))
    assert m.clipfrac == 0.0  # token 1's gate 4 s (1 - s) = 0.77: its gradient is not halved
    far = torch.tensor([[-1.0 + math.log(4.0)]], dtype=F64)  # rho = 4, A = 1: gate 4 s(3) (1 - s(3)) = 0.18
    _, m_far = sapo_loss(far, old[:, :1], torch.ones(1, dtype=F64), torch.ones(1, 1, dtype=torch.bool))
    assert m_far.clipfrac_high == 1.0


def test_sapo_on_policy_is_reinforce():
    logp = torch.tensor([[-0.7, -1.2], [-0.3, -2.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.5, -0.5], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    loss, m = sapo_loss(logp, logp.detach(), adv, mask)
    ppo, _ = policy_loss(logp, logp.detach(), adv, mask)
    g, = torch.autograd.grad(loss, logp)
    g_ppo, = torch.autograd.grad(ppo, logp)
    torch.testing.assert_close(g, g_ppo)
    assert m.clipfrac == 0.0 and m.ratio_mean == 1.0


def test_gmpo_by_hand():
    logp = torch.tensor([[0.5, -0.1, 0.2], [-0.6, 0.1, 0.0]], dtype=F64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    loss, m = gmpo_loss(logp, old, adv, mask, clip_low=0.4, clip_high=0.4)
    s1 = math.exp((0.4 - 0.1 + 0.2) / 3)  # A > 0: 0.5 clipped to 0.4
    s2 = math.exp((-0.4 + 0.1) / 2)  # A < 0: -0.6 clipped to -0.4
    assert loss.item() == pytest.approx((-s1 + s2) / 2, abs=1e-12)
    g, = torch.autograd.grad(loss, logp)
    want = torch.tensor([[0.0, -s1 / 3 / 2, -s1 / 3 / 2], [0.0, s2 / 2 / 2, 0.0]], dtype=F64)
    torch.testing.assert_close(g, want)
    assert m.clipfrac == pytest.approx(2 / 5)
    assert m.ratio_max == pytest.approx(s1)


def test_gmpo_is_less_moved_by_one_outlier_than_the_arithmetic_mean():
    logp = torch.tensor([[3.0, 0.0, 0.0, 0.0]], dtype=F64)
    old = torch.zeros(1, 4, dtype=F64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    _, m = gmpo_loss(logp, old, torch.ones(1, dtype=F64), mask, clip_low=None, clip_high=None)
    assert m.ratio_mean == pytest.approx(math.exp(0.75))  # geometric mean: e^(3/4) = 2.1, arithmetic: 5.8
    assert m.ratio_mean < (math.exp(3.0) + 3) / 4


def test_token_covariance_by_hand():
    logp = torch.tensor([[-1.0, -3.0, 99.0]], dtype=F64)
    adv = torch.tensor([[2.0, 0.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    # means over real tokens: logp -2, A 1 -> (1)(1), (-1)(-1)
    torch.testing.assert_close(token_covariance(logp, adv, mask), torch.tensor([[1.0, 1.0, 0.0]], dtype=F64))


def _cov_batch():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 25, generator=g, dtype=F64) * 4).requires_grad_(True)
    adv = torch.randn(4, 1, generator=g, dtype=F64).expand(4, 25) * 3
    mask = torch.ones(4, 25, dtype=torch.bool)
    mask[3, 20:] = False
    return logp, adv, mask


def test_clip_cov_drops_random_tokens_of_the_covariance_band():
    logp, adv, mask = _cov_batch()
    cov = token_covariance(logp, adv, mask)
    band = mask & (cov > 1.0) & (cov < 5.0)
    assert band.sum() > 5
    loss, m = clip_cov_loss(logp, logp.detach(), adv, mask, clip_fraction=0.02, generator=torch.Generator().manual_seed(1))
    ref, _ = policy_loss(logp, logp.detach(), adv, mask)
    g, = torch.autograd.grad(loss, logp)
    g_ref, = torch.autograd.grad(ref, logp)
    dropped = (g != g_ref)
    assert int(dropped.sum()) == 1 == int(0.02 * 95)  # max(1, floor(0.02 * 95 real tokens))
    assert band[dropped].all() and (g[dropped] == 0).all()
    assert m.dual_clipfrac == pytest.approx(1 / 95) and m.clipfrac == pytest.approx(1 / 95)
    # the same generator seed, the same choice; fraction 0 is PPO
    again, _ = clip_cov_loss(logp, logp.detach(), adv, mask, clip_fraction=0.02, generator=torch.Generator().manual_seed(1))
    assert again.item() == loss.item()
    none, _ = clip_cov_loss(logp, logp.detach(), adv, mask, clip_fraction=0.0)
    assert none.item() == ref.item()


def test_kl_cov_penalises_the_top_covariance_tokens():
    logp, adv, mask = _cov_batch()
    old = (logp + 0.1).detach()  # log-ratio -0.1 everywhere
    loss, m = kl_cov_loss(logp, old, adv, mask, kl_fraction=0.03, cov_kl_coef=2.0)
    cov = token_covariance(logp, adv, mask)
    top = torch.topk(torch.where(mask, cov, -math.inf).flatten(), 2).indices  # floor(0.03 * 95) = 2
    plain = (-adv * math.exp(-0.1))[mask].sum()
    assert loss.item() == pytest.approx(((plain + 2 * 2.0 * 0.1) / 95).item(), abs=1e-12)
    g, = torch.autograd.grad(loss, logp)
    g0 = -adv * math.exp(-0.1) / 95
    penalised = torch.zeros(100, dtype=torch.bool)
    penalised[top] = True
    penalised = penalised.view(4, 25)
    torch.testing.assert_close(g, torch.where(mask, g0 + torch.where(penalised, -2.0 / 95, 0.0), 0.0))
    assert m.clipfrac == pytest.approx(2 / 95)


def test_masked_is_weights_by_hand():
    old = torch.tensor([[0.1, 1.0, -1.0, 7.0]], dtype=F64)
    rollout = torch.zeros(1, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    # IcePop: ratios e^0.1 (kept, weight e^0.1), e^1 = 2.7 > 2 and e^-1 = 0.37 < 0.5 (masked), padding 0
    torch.testing.assert_close(masked_is_weights(old, rollout, mask, 0.5, 2.0),
                               torch.tensor([[math.exp(0.1), 0.0, 0.0, 0.0]], dtype=F64))
    # sequence: e^(0.1 + 1 - 1) = e^0.1 inside the band: every real token weighs it
    torch.testing.assert_close(masked_is_weights(old, rollout, mask, 0.5, 2.0, level="sequence"),
                               torch.tensor([[math.exp(0.1)] * 3 + [0.0]], dtype=F64))
    far = torch.tensor([[0.5, 0.5, 0.5, 0.0]], dtype=F64)  # e^1.5 = 4.5 > 2: the whole sequence is masked
    assert (masked_is_weights(far, rollout, mask, 0.5, 2.0, level="sequence") == 0).all()
    with pytest.raises(ValueError, match="low, high"):
        masked_is_weights(old, rollout, mask, 1.5, 2.0)
