"""Tests of lmrl.algorithms.preference: the Bradley-Terry loss and the pair metrics, by hand and by property."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmrl.algorithms import PreferenceMetrics, bradley_terry_loss, preference_metrics

F64 = torch.float64


def _t(values, dtype=F64, requires_grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=requires_grad)


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_loss_by_hand():
    # differences: 2 - 1 = 1, 0 - 1 = -1, 3 - 3 = 0
    # loss_i = -log sigmoid(d_i) = log(1 + exp(-d_i)):
    #   d=1: log(1 + e^-1) = 0.3132617   d=-1: log(1 + e) = 1.3132617   d=0: log 2 = 0.6931472
    # mean = (0.3132617 + 1.3132617 + 0.6931472) / 3 = 0.7732235
    loss = bradley_terry_loss(_t([2.0, 0.0, 3.0]), _t([1.0, 1.0, 3.0]))
    assert loss.item() == pytest.approx(0.7732235, abs=1e-6)


def test_margin_by_hand():
    # d - m: (2 - 1) - 1 = 0, (0 - 1) - (-1) = 0  ->  both log 2, mean log 2 = 0.6931472
    loss = bradley_terry_loss(_t([2.0, 0.0]), _t([1.0, 1.0]), margin=_t([1.0, -1.0]))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)


def test_centering_by_hand():
    # Bradley-Terry part: d = 1 and -1 -> (0.3132617 + 1.3132617) / 2 = 0.8132617
    # centering: (2 + 1)^2 = 9, (0 + 1)^2 = 1 -> mean 5; times 0.01 = 0.05  ->  0.8632617
    loss = bradley_terry_loss(_t([2.0, 0.0]), _t([1.0, 1.0]), center_rewards_coefficient=0.01)
    assert loss.item() == pytest.approx(0.8632617, abs=1e-6)


def test_normalizer_lets_micro_batches_add_up():
    chosen, rejected = _t([2.0, 0.0, 3.0, -1.0]), _t([1.0, 1.0, 3.0, 0.5])
    whole = bradley_terry_loss(chosen, rejected, center_rewards_coefficient=0.1)
    halves = sum(bradley_terry_loss(chosen[i:i + 2], rejected[i:i + 2], center_rewards_coefficient=0.1, normalizer=4)
                 for i in (0, 2))
    assert halves.item() == pytest.approx(whole.item(), abs=1e-12)


def test_gradient_by_hand():
    # d/dr_c softplus(-(c - r)) / B = -sigmoid(-(c - r)) / B; with c - r = 0 and B = 1: -0.5, and +0.5 for r
    chosen, rejected = _t([1.0], requires_grad=True), _t([1.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    assert chosen.grad.item() == pytest.approx(-0.5) and rejected.grad.item() == pytest.approx(0.5)


def test_margin_carries_no_gradient():
    margin = _t([0.5], requires_grad=True)
    bradley_terry_loss(_t([1.0], requires_grad=True), _t([0.0]), margin=margin).backward()
    assert margin.grad is None


def test_metrics_by_hand():
    # chosen 2, 0, 3; rejected 1, 1, 3: chosen wins only the first (a tie is not a win) -> accuracy 1/3
    # margins 1, -1, 0 -> 0; chosen mean 5/3, rejected mean 5/3
    # all six rewards 2, 0, 3, 1, 1, 3: mean 10/6 = 1.6666667; squared deviations
    # 0.1111, 2.7778, 1.7778, 0.4444, 0.4444, 1.7778 -> sum 7.3333; / 5 = 1.4666667; sqrt = 1.2110601
    m = preference_metrics(_t([2.0, 0.0, 3.0]), _t([1.0, 1.0, 3.0]))
    assert isinstance(m, PreferenceMetrics)
    assert m.accuracy == pytest.approx(1 / 3)
    assert m.margin == pytest.approx(0.0, abs=1e-12)
    assert m.chosen == pytest.approx(5 / 3) and m.rejected == pytest.approx(5 / 3)
    assert m.reward_mean == pytest.approx(5 / 3)
    assert m.reward_std == pytest.approx(1.2110601, abs=1e-6)
    assert m.as_dict("rm/")["rm/accuracy"] == pytest.approx(1 / 3)


finite = st.floats(min_value=-30, max_value=30, allow_nan=False)


@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=8))
def test_loss_is_softplus_of_the_negative_difference(pairs):
    chosen, rejected = _t([c for c, _ in pairs]), _t([r for _, r in pairs])
    naive = sum(_softplus(-(c - r)) if c - r > -30 else -(c - r) + _softplus(c - r) for c, r in pairs) / len(pairs)
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(naive, rel=1e-9, abs=1e-12)


@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=8))
def test_swapping_sides(pairs):
    # softplus(-d) - softplus(d) = -d: swapping chosen and rejected changes the loss by the mean difference
    chosen, rejected = _t([c for c, _ in pairs]), _t([r for _, r in pairs])
    mean_diff = (chosen - rejected).mean().item()
    swapped = bradley_terry_loss(rejected, chosen).item()
    assert swapped - bradley_terry_loss(chosen, rejected).item() == pytest.approx(mean_diff, abs=1e-9)
    a, b = preference_metrics(chosen, rejected), preference_metrics(rejected, chosen)
    assert b.margin == pytest.approx(-a.margin, abs=1e-9)
    assert b.reward_std == pytest.approx(a.reward_std) and b.reward_mean == pytest.approx(a.reward_mean)
    assert a.accuracy + b.accuracy <= 1.0 + 1e-12  # a tie counts for neither side


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs(dtype):
    chosen = torch.linspace(-3, 3, 16, dtype=dtype)
    rejected = torch.linspace(2, -1, 16, dtype=dtype)
    loss = bradley_terry_loss(chosen, rejected, center_rewards_coefficient=0.01)
    assert loss.dtype == torch.float32  # upcast: bf16 rewards are not added up in bf16
    exact = bradley_terry_loss(chosen.to(F64), rejected.to(F64), center_rewards_coefficient=0.01)
    assert loss.item() == pytest.approx(exact.item(), rel=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="chosen, rejected: expected two"):
        bradley_terry_loss(_t([1.0, 2.0]), _t([1.0]))
    with pytest.raises(ValueError, match="no pairs"):
        bradley_terry_loss(_t([]), _t([]))
    with pytest.raises(ValueError, match="margin: expected shape"):
        bradley_terry_loss(_t([1.0]), _t([0.0]), margin=_t([1.0, 2.0]))
