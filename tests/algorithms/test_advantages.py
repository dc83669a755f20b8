"""Advantage estimators: group baselines (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline, by group id),
discounted returns and GAE, including masks with holes and garbage in masked positions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.algorithms import (
    discounted_returns,
    gae,
    group_advantages,
    grpo_advantages,
    informative_groups,
    leave_one_out_advantages,
    reinforce_baseline_advantages,
    rloo_advantages,
)

NAN, INF = float("nan"), float("inf")


# group estimators ---------------------------------------------------------------------------------


def test_rloo_matches_trl_example():
    # TRL's test_rloo_reward lays out rewards as [K completions, 3 prompts]; lmrl groups are
    # contiguous, so prompt j's completions are column j.
    trl_layout = torch.tensor([[1.0, 2.0, 3.0], [2.0, 3.0, 4.0], [5.0, 6.0, 7.0], [8.0, 9.0, 10.0]])
    rewards = trl_layout.T.reshape(-1)  # [1, 2, 5, 8, 2, 3, 6, 9, 3, 4, 7, 10]
    adv = rloo_advantages(rewards, group_size=4)
    assert adv[0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)  # first reward of the first prompt
    assert adv[6].item() == pytest.approx(6 - (2 + 3 + 9) / 3)  # third reward of the second prompt
    # each group here is {x, x+1, x+4, x+7}: the same advantages (4r - sum) / 3 in every group
    expected = torch.tensor([-4.0, -8.0 / 3.0, 4.0 / 3.0, 16.0 / 3.0]).repeat(3)
    torch.testing.assert_close(adv, expected)
    # back in TRL's layout, TRL's numbers: [K, P] with adv[k, p] for completion k of prompt p
    torch.testing.assert_close(adv.view(3, 4).T, expected.view(3, 4).T)


@settings(max_examples=50, deadline=None)
@given(
    group_size=st.integers(2, 8),
    num_groups=st.integers(1, 4),
    data=st.data(),
)
def test_rloo_advantages_of_a_group_sum_to_zero(group_size, num_groups, data):
    values = data.draw(
        st.lists(
            st.floats(-100, 100, width=32), min_size=group_size * num_groups, max_size=group_size * num_groups
        )
    )
    adv = rloo_advantages(torch.tensor(values), group_size).view(num_groups, group_size)
    tol = 1e-5 * group_size * max(1.0, max(abs(v) for v in values))
    assert (adv.sum(1).abs() <= tol).all()
    # and each entry is r minus the mean of the others, checked one by one
    r = torch.tensor(values, dtype=torch.float64).view(num_groups, group_size)
    others = (r.sum(1, keepdim=True) - r) / (group_size - 1)
    torch.testing.assert_close(adv.double(), r - others, rtol=1e-5, atol=tol)


def test_grpo_hand_case_with_unbiased_std():
    adv = grpo_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 1.0, 1.0]), group_size=4)
    std1 = math.sqrt(5.0 / 3.0)  # deviations ±1.5, ±0.5: (2.25 + 0.25 + 0.25 + 2.25) / (4 - 1)
    std2 = math.sqrt(1.0 / 3.0)  # deviations ±0.5: 4 · 0.25 / (4 - 1)
    expected = torch.tensor(
        [-1.5 / std1, -0.5 / std1, 0.5 / std1, 1.5 / std1] + [-0.5 / std2] * 2 + [0.5 / std2] * 2
    )
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1.0, 2.9, -3.3, 12345.678])
def test_group_of_identical_rewards_gives_zero(value):
    # With 7 copies of 0.1 (float32), r - r.mean() is not exactly 0 and a naive
    # (r - mean) / (std + 1e-8) gives about -0.41 instead of 0.
    rewards = torch.tensor([value] * 7 + [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    ids = torch.arange(14) // 7
    for adv in (
        grpo_advantages(rewards, 7),
        grpo_advantages(rewards, 7, scale_by_std=False),
        rloo_advantages(rewards, 7),
        group_advantages(rewards, ids),
        leave_one_out_advantages(rewards, ids),
    ):
        assert torch.isfinite(adv).all()
        assert (adv[:7] == 0).all()  # exactly 0: rounding in the mean is not amplified by a ~0 std
        assert (adv[7:] != 0).all()


def test_group_size_one_gives_zero():
    rewards = torch.tensor([0.3, -2.0, 5.0])
    assert (grpo_advantages(rewards, 1) == 0).all()
    assert (reinforce_baseline_advantages(rewards, 1) == 0).all()


def test_dr_grpo_and_reinforce_baseline_equal_r_minus_group_mean():
    rewards = torch.randn(24, generator=torch.Generator().manual_seed(0))
    expected = (rewards.view(4, 6) - rewards.view(4, 6).mean(1, keepdim=True)).reshape(-1)
    torch.testing.assert_close(grpo_advantages(rewards, 6, scale_by_std=False), expected)
    torch.testing.assert_close(reinforce_baseline_advantages(rewards, 6), expected)


def test_grpo_scale_by_std_against_torch_std():
    rewards = torch.randn(24, generator=torch.Generator().manual_seed(1))
    g = rewards.view(4, 6)
    expected = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-8)).reshape(-1)
    torch.testing.assert_close(grpo_advantages(rewards, 6), expected)


def test_group_advantages_unequal_groups_hand_case():
    rewards = torch.tensor([1.0, 5.0, 2.0, 3.0, 7.0, 9.0])
    ids = torch.tensor([10, -3, 10, 10, 99, -3])  # groups {1, 2, 3}, {5, 9}, {7}
    s = 1 / math.sqrt(2.0)  # group {5, 9}: mean 7, unbiased std sqrt(8), deviations ±2
    torch.testing.assert_close(group_advantages(rewards, ids), torch.tensor([-1.0, -s, 0.0, 1.0, 0.0, s]))
    torch.testing.assert_close(
        group_advantages(rewards, ids, scale_by_std=False), torch.tensor([-1.0, -2.0, 0.0, 1.0, 0.0, 2.0])
    )
    # leave-one-out: n / (n - 1) · (r - mean); size-1 group gives 0
    torch.testing.assert_close(
        leave_one_out_advantages(rewards, ids), torch.tensor([-1.5, -4.0, 0.0, 1.5, 0.0, 4.0])
    )


def test_group_advantages_equal_contiguous_groups_match_fixed_size_versions():
    gen = torch.Generator().manual_seed(2)
    rewards = torch.randn(20, generator=gen)
    ids = torch.arange(20) // 4
    torch.testing.assert_close(group_advantages(rewards, ids), grpo_advantages(rewards, 4))
    torch.testing.assert_close(
        group_advantages(rewards, ids, scale_by_std=False), grpo_advantages(rewards, 4, scale_by_std=False)
    )
    torch.testing.assert_close(leave_one_out_advantages(rewards, ids), rloo_advantages(rewards, 4))
    # shuffling samples (with their ids) only shuffles the result
    perm = torch.randperm(20, generator=gen)
    torch.testing.assert_close(
        group_advantages(rewards[perm], ids[perm] * 1000 - 7), grpo_advantages(rewards, 4)[perm]
    )


def test_group_estimators_do_not_modify_inputs_and_accept_int_rewards():
    rewards, ids = torch.tensor([1, 0, 1, 1]), torch.tensor([0, 0, 1, 1])
    before = rewards.clone(), ids.clone()
    out = grpo_advantages(rewards, 2)
    assert out.dtype == torch.float32
    # group {1, 0}: deviations ±0.5, unbiased std sqrt(0.5); group {1, 1}: 0
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, 0.0, 0.0]) / math.sqrt(0.5))
    group_advantages(rewards, ids)
    rloo_advantages(rewards, 2)
    assert torch.equal(rewards, before[0]) and torch.equal(ids, before[1])


def test_group_estimators_bfloat16_close_to_float32():
    rewards = torch.rand(32, generator=torch.Generator().manual_seed(3))
    bf = rewards.bfloat16()
    ids = torch.arange(32) // 8
    for fn in (
        lambda r: grpo_advantages(r, 8),
        lambda r: rloo_advantages(r, 8),
        lambda r: group_advantages(r, ids),
    ):
        out = fn(bf)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), fn(bf.float()), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out.float(), fn(rewards), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: grpo_advantages(torch.zeros(6), 4),
            ValueError,
            "group_size: batch of 6 rewards is not divisible by 4",
        ),
        (lambda: grpo_advantages(torch.zeros(6), 0), ValueError, "group_size: must be >= 1"),
        (lambda: grpo_advantages(torch.zeros(6), 2.0), TypeError, "group_size"),
        (lambda: rloo_advantages(torch.zeros(6), 1), ValueError, "group_size: must be >= 2"),
        (lambda: grpo_advantages(torch.zeros(2, 3), 3), ValueError, "rewards: expected a 1-D"),
        (lambda: reinforce_baseline_advantages(torch.zeros(2, 3), 3), ValueError, "rewards"),
        (lambda: group_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long)), ValueError, "group_ids"),
        (lambda: group_advantages(torch.zeros(4), torch.zeros(4)), TypeError, "group_ids"),
        (
            lambda: leave_one_out_advantages(torch.zeros(2, 2), torch.zeros(2, 2).long()),
            ValueError,
            "rewards",
        ),
        (
            lambda: discounted_returns(torch.zeros(4), torch.ones(4), 0.9),
            ValueError,
            "rewards: expected a 2-D",
        ),
        (lambda: discounted_returns(torch.zeros(2, 4), torch.ones(2, 3), 0.9), ValueError, "mask"),
        (lambda: discounted_returns(torch.zeros(2, 4), torch.ones(2, 4), 1.1), ValueError, "gamma"),
        (lambda: gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 4), 0.9, 0.9), ValueError, "values"),
        (lambda: gae(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 3), 0.9, 0.9), ValueError, "mask"),
        (lambda: gae(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), -0.1, 0.9), ValueError, "gamma"),
        (lambda: gae(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), 0.9, 1.5), ValueError, "lam"),
    ],
)
def test_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=f"^{match}"):
        call()


def test_informative_groups():
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3]), 2).tolist() == [False, True, False]


# per-token estimators -----------------------------------------------------------------------------


def test_discounted_returns_hand_case():
    rewards = torch.tensor([[1.0, 2.0, 99.0, 4.0], [1.0, 1.0, 1.0, NAN]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]], dtype=torch.bool)
    # row 0 skips the hole: G3 = 4, G1 = 2 + 0.5 · 4 = 4, G0 = 1 + 0.5 · 4 = 3
    # row 1: G2 = 1, G1 = 1.5, G0 = 1.75
    expected = torch.tensor([[3.0, 4.0, 0.0, 4.0], [1.75, 1.5, 1.0, 0.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma=0.5), expected)
    # γ = 1: plain reward-to-go; γ = 0: the reward itself
    torch.testing.assert_close(
        discounted_returns(rewards, mask, gamma=1.0),
        torch.tensor([[7.0, 6.0, 0.0, 4.0], [3.0, 2.0, 1.0, 0.0]]),
    )
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma=0.0), torch.where(mask, rewards, 0.0))


def test_gae_hand_case_with_hole():
    values = torch.tensor([[0.5, NAN, 0.25]])
    rewards = torch.tensor([[0.0, INF, 1.0]])
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    # t=2: δ = 1 - 0.25 = 0.75, A = 0.75; t=0 bootstraps from t=2: δ = 0 + 0.25 - 0.5, A = -0.25 + 0.5 · 0.75
    adv, ret = gae(values, rewards, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.0, 0.75]]))
    torch.testing.assert_close(ret, torch.tensor([[0.625, 0.0, 1.0]]))


def test_gae_lam_zero_gives_one_step_td_errors():
    values, rewards = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.0, 0.0, 1.0]])
    result = gae(values, rewards, torch.ones(1, 3), gamma=0.9, lam=0.0)
    # δ_t = r_t + 0.9 · V_{t+1} - V_t, with V = 0 after the last token
    torch.testing.assert_close(result.advantages, torch.tensor([[0.8, 0.7, -2.0]]))
    torch.testing.assert_close(result.returns, torch.tensor([[1.8, 2.7, 1.0]]))


def _naive_gae(values, rewards, mask, gamma, lam):
    """Plain-Python reference: loop over each row's real tokens only, backwards."""
    batch, steps = len(values), len(values[0])
    adv = [[0.0] * steps for _ in range(batch)]
    ret = [[0.0] * steps for _ in range(batch)]
    for b in range(batch):
        next_value, next_adv = 0.0, 0.0
        for t in reversed([t for t in range(steps) if mask[b][t]]):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[b][t]
            adv[b][t], ret[b][t] = next_adv, next_adv + values[b][t]
    return torch.tensor(adv), torch.tensor(ret)


