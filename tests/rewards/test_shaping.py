"""Reward shaping: hand-computed cases for each function, plus properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.config import load_config
from lmrl.rewards.shaping import (
    clip_rewards,
    missing_eos_penalty,
    normalize_rewards,
    overlong_filter_mask,
    overlong_penalty,
    shape_scores,
)
from tests.test_experience import SCORES, rollout


def test_missing_eos_penalty_hand_computed():
    scores = torch.tensor([1.0, 0.5, -0.2, 0.0])
    finished = torch.tensor([True, False, False, True])
    out = missing_eos_penalty(scores, finished, penalty=1.0)
    torch.testing.assert_close(out, torch.tensor([1.0, -0.5, -1.2, 0.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.5, -0.2, 0.0]))  # input unchanged
    # 0/1 ints work like bools
    out01 = missing_eos_penalty(scores, torch.tensor([1, 0, 0, 1]), penalty=0.25)
    torch.testing.assert_close(out01, torch.tensor([1.0, 0.25, -0.45, 0.0]), rtol=0, atol=1e-6)


def test_missing_eos_penalty_validates():
    with pytest.raises(ValueError, match="penalty: must be >= 0"):
        missing_eos_penalty(torch.zeros(2), torch.ones(2, dtype=torch.bool), -1.0)
    with pytest.raises(ValueError, match="finished: shape"):
        missing_eos_penalty(torch.zeros(2), torch.ones(3, dtype=torch.bool), 1.0)


def test_overlong_penalty_dapo_eq13():
    # L_max = 20, L_cache = 4: no penalty up to 16, linear to -1 at 20, -1 beyond
    lengths = torch.tensor([0, 10, 16, 17, 18, 20, 21, 100])
    out = overlong_penalty(lengths, max_length=20, cache_length=4)
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert out.dtype == torch.float32


def test_overlong_penalty_zero_cache_is_hard_cutoff():
    out = overlong_penalty(torch.tensor([5, 10, 11]), max_length=10, cache_length=0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -1.0]))


def test_overlong_penalty_validates():
    with pytest.raises(ValueError, match="cache_length: must be in"):
        overlong_penalty(torch.tensor([1]), max_length=10, cache_length=11)
    with pytest.raises(ValueError, match="max_length: must be > 0"):
        overlong_penalty(torch.tensor([1]), max_length=0, cache_length=0)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=20),
    max_length=st.integers(1, 200),
    frac=st.floats(0.0, 1.0),
)
def test_overlong_penalty_is_monotone_and_bounded(lengths, max_length, frac):
    cache = int(frac * max_length)
    ls = torch.tensor(sorted(lengths))
    out = overlong_penalty(ls, max_length, cache)
    assert ((out <= 0) & (out >= -1)).all()
    assert (out[1:] <= out[:-1] + 1e-6).all()  # longer never scores better
    assert (out[ls > max_length] == -1).all()
    assert (out[ls <= max_length - cache] == 0).all()


def test_overlong_filter_mask():
    finished = torch.tensor([True, False, True])
    keep = overlong_filter_mask(finished)
    assert keep.dtype == torch.bool and keep.tolist() == [True, False, True]
    mask = torch.ones(3, 4, dtype=torch.bool)
    assert (mask & keep[:, None]).sum().item() == 8
    assert overlong_filter_mask(torch.tensor([0, 1])).tolist() == [False, True]
    with pytest.raises(ValueError, match=r"finished: expected a \[B\] tensor"):
        overlong_filter_mask(torch.ones(2, 2))


def test_clip_rewards():
    out = clip_rewards(torch.tensor([-3.0, -0.5, 0.0, 2.0, 10.0]), 1.5)
    torch.testing.assert_close(out, torch.tensor([-1.5, -0.5, 0.0, 1.5, 1.5]))
    with pytest.raises(ValueError, match="clip: must be > 0"):
        clip_rewards(torch.zeros(2), 0.0)


def test_clip_rewards_to_a_range():
    # OpenRLHF's reward_clip_range: [low, high], not symmetric
    out = clip_rewards(torch.tensor([-3.0, -0.5, 0.0, 2.0, 10.0]), (-1.0, 5.0))
    torch.testing.assert_close(out, torch.tensor([-1.0, -0.5, 0.0, 2.0, 5.0]))
    out = clip_rewards(torch.tensor([-3.0, 0.7, 2.0]), (0.5, 1.0))  # a range above zero
    torch.testing.assert_close(out, torch.tensor([0.5, 0.7, 1.0]))
    for bad in [(1.0, 1.0), (2.0, -2.0), (1.0,)]:
        with pytest.raises(ValueError, match="clip: a range must be"):
            clip_rewards(torch.zeros(2), bad)


def test_normalize_rewards_hand_computed():
    # mean 2, unbiased std of [1, 2, 3] = 1
    out = normalize_rewards(torch.tensor([1.0, 2.0, 3.0]), eps=0.0)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 1.0]), rtol=0, atol=1e-6)
    # [0, 4]: mean 2, unbiased std = sqrt(8) -> -/+ 2/sqrt(8)
    out = normalize_rewards(torch.tensor([0.0, 4.0]), eps=0.0)
    torch.testing.assert_close(out, torch.tensor([-0.70710678, 0.70710678]), rtol=0, atol=1e-6)


def test_normalize_rewards_constant_and_single():
    torch.testing.assert_close(normalize_rewards(torch.full((4,), 3.0)), torch.zeros(4))
    torch.testing.assert_close(normalize_rewards(torch.tensor([5.0])), torch.zeros(1))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-100, 100), min_size=2, max_size=32))
def test_normalize_rewards_mean_zero_std_one(values):
    x = torch.tensor(values, dtype=torch.float64)
    if x.std() < 1e-3:
        return  # near-constant batches normalise to ~0, checked above
    out = normalize_rewards(x)
    assert abs(out.mean().item()) < 1e-6
    expected_std = (x.std() / (x.std() + 1e-8)).item()  # 1 up to the eps guarding equal scores
    assert abs(out.std().item() - expected_std) < 1e-9


def test_shape_scores_composes_penalties():
    r = rollout(lengths=(5, 3, 2, 4), finished=(True, True, False, True))
    cfg = load_config(None, ["reward.missing_eos_penalty=1.0", "reward.overlong_buffer=2", "rollout.max_new_tokens=5",
                             "reward.drop_truncated=true"]).reward
    scores, keep = shape_scores(r, SCORES, max_new_tokens=5, **cfg.shaping_options())
    # overlong: length 5 -> -1 (at limit: (3 - 5) / 2), length 4 -> -0.5; missing EOS: row 2 -1
    torch.testing.assert_close(scores, torch.tensor([0.0, 0.0, -0.5, 0.0]))
    assert keep.tolist() == [True, True, False, True]
