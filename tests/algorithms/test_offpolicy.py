"""Tests of lmrl.algorithms.offpolicy (the decoupled PPO objective): a case worked out by hand, equality
with policy_loss on fresh data, the clip against the proximal policy, the behaviour weights' modes, dtypes,
errors."""

from __future__ import annotations

import math

import pytest
import torch

from lmrl.algorithms import DecoupledLossMetrics, decoupled_policy_loss, policy_loss

F64 = torch.float64
NAN, INF = math.nan, math.inf


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# ---------------------------------------------------------------------------------------------------
# a 2x3 case by hand
#
# Built from the ratios, with prox_logp = -1 on real tokens:
#   rho   = exp(logp - prox_logp)        row 0: 1.1, 1.5, 0.9     row 1: 0.7, 1.3, (pad)
#   w_raw = exp(prox_logp - behav_logp)  row 0: 1.5, 0.8, 4.0     row 1: 1.0, 0.5, (pad)
#   A                                    row 0: 1,   2,   -1      row 1: -0.5, -1, (pad)
# i.e. logp = -1 + ln(rho), behav_logp = -1 - ln(w_raw); the padded token holds nan / inf garbage.
# Default clip 0.2 / 0.2 (band [0.8, 1.2]), behav_cap 2.0, token-mean over the 5 real tokens.
#
# per token: w, s = -min(rho A, clip(rho) A), the loss ℓ = w s, and d ℓ / d logp = -w rho A unless clipped
# (0,0)  w = 1.5               s = -min(1.1, 1.1) = -1.1                          ℓ = -1.65   grad -1.65
# (0,1)  w = 0.8               s = -min(3.0, 1.2 * 2 = 2.4) = -2.4      CLIPPED   ℓ = -1.92   grad 0
# (0,2)  w = min(4, 2) = 2.0   s = -min(-0.9, -0.9) = 0.9               TRUNCATED ℓ = 1.80    grad 1.80
# (1,0)  w = 1.0               s = -min(-0.35, 0.8 * -0.5 = -0.4) = 0.4 CLIPPED   ℓ = 0.40    grad 0
# (1,1)  w = 0.5               s = -min(-1.3, 1.2 * -1 = -1.2) = 1.3              ℓ = 0.65    grad 0.65
#        (ratio 1.3 is out of the band, but with A < 0 the unclipped branch is the min: not clipped)
# loss = (-1.65 - 1.92 + 1.80 + 0.40 + 0.65) / 5 = -0.72 / 5 = -0.144
# grad = [[-1.65, 0, 1.80], [0, 0.65, 0]] / 5 = [[-0.33, 0, 0.36], [0, 0.13, 0]]
# behaviour weights' mean (1.5 + 0.8 + 2.0 + 1.0 + 0.5) / 5 = 1.16, none is 0; clipfrac 2 / 5 (1 low, 1 high)

RHO = [[1.1, 1.5, 0.9], [0.7, 1.3, 1.0]]
W_RAW = [[1.5, 0.8, 4.0], [1.0, 0.5, 1.0]]
ADV = [[1.0, 2.0, -1.0], [-0.5, -1.0, NAN]]
MASK = [[1, 1, 1], [1, 1, 0]]
EXPECTED_LOSS = -0.144
EXPECTED_GRAD = [[-0.33, 0.0, 0.36], [0.0, 0.13, 0.0]]


def _hand_case(dtype=F64):
    """(logp leaf, prox_logp, behav_logp, advantages, mask) of the case above, in `dtype`."""
    log_rho, log_w = torch.tensor(RHO, dtype=F64).log(), torch.tensor(W_RAW, dtype=F64).log()
    prox = torch.full((2, 3), -1.0, dtype=F64)
    logp, behav = prox + log_rho, prox - log_w
    # garbage in the padded token of every input
    logp[1, 2], prox[1, 2], behav[1, 2] = NAN, INF, -INF
    mask = torch.tensor(MASK, dtype=torch.bool)
    adv = torch.tensor(ADV, dtype=dtype)
    return logp.to(dtype).requires_grad_(True), prox.to(dtype), behav.to(dtype), adv, mask


