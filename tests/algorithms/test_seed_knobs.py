"""The seeds' remaining knobs as pure functions: LightRFT's clip-filter-like weights and CPGD's loss."""

from __future__ import annotations

import math

import pytest
import torch

from lmrl.algorithms import clip_filter_like_weights, cpgd_loss, policy_loss

F64 = torch.float64


def test_clip_filter_like_weights_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])  # groups: mixed, equal, equal, mixed
    torch.testing.assert_close(clip_filter_like_weights(r, 2), torch.tensor([2.0, 2, 1, 1, 1, 1, 2, 2]))  # 4 / 2
    torch.testing.assert_close(clip_filter_like_weights(r, 2, equal_weight=0.5), torch.tensor([2.0, 2, .5, .5, .5, .5, 2, 2]))
    one = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # one informative group of 4: 4 capped at 3
    torch.testing.assert_close(clip_filter_like_weights(one, 2), torch.tensor([3.0, 3, 1, 1, 1, 1, 1, 1]))
    torch.testing.assert_close(clip_filter_like_weights(one, 2, max_weight=10.0)[:2], torch.tensor([4.0, 4.0]))
    assert (clip_filter_like_weights(torch.ones(6), 3) == 1).all()  # nothing informative: all ones
    # the whole batch's share (several ranks) replaces this batch's own
    torch.testing.assert_close(clip_filter_like_weights(r, 2, informative_fraction=0.8)[:2], torch.tensor([1.25, 1.25]))


def test_clip_filter_like_weights_bad_arguments():
    with pytest.raises(ValueError, match="max_weight"):
        clip_filter_like_weights(torch.ones(4), 2, max_weight=0.0)
    with pytest.raises(ValueError, match="equal_weight"):
        clip_filter_like_weights(torch.ones(4), 2, equal_weight=-1.0)


def test_cpgd_loss_by_hand():
    # l = logp - old: 0.5 (A > 0, above ln 1.2 = 0.182: clipped), -0.1 (A > 0, inside), -0.5 (A < 0, below ln 0.8)
    logp = torch.tensor([[-0.5, -1.1, -1.5]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
    adv = torch.tensor([[1.0, 2.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = cpgd_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, drift_coef=0.0)
    want = -(math.log(1.2) * 1.0 + (-0.1) * 2.0 + math.log(0.8) * -1.0) / 3
    assert loss.item() == pytest.approx(want, abs=1e-12)
    g, = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(g, torch.tensor([[0.0, -2.0 / 3, 0.0]], dtype=F64))  # clipped tokens: no gradient
    assert m.clipfrac == pytest.approx(2 / 3) and m.clipfrac_high == pytest.approx(1 / 3)
    # the drift penalty: alpha * ((rho - 1) - l) per token, gradient alpha * (rho - 1)
    loss_d, _ = cpgd_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, drift_coef=0.5)
    lr = torch.tensor([0.5, -0.1, -0.5], dtype=F64)
    assert loss_d.item() == pytest.approx(want + 0.5 * (torch.expm1(lr) - lr).mean().item(), abs=1e-12)
    g_d, = torch.autograd.grad(loss_d, logp)
    torch.testing.assert_close(g_d - g, 0.5 * torch.expm1(lr)[None] / 3)


def test_cpgd_on_policy_is_the_reinforce_gradient():
    logp = torch.tensor([[-0.7, -1.2], [-0.3, -2.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.5, -0.5], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    loss, m = cpgd_loss(logp, logp.detach(), adv, mask, drift_coef=0.3)
    ppo, _ = policy_loss(logp, logp.detach(), adv, mask)
    assert m.clipfrac == 0.0 and m.approx_kl == 0.0 and loss.item() == 0.0
    g, = torch.autograd.grad(loss, logp)
    g_ppo, = torch.autograd.grad(ppo, logp)
    torch.testing.assert_close(g, g_ppo)