def _random_case(seed, batch=6, steps=17, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, steps, generator=gen, dtype=dtype)
    rewards = torch.randn(batch, steps, generator=gen, dtype=dtype)
    mask = torch.rand(batch, steps, generator=gen) < 0.7  # holes everywhere
    mask[0] = False  # an empty row
    mask[1, -5:] = False  # right padding
    return values, rewards, mask


@pytest.mark.parametrize("steps", [17, 150])  # one block of the vectorised scan, and several
@pytest.mark.parametrize("holes", [True, False])  # packed path, and plain right padding
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7), (0.0, 0.3)])
def test_gae_matches_naive_loop(gamma, lam, steps, holes):
    values, rewards, mask = _random_case(seed=4, steps=steps)
    if not holes:  # each row real up to a random length
        lengths = torch.randint(0, steps + 1, (mask.shape[0],), generator=torch.Generator().manual_seed(5))
        mask = torch.arange(steps) < lengths[:, None]
    expected_adv, expected_ret = _naive_gae(values.tolist(), rewards.tolist(), mask.tolist(), gamma, lam)
    adv, ret = gae(values, rewards, mask, gamma, lam)
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)


def _naive_returns(rewards, mask, gamma):
    out = [[0.0] * len(rewards[0]) for _ in rewards]
    for b, row in enumerate(rewards):
        running = 0.0
        for t in reversed([t for t in range(len(row)) if mask[b][t]]):
            running = row[t] + gamma * running
            out[b][t] = running
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("gamma", [1.0, 0.999, 0.9, 0.3, 0.0])
def test_discounted_returns_long_sequences_match_naive_loop(gamma):
    # T = 64 · 64 + 37 exercises two levels of the blockwise scan
    steps = 64 * 64 + 37
    gen = torch.Generator().manual_seed(11)
    rewards = torch.randn(2, steps, generator=gen, dtype=torch.float64)
    mask = torch.rand(2, steps, generator=gen) < 0.9
    expected = _naive_returns(rewards.tolist(), mask.tolist(), gamma)
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma), expected, rtol=1e-10, atol=1e-9)
    # float32 in: float32 out, and accurate to float32 rounding of the result
    out32 = discounted_returns(rewards.float(), mask, gamma)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("gamma", [1.0, 0.97, 0.5])