def test_decoupled_loss_by_hand():
    logp, prox, behav, adv, mask = _hand_case()
    loss, m = decoupled_policy_loss(logp, prox, behav, adv, mask)
    assert loss.item() == pytest.approx(EXPECTED_LOSS, abs=1e-6)
    torch.testing.assert_close(_grad(loss, logp), torch.tensor(EXPECTED_GRAD, dtype=F64), atol=1e-6, rtol=0)
    assert isinstance(m, DecoupledLossMetrics)
    assert m.behav_weight_mean == pytest.approx(1.16, abs=1e-6)
    assert m.behav_masked_frac == 0.0
    assert (m.clipfrac_low, m.clipfrac_high) == (pytest.approx(0.2), pytest.approx(0.2))
    assert isinstance(m.behav_weight_mean, float) and isinstance(m.behav_masked_frac, float)
    assert m["behav_weight_mean"] == m.behav_weight_mean and "kl" not in m  # a mapping, like policy_loss's


def test_caller_weights_multiply_the_behaviour_weights():
    logp, prox, behav, adv, mask = _hand_case()
    # token (0,0) doubled, (1,1) dropped: (-1.65 * 2 - 1.92 + 1.80 + 0.40 + 0) / 5 = -3.02 / 5 = -0.604
    weights = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.0, NAN]], dtype=F64)
    loss, m = decoupled_policy_loss(logp, prox, behav, adv, mask, weights=weights)
    assert loss.item() == pytest.approx(-0.604, abs=1e-6)
    assert m.behav_weight_mean == pytest.approx(1.16, abs=1e-6)  # w alone, not w times the caller's weights


def test_untruncated_behaviour_weights():
    logp, prox, behav, adv, mask = _hand_case()
    # behav_cap=None: token (0,2) weighs 4.0: (-1.65 - 1.92 + 3.60 + 0.40 + 0.65) / 5 = 1.08 / 5 = 0.216
    loss, m = decoupled_policy_loss(logp, prox, behav, adv, mask, behav_cap=None)
    assert loss.item() == pytest.approx(0.216, abs=1e-6)
    assert m.behav_weight_mean == pytest.approx(7.8 / 5, abs=1e-6)


# ---------------------------------------------------------------------------------------------------
# properties


def _random_batch(seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    B, T = 6, 5
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 1, 4, 0, 2])[:, None]
    logp = -torch.rand(B, T, generator=gen, dtype=F64) * 2
    prox = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)
    ref = logp + 0.2 * torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.randn(B, T, generator=gen, dtype=F64)
    return logp.to(dtype), prox.to(dtype), ref.to(dtype), adv.to(dtype), mask


@pytest.mark.parametrize("mode", ["truncate", "icepop", "sequence-mask"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, aggregation="seq-mean-token-mean"),
        dict(ratio_level="sequence", clip_low=0.05, clip_high=0.05, aggregation="seq-mean-token-sum"),
        dict(ratio_level="sequence-sum", aggregation="token-sum"),
        dict(kl_coef=0.1, kl_estimator="k3", aggregation="seq-mean-token-sum-norm", norm_length=5),
    ],
)
def test_fresh_data_is_exactly_policy_loss(mode, kwargs):
    # behav_logp == prox_logp: every behaviour weight is exp(0) = 1, so the objective is PPO's, to the bit
    logp, prox, ref, adv, mask = _random_batch(1)
    if "kl_coef" in kwargs:
        kwargs = dict(kwargs, ref_logp=ref)
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    loss, m = decoupled_policy_loss(a, prox, prox.clone(), adv, mask, behav_mode=mode, **kwargs)
    expected, m_expected = policy_loss(b, prox, adv, mask, **kwargs)
    assert loss.item() == expected.item()
    assert torch.equal(_grad(loss, a), _grad(expected, b))
    assert {k: v for k, v in m.items() if not k.startswith("behav_")} == dict(m_expected)
    assert (m.behav_weight_mean, m.behav_masked_frac) == (1.0, 0.0)


