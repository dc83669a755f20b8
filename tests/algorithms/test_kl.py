"""KL estimators k1/k2/k3, their gradients and expectations, and KL-shaped per-token rewards."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.algorithms import KL_ESTIMATORS, KLController, kl_penalty, kl_shaped_rewards, sequence_kl

NAN, INF = float("nan"), float("inf")

# log_ratio = logp - ref_logp = [0.5, -1.0, 0.0]
LOGP = torch.tensor([-1.0, -2.0, -0.5])
REF = torch.tensor([-1.5, -1.0, -0.5])


def test_k1_k2_k3_hand_values():
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k1"), torch.tensor([0.5, -1.0, 0.0]))
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k2"), torch.tensor([0.125, 0.5, 0.0]))
    # k3 = e^r - r - 1 with r = ref - logp = [-0.5, 1, 0]: e^-0.5 - 0.5 = 0.1065307, e - 2 = 0.7182818
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k3"), torch.tensor([0.10653066, 0.71828183, 0.0]))


def test_default_estimator_is_k1():
    torch.testing.assert_close(kl_penalty(LOGP, REF), LOGP - REF)


def test_k3_is_accurate_for_tiny_log_ratios():
    # k3 ≈ r²/2 for small r; a naive exp(r) - 1 - r in float32 would return 0 or noise here.
    logp = torch.tensor([-1.0])
    ref = logp + 1e-4
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5e-8, rel=1e-2)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_bfloat16_inputs(estimator):
    logp, ref = torch.tensor([-1.0, -2.0, -0.5, -3.0]), torch.tensor([-1.5, -1.0, -0.5, -2.75])
    out = kl_penalty(logp.bfloat16(), ref.bfloat16(), estimator)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), kl_penalty(logp, ref, estimator), rtol=1e-2, atol=1e-2)


def test_inputs_are_not_modified():
    logp, ref = LOGP.clone(), REF.clone()
    for name in KL_ESTIMATORS:
        kl_penalty(logp, ref, name)
    assert torch.equal(logp, LOGP) and torch.equal(ref, REF)


def test_unknown_estimator_raises_naming_allowed_values():
    with pytest.raises(ValueError, match=r"estimator: unknown 'k4'; allowed: 'k1', 'k2', 'k3'"):
        kl_penalty(LOGP, REF, "k4")


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="ref_logp"):
        kl_penalty(LOGP, REF[:2], "k1")


@settings(max_examples=50, deadline=None)
@given(
    logp=st.lists(st.floats(-20.0, 0.0, width=32), min_size=1, max_size=16),
    shift=st.lists(st.floats(-20.0, 20.0, width=32), min_size=16, max_size=16),
)
def test_k3_nonnegative_and_zero_on_identical_policies(logp, shift):
    lp = torch.tensor(logp)
    ref = lp + torch.tensor(shift[: len(logp)])
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    assert (kl_penalty(lp, ref, "k2") >= 0).all()
    for name in KL_ESTIMATORS:
        assert (kl_penalty(lp, lp.clone(), name) == 0).all()


def _categorical_kl_samples(logits_p, logits_q, n, seed):
    logp_all = torch.log_softmax(logits_p.double(), -1)
    logq_all = torch.log_softmax(logits_q.double(), -1)
    exact = (logp_all.exp() * (logp_all - logq_all)).sum().item()  # KL(p || q)
    x = torch.multinomial(logp_all.exp(), n, replacement=True, generator=torch.Generator().manual_seed(seed))
    return logp_all[x], logq_all[x], exact


# two clearly different categorical distributions over 6 outcomes (KL(p || q) ≈ 0.83)
P_LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -0.5])
Q_LOGITS = torch.tensor([0.0, 1.5, 0.5, 0.0, -1.0, 1.0])


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_k1_and_k3_are_unbiased_estimates_of_kl(estimator):
    logp, logq, exact = _categorical_kl_samples(P_LOGITS, Q_LOGITS, 200_000, seed=0)
    assert exact > 0.5  # the policies differ a lot, so bias would show
    est = kl_penalty(logp, logq, estimator)
    stderr = est.std().item() / math.sqrt(est.numel())
    assert abs(est.mean().item() - exact) < 5 * stderr
    assert abs(est.mean().item() - exact) < 0.02 * exact


def test_k2_is_biased_for_distant_policies():
    logp, logq, exact = _categorical_kl_samples(P_LOGITS, Q_LOGITS, 200_000, seed=0)
    est = kl_penalty(logp, logq, "k2")
    stderr = est.std().item() / math.sqrt(est.numel())
    assert abs(est.mean().item() - exact) > 20 * stderr


def test_k3_has_lower_variance_than_k1_for_close_policies():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    logp, logq, exact = _categorical_kl_samples(
        logits, logits + torch.tensor([0.1, -0.1, 0.05, 0.0]), 50_000, 1
    )
    k1, k3 = kl_penalty(logp, logq, "k1"), kl_penalty(logp, logq, "k3")
    assert k3.var().item() < 0.1 * k1.var().item()
    assert abs(k3.mean().item() - exact) < 5 * k3.std().item() / math.sqrt(k3.numel())


def test_gradients_match_hand_derivation():
    # d/dlogp: k1 -> 1; k2 -> logp - ref; k3 -> 1 - exp(ref - logp)
    expected = {
        "k1": torch.ones(3),
        "k2": torch.tensor([0.5, -1.0, 0.0]),
        "k3": torch.tensor([1.0 - math.exp(-0.5), 1.0 - math.e, 0.0]),
    }
    for name, grad in expected.items():
        logp = LOGP.clone().requires_grad_(True)
        ref = REF.clone().requires_grad_(True)
        kl_penalty(logp, ref, name).sum().backward()
        torch.testing.assert_close(logp.grad, grad)
        # each estimator depends on logp - ref only, so d/dref = -d/dlogp
        torch.testing.assert_close(ref.grad, -grad)


def test_gradient_flows_through_bfloat16():
    logp = LOGP.bfloat16().requires_grad_(True)
    kl_penalty(logp, REF.bfloat16(), "k3").sum().backward()
    assert logp.grad.dtype == torch.bfloat16
    torch.testing.assert_close(
        logp.grad.float(), torch.tensor([1.0 - math.exp(-0.5), 1.0 - math.e, 0.0]), rtol=2e-2, atol=2e-2
    )


# kl_shaped_rewards -------------------------------------------------------------------------------

SCORES = torch.tensor([2.0, -3.0, 0.5, 4.0])
KL = torch.tensor([[0.1, 0.2, NAN, 0.4], [0.5, INF, 0.7, 0.8], [1.0, 1.0, 1.0, 1.0], [0.2, NAN, NAN, NAN]])
HOLEY = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)


def test_kl_shaped_rewards_holey_mask_hand_case():
    out = kl_shaped_rewards(SCORES, KL, HOLEY, kl_coef=0.5)
    expected = torch.tensor(
        [
            [-0.05, -0.1, 0.0, -0.2 + 2.0],  # last real token is 3
            [-0.25, 0.0, -0.35 - 3.0, 0.0],  # last real token is 2, not sum(mask) - 1 = 1
            [0.0, 0.0, 0.0, 0.0],  # empty row: no KL, score dropped
            [-0.1 + 4.0, 0.0, 0.0, 0.0],  # only the first token is real
        ]
    )
    torch.testing.assert_close(out, expected)


def test_kl_shaped_rewards_clip():
    out = kl_shaped_rewards(SCORES, KL, HOLEY, kl_coef=0.5, clip=1.0)
    expected = torch.tensor(
        [
            [-0.05, -0.1, 0.0, -0.2 + 1.0],
            [-0.25, 0.0, -0.35 - 1.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [-0.1 + 1.0, 0.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected)


def test_kl_shaped_rewards_with_zero_coef_is_score_on_last_token():
    out = kl_shaped_rewards(SCORES, KL, HOLEY, kl_coef=0.0)
    expected = torch.zeros(4, 4)
    expected[0, 3], expected[1, 2], expected[3, 0] = 2.0, -3.0, 4.0
    torch.testing.assert_close(out, expected)


def test_kl_shaped_rewards_does_not_modify_inputs_and_accepts_int_mask():
    scores, kl, mask = SCORES.clone(), KL.clone(), HOLEY.long()
    out = kl_shaped_rewards(scores, kl, mask, kl_coef=0.5, clip=1.0)
    torch.testing.assert_close(out, kl_shaped_rewards(SCORES, KL, HOLEY, kl_coef=0.5, clip=1.0))
    torch.testing.assert_close(scores, SCORES)
    torch.testing.assert_close(kl, KL, equal_nan=True)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), coef=st.floats(0.0, 2.0))
def test_kl_shaped_rewards_row_sum(seed, coef):
    gen = torch.Generator().manual_seed(seed)
    scores, kl = torch.randn(6, generator=gen), torch.randn(6, 9, generator=gen)
    mask = torch.rand(6, 9, generator=gen) < 0.5
    out = kl_shaped_rewards(scores, kl, mask, kl_coef=coef)
    expected = -coef * torch.where(mask, kl, 0.0).sum(1) + torch.where(mask.any(1), scores, 0.0)
    torch.testing.assert_close(out.sum(1), expected, rtol=1e-5, atol=1e-5)
    assert (out[~mask] == 0).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scores": torch.zeros(4, 1)}, "scores"),
        ({"kl": torch.zeros(3, 4)}, "kl"),
        ({"mask": torch.ones(4, 3, dtype=torch.bool)}, "mask"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"clip": 0.0}, "clip"),
    ],
)
def test_kl_shaped_rewards_errors(kwargs, match):
    args = {"scores": SCORES, "kl": KL, "mask": HOLEY, "kl_coef": 0.1, "clip": None} | kwargs
    with pytest.raises(ValueError, match=f"^{match}:"):
        kl_shaped_rewards(**args)


def test_sequence_kl_sums_real_tokens():
    logp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -INF, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -1.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    torch.testing.assert_close(sequence_kl(logp, ref, mask), torch.tensor([0.5 - 1.0, 0.0 + 1.0]))
    torch.testing.assert_close(sequence_kl(logp, ref, mask, "k2"), torch.tensor([0.125 + 0.5, 0.5]))


def test_adaptive_kl_controller_moves_toward_its_target():
    kl = KLController(0.1, target=1.0, horizon=100)
    kl.update(kl=3.0, n=10)  # too much KL: error clipped at +0.2 -> coef * (1 + 0.2 * 10 / 100)
    assert kl.value == pytest.approx(0.1 * 1.02)
    kl.update(kl=0.0, n=10)
    assert kl.value == pytest.approx(0.1 * 1.02 * 0.98)
    fixed = KLController(0.1)
    fixed.update(kl=5.0, n=10)
    assert fixed.value == 0.1