def test_gae_lam_one_zero_values_equals_discounted_returns(gamma):
    _, rewards, mask = _random_case(seed=5, steps=150)
    returns = discounted_returns(rewards, mask, gamma)
    adv, ret = gae(torch.zeros_like(rewards), rewards, mask, gamma, lam=1.0)
    torch.testing.assert_close(adv, returns)
    torch.testing.assert_close(ret, returns)
    # with any values, λ = 1 telescopes to A_t = G_t - V_t
    values = torch.randn(rewards.shape, generator=torch.Generator().manual_seed(6))
    adv, ret = gae(values, rewards, mask, gamma, lam=1.0)
    torch.testing.assert_close(adv, torch.where(mask, returns - values, 0.0))
    torch.testing.assert_close(ret, returns)


@pytest.mark.parametrize("garbage", [NAN, INF, -INF, 1e30])
def test_masked_entries_never_change_per_token_results(garbage):
    values, rewards, mask = _random_case(seed=7)
    dirty_v = torch.where(mask, values, garbage)
    dirty_r = torch.where(mask, rewards, garbage)
    adv, ret = gae(values, rewards, mask, 0.99, 0.95)
    dirty_adv, dirty_ret = gae(dirty_v, dirty_r, mask, 0.99, 0.95)
    torch.testing.assert_close(dirty_adv, adv)
    torch.testing.assert_close(dirty_ret, ret)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    returns = discounted_returns(rewards, mask, 0.9)
    torch.testing.assert_close(discounted_returns(dirty_r, mask, 0.9), returns)
    assert (returns[~mask] == 0).all()