def test_clip_is_against_the_proximal_policy_not_the_behaviour_policy():
    # One token, A = 1: logp - behav_logp = ln 10 (ratio 10, far above 1.2), logp - prox_logp = ln 1.05
    # (inside the band).
    # w = exp(prox - behav) = 10 / 1.05, untruncated: ℓ = -w · 1.05 · A = -10, d ℓ / d logp = -10.
    behav = torch.tensor([[-3.0]], dtype=F64)
    prox = behav + math.log(10.0 / 1.05)
    logp = (behav + math.log(10.0)).requires_grad_(True)
    adv, mask = torch.tensor([1.0], dtype=F64), torch.ones(1, 1, dtype=torch.bool)
    loss, m = decoupled_policy_loss(logp, prox, behav, adv, mask, behav_cap=None)
    assert loss.item() == pytest.approx(-10.0, abs=1e-6)
    assert _grad(loss, logp).item() == pytest.approx(-10.0, abs=1e-6)
    assert m.clipfrac == 0.0
    # truncated at 2: ℓ = -2 · 1.05 = -2.1, and still a gradient
    loss, _ = decoupled_policy_loss(logp, prox, behav, adv, mask, behav_cap=2.0)
    assert _grad(loss, logp).item() == pytest.approx(-2.1, abs=1e-6)
    # the coupled objective (behaviour policy as old_logp) clips the token: no gradient at all
    coupled, m_coupled = policy_loss(logp, behav, adv, mask)
    assert _grad(coupled, logp).item() == 0.0 and m_coupled.clipfrac == 1.0


def test_gradient_reaches_only_logp():
    logp, prox, ref, adv, mask = _random_batch(2)
    logp.requires_grad_(True)
    prox = prox.clone().requires_grad_(True)
    behav = (prox.detach() + 0.1).requires_grad_(True)
    for mode in ("truncate", "icepop", "sequence-mask"):
        loss, _ = decoupled_policy_loss(logp, prox, behav, adv, mask, behav_mode=mode)
        loss.backward()
        assert logp.grad is not None and logp.grad.abs().sum() > 0
        assert prox.grad is None and behav.grad is None
        logp.grad = None


# ---------------------------------------------------------------------------------------------------
# the masking modes
#
# rho = 1 everywhere (logp == prox_logp), A = 1, so ℓ = -w per token and d ℓ / d logp = -w / 5.
# w_raw   row 0: 1.5, 3.0, 0.6     row 1: 1.2, 0.9, (pad)      band [0.5, 2.0]
# truncate:       1.5, 2.0, 0.6               1.2, 0.9             (3.0 capped at 2)
# icepop:         1.5, 0,   0.6               1.2, 0.9             (3.0 leaves the band)
# sequence-mask:  row 0's ratio 1.5 · 3 · 0.6 = 2.7 > 2: all 0; row 1's 1.2 · 0.9 = 1.08 on both tokens
MODE_W_RAW = [[1.5, 3.0, 0.6], [1.2, 0.9, 1.0]]


