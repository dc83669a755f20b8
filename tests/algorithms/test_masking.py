"""Masked reductions: hand cases, garbage in masked entries, empty rows, whitening statistics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.algorithms import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
MASK = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]], dtype=torch.bool)  # real: 1, 2, 4 | 6, 7


def test_masked_sum_and_mean_hand_case():
    assert masked_sum(X, MASK).item() == pytest.approx(20.0)
    assert masked_mean(X, MASK).item() == pytest.approx(4.0)
    torch.testing.assert_close(masked_sum(X, MASK, dim=1), torch.tensor([7.0, 13.0]))
    torch.testing.assert_close(masked_mean(X, MASK, dim=1), torch.tensor([7.0 / 3.0, 6.5]))
    torch.testing.assert_close(masked_mean(X, MASK, dim=0), torch.tensor([1.0, 4.0, 7.0, 4.0]))


def test_int_mask_same_as_bool_mask():
    torch.testing.assert_close(masked_mean(X, MASK.long(), dim=1), masked_mean(X, MASK, dim=1))


def test_masked_var_hand_case():
    # values 1, 2, 4, 6, 7: mean 4, squared deviations 9 + 4 + 0 + 4 + 9 = 26
    assert masked_var(X, MASK).item() == pytest.approx(26.0 / 4.0)
    assert masked_var(X, MASK, unbiased=False).item() == pytest.approx(26.0 / 5.0)


def test_masked_whiten_hand_case():
    std = math.sqrt(26.0 / 4.0)
    expected = torch.tensor([[-3.0, -2.0, 0.0, 0.0], [0.0, 2.0, 3.0, 0.0]]) / std
    torch.testing.assert_close(masked_whiten(X, MASK), expected)
    # shift_mean=False only rescales: the mean (4) is added back on real entries.
    expected_unshifted = torch.where(MASK, expected + 4.0, torch.zeros(()))
    torch.testing.assert_close(masked_whiten(X, MASK, shift_mean=False), expected_unshifted)


@pytest.mark.parametrize("garbage", [float("inf"), float("-inf"), float("nan"), 1e30])
def test_garbage_in_masked_entries_never_changes_results(garbage):
    dirty = torch.where(MASK, X, torch.tensor(garbage))
    torch.testing.assert_close(masked_sum(dirty, MASK), masked_sum(X, MASK))
    torch.testing.assert_close(masked_mean(dirty, MASK, dim=1), masked_mean(X, MASK, dim=1))
    torch.testing.assert_close(masked_var(dirty, MASK), masked_var(X, MASK))
    whitened = masked_whiten(dirty, MASK)
    assert torch.isfinite(whitened).all()
    torch.testing.assert_close(whitened, masked_whiten(X, MASK))


def test_empty_row_gives_zero():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    x = torch.tensor([[1.0, 3.0, 5.0, 7.0], [float("nan"), 1.0, 2.0, 3.0]])
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(masked_sum(x, mask, dim=1), torch.tensor([4.0, 0.0]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_var_unbiased_needs_two_entries():
    with pytest.raises(ValueError, match="2 masked entries"):
        masked_var(X, torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool))


def test_mask_shape_mismatch_raises():
    with pytest.raises(ValueError, match="mask"):
        masked_mean(X, torch.ones(3, 4, dtype=torch.bool))


def test_inputs_are_not_modified():
    x, mask = X.clone(), MASK.clone()
    masked_whiten(x, mask)
    masked_mean(x, mask, dim=1)
    torch.testing.assert_close(x, X)
    assert torch.equal(mask, MASK)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), cols=st.integers(2, 12))
def test_masked_whiten_has_mean_zero_and_unit_unbiased_std(seed, rows, cols):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 3.0 + 1.5
    mask = torch.rand(rows, cols, generator=gen) < 0.6
    mask[0, :2] = True  # at least two real entries
    x = torch.where(mask, x, torch.tensor(float("nan"), dtype=torch.float64))
    out = masked_whiten(x, mask, eps=0.0)
    real = out[mask]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert real.std(correction=1).item() == pytest.approx(1.0, abs=1e-9)
    assert (out[~mask] == 0).all()