def test_per_token_estimators_do_not_modify_inputs_and_accept_int_mask():
    values, rewards, mask = _random_case(seed=8)
    copies = values.clone(), rewards.clone(), mask.clone()
    adv, _ = gae(values, rewards, mask.long(), 0.9, 0.8)
    torch.testing.assert_close(adv, gae(values, rewards, mask, 0.9, 0.8).advantages)
    discounted_returns(rewards, mask.float(), 0.9)
    assert torch.equal(values, copies[0]) and torch.equal(rewards, copies[1]) and torch.equal(mask, copies[2])


def test_per_token_estimators_bfloat16_close_to_float32():
    values, rewards, mask = _random_case(seed=9, steps=64)
    vb, rb = values.bfloat16(), rewards.bfloat16()
    adv, ret = gae(vb, rb, mask, 0.99, 0.95)
    assert adv.dtype == ret.dtype == torch.bfloat16
    ref_adv, ref_ret = gae(vb.float(), rb.float(), mask, 0.99, 0.95)
    # accumulation runs in float32: only the final rounding to bfloat16 differs (rel. 2^-8)
    torch.testing.assert_close(adv.float(), ref_adv, rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(ret.float(), ref_ret, rtol=8e-3, atol=1e-2)
    returns = discounted_returns(rb, mask, 0.99)
    assert returns.dtype == torch.bfloat16
    torch.testing.assert_close(
        returns.float(), discounted_returns(rb.float(), mask, 0.99), rtol=8e-3, atol=1e-2
    )


def test_empty_time_dimension():
    empty = torch.zeros(3, 0)
    assert discounted_returns(empty, empty.bool(), 0.9).shape == (3, 0)
    adv, ret = gae(empty, empty, empty.bool(), 0.9, 0.9)
    assert adv.shape == ret.shape == (3, 0)