@pytest.mark.parametrize(
    ("mode", "w", "masked_frac"),
    [
        ("truncate", [[1.5, 2.0, 0.6], [1.2, 0.9, 0.0]], 0.0),
        ("icepop", [[1.5, 0.0, 0.6], [1.2, 0.9, 0.0]], 0.2),
        ("sequence-mask", [[0.0, 0.0, 0.0], [1.08, 1.08, 0.0]], 0.6),
    ],
)
def test_behaviour_modes_weight_and_drop_the_right_tokens(mode, w, masked_frac):
    prox = torch.full((2, 3), -1.0, dtype=F64)
    behav = prox - torch.tensor(MODE_W_RAW, dtype=F64).log()
    logp = prox.clone().requires_grad_(True)
    mask = torch.tensor(MASK, dtype=torch.bool)
    loss, m = decoupled_policy_loss(logp, prox, behav, torch.ones(2), mask, behav_mode=mode, behav_low=0.5,
                                    behav_cap=2.0)
    w = torch.tensor(w, dtype=F64)
    assert loss.item() == pytest.approx(-w.sum().item() / 5, abs=1e-6)
    torch.testing.assert_close(_grad(loss, logp), -w / 5, atol=1e-6, rtol=0)
    assert m.behav_masked_frac == pytest.approx(masked_frac, abs=1e-6)
    assert m.behav_weight_mean == pytest.approx(w.sum().item() / 5, abs=1e-6)


# ---------------------------------------------------------------------------------------------------
# dtypes


def test_float32_matches_the_hand_values():
    logp, prox, behav, adv, mask = _hand_case(torch.float32)
    loss, m = decoupled_policy_loss(logp, prox, behav, adv, mask)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(EXPECTED_LOSS, abs=1e-6)
    torch.testing.assert_close(_grad(loss, logp), torch.tensor(EXPECTED_GRAD), atol=1e-6, rtol=0)
    assert m.behav_weight_mean == pytest.approx(1.16, abs=1e-6)


def test_bfloat16_inputs_are_computed_in_float32():
    logp, prox, behav, adv, mask = _hand_case(torch.bfloat16)
    loss, m = decoupled_policy_loss(logp, prox, behav, adv, mask)
    g = _grad(loss, logp)
    assert loss.dtype == torch.float32 and g.dtype == torch.bfloat16
    # the same bf16-rounded numbers in float32 give the same loss: the math runs in float32
    up = [x.detach().float() for x in (logp, prox, behav, adv)]
    loss_32, _ = decoupled_policy_loss(up[0].requires_grad_(True), *up[1:], mask)
    assert loss.item() == pytest.approx(loss_32.item(), abs=1e-6)
    # and bf16's rounding of the log-probs (steps of 2^-8 to 2^-7 here) moves the hand values by about 1e-3
    assert loss.item() == pytest.approx(EXPECTED_LOSS, abs=5e-3)
    torch.testing.assert_close(g.float(), torch.tensor(EXPECTED_GRAD), atol=5e-3, rtol=0)
    assert m.behav_weight_mean == pytest.approx(1.16, abs=5e-3)
    assert m.clipfrac == pytest.approx(0.4)  # no ratio sits near a clip bound: the same tokens are clipped


# ---------------------------------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(behav_mode="tis"), "behav_mode"),
        (dict(behav_mode="sequence"), "behav_mode"),
        (dict(behav_cap=0.0), "behav_cap"),
        (dict(behav_mode="icepop", behav_cap=None), "behav_cap"),
        (dict(behav_mode="icepop", behav_cap=1.0), "behav_cap"),
        (dict(behav_mode="sequence-mask", behav_low=1.0), "behav_low"),
        (dict(weights=torch.ones(2, 4)), "weights"),
        (dict(clip_low=1.5), "clip_low"),  # policy_loss's own checks pass through
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    logp, prox, behav, adv, mask = _hand_case()
    with pytest.raises(ValueError, match=f"^{name}:"):
        decoupled_policy_loss(logp, prox, behav, adv, mask, **kwargs)


@pytest.mark.parametrize("position", [1, 2])
def test_shape_mismatch_names_the_argument(position):
    args = list(_hand_case())
    args[position] = torch.zeros(2, 4, dtype=F64)
    with pytest.raises(ValueError, match=f"^{['prox_logp', 'behav_logp'][position - 1]}:"):
        decoupled_policy_loss(*args)
