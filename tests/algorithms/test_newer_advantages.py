"""GPG, ReMax and pass@k advantages: values worked out by hand, and pass@k against brute-force enumeration."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lmrl.algorithms import gpg_advantages, grpo_advantages, pass_at_k_advantages, remax_advantages

F64 = torch.float64


def test_gpg_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64)  # group 0 informative, group 1 all equal
    a = 0.5 / math.sqrt(0.5)  # (1 - 0.5) / unbiased std of [1, 0]
    torch.testing.assert_close(gpg_advantages(r, 2, eps=0.0), torch.tensor([2 * a, -2 * a, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(gpg_advantages(r, 2, scale_by_std=False), torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(gpg_advantages(r, 2, scale_by_std=False, max_weight=1.5),
                               torch.tensor([0.75, -0.75, 0.0, 0.0], dtype=F64))
    assert (gpg_advantages(torch.ones(4), 2) == 0).all()
    # every group informative: alpha = 1, GRPO's advantages
    both = torch.tensor([1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(gpg_advantages(both, 2), grpo_advantages(both, 2))


def test_remax_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5])
    torch.testing.assert_close(remax_advantages(r, torch.tensor([0.5, 1.0]), 2), torch.tensor([0.5, -0.5, -0.5, -0.5]))
    with pytest.raises(ValueError, match="baseline"):
        remax_advantages(r, torch.tensor([0.5]), 2)


def test_pass_at_k_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)
    # N = 4, c = 1, k = 2: mean = 1 - C(3,2)/C(4,2) = 1/2, std = 1/2; A+ = 1; A- = (1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3
    torch.testing.assert_close(pass_at_k_advantages(r, 4, 2), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3], dtype=F64))
    # k = 1 is GRPO with the population std
    pop = (r - r.mean()) / r.std(unbiased=False)
    torch.testing.assert_close(pass_at_k_advantages(r, 4, 1), pop)
    # every k-subset solved (c > N - k) or none (c = 0): 0
    assert (pass_at_k_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0]), 4, 2) == 0).all()
    assert (pass_at_k_advantages(torch.zeros(4), 4, 2) == 0).all()
    with pytest.raises(ValueError, match="k: must be"):
        pass_at_k_advantages(r, 4, 5)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("rewards", [[1, 0, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 1, 0]])
def test_pass_at_k_equals_the_mean_advantage_of_the_subsets_containing_each_sample(rewards, k):
    r = torch.tensor(rewards, dtype=F64)
    n = len(rewards)
    subsets = list(itertools.combinations(range(n), k))
    values = torch.tensor([float(any(rewards[i] for i in s)) for s in subsets], dtype=F64)
    std = values.std(unbiased=False)
    norm = (values - values.mean()) / std if std > 0 else torch.zeros_like(values)
    want = torch.tensor([norm[[j for j, s in enumerate(subsets) if i in s]].mean().item() for i in range(n)], dtype=F64)
    torch.testing.assert_close(pass_at_k_advantages(r, n, k), want)
