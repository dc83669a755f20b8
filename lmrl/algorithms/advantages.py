"""Advantage estimators: group baselines (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline) and PPO's GAE.

Group estimators take one scalar reward per completion, [B] with B = num_prompts · G, groups
contiguous (sample i belongs to group i // G), and return one advantage per completion, [B], that the
loss broadcasts over the completion's tokens. `group_advantages` / `leave_one_out_advantages` take
arbitrary integer group ids instead, for groups of unequal size (e.g. TapeAgents' ``group_id``, or
after filtering samples).

Token-level estimators (`discounted_returns`, `gae`) take [B, T] per-token rewards, e.g. from
`lmrl.algorithms.kl.kl_shaped_rewards`.

`informative_groups` marks the groups whose rewards are not all equal, the only ones with a signal
(DAPO's dynamic sampling keeps these).

How lmrl departs from the usual implementations:

1. Masks may have holes (environment or tool tokens inside a response). Returns and GAE skip masked
   positions: the next *real* token bootstraps, as if the masked tokens were not there. Masked
   positions of the outputs are 0, and whatever they hold in the inputs (inf, NaN) never matters.
2. After the last real token the episode ends: V = 0 there (no bootstrap for truncated responses,
   as in PPO-RLHF practice).
3. A group whose rewards are all equal gets advantage exactly 0 (statistics are computed around a
   member of the group, so rounding in the mean cannot be blown up by a ~0 std). A group of size 1
   has no baseline to compare against: its advantage is 0.
4. Group statistics run in float32 (float64 stays float64), the return / GAE scans in float64
   (float32 on MPS); results are cast back to the input dtype, so bfloat16 in gives bfloat16 out
   without bfloat16 accumulation.
5. Returns and GAE have no Python loop over T: real tokens are packed to the front of each row and
   the backward recursion is solved blockwise with small matmuls.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

__all__ = [
    "GAEResult",
    "batch_std_advantages",
    "clip_filter_like_weights",
    "discounted_returns",
    "gae",
    "gpg_advantages",
    "grpo_advantages",
    "group_advantages",
    "informative_groups",
    "leave_one_out_advantages",
    "pass_at_k_advantages",
    "reinforce_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
]


def _float_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, output dtype): at least float32 to compute, the input's float dtype out."""
    work = torch.promote_types(dtype, torch.float32)
    return work, (dtype if dtype.is_floating_point else work)


def _check_rewards_1d(rewards: torch.Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D [B] tensor, got shape {tuple(rewards.shape)}")


def _grouped(rewards: torch.Tensor, group_size: int, min_size: int = 1) -> torch.Tensor:
    """Validate and reshape [B] rewards to [B / G, G] in the compute dtype."""
    _check_rewards_1d(rewards)
    if isinstance(group_size, bool):
        raise TypeError("group_size: expected an int, got bool")
    try:
        group_size = operator.index(group_size)  # int, numpy int, 0-d integer tensor
    except TypeError:
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}") from None
    if group_size < min_size:
        raise ValueError(f"group_size: must be >= {min_size}, got {group_size}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"group_size: batch of {rewards.shape[0]} rewards is not divisible by {group_size}")
    work, _ = _float_dtypes(rewards.dtype)
    return rewards.to(work).view(-1, group_size)


def _centered(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Deviations from the row mean, [N, G], and the unbiased row variance, [N, 1] (0 when G == 1).

    The mean is taken around the row's first element (shifted-data algorithm): a row of equal
    values then has deviations exactly 0, where ``r - r.mean()`` may leave rounding residue that a
    later division by a ~0 std would turn into ±1.
    """
    shifted = r - r[:, :1]
    dev = shifted - shifted.mean(dim=1, keepdim=True)
    var = dev.square().sum(dim=1, keepdim=True) / max(r.shape[1] - 1, 1)
    return dev, var


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """GRPO group-normalised advantages: A_i = (r_i - mean(group)) / (std(group) + eps).

    Shao et al. 2024, "DeepSeekMath" (GRPO, outcome supervision, §4.1.2). The std is unbiased
    (n - 1), as ``torch.std``. With ``scale_by_std=False`` this is Dr. GRPO's A_i = r_i - mean(group)
    (Liu et al. 2025, "Understanding R1-Zero-Like Training"): dividing by the std up-weights prompts
    that are nearly always or nearly never solved.

    Args:
        rewards: [B] one scalar reward per completion, B = num_prompts · G, groups contiguous.
        group_size: G, completions per prompt (>= 1). G = 1 gives all-zero advantages.
        scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std; a group of equal rewards gets exactly 0 regardless.

    Returns:
        [B] advantages in the dtype of `rewards` (float32 for integer rewards).
    """
    r = _grouped(rewards, group_size)  # [B/G, G]
    dev, var = _centered(r)
    # (a group of equal rewards has dev exactly 0: where() keeps it 0 with eps = 0 too, not 0 / 0)
    adv = torch.where(var > 0, dev / (var.sqrt() + eps), dev) if scale_by_std else dev
    return adv.reshape(-1).to(_float_dtypes(rewards.dtype)[1])


def batch_std_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-8, std: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Group-centred, batch-scaled advantages: A_i = (r_i - mean(group)) / (std(batch) + eps).

    TRL's GRPOTrainer with ``scale_rewards="batch"`` (following Liu et al. 2025's remark that the
    per-group std biases toward too easy or too hard prompts, while some scale is still wanted): the
    baseline is the group mean, the scale the unbiased std of every reward in the batch. TRL adds
    eps = 1e-4; lmrl's default 1e-8 differs from it only for rewards of std ~1e-4 or less.

    Args:
        rewards: [B] one scalar reward per completion, B = num_prompts · G, groups contiguous.
        group_size: G >= 1.
        eps: added to the std; a group of equal rewards gets exactly 0 regardless.
        std: the batch std to divide by, when the batch is larger than `rewards` (several ranks each
            holding a share of it); None computes it from `rewards` (unbiased, 0 for one reward).

    Returns:
        [B] advantages in the dtype of `rewards` (float32 for integer rewards).
    """
    r = _grouped(rewards, group_size)  # [B/G, G]
    dev, _ = _centered(r)
    if std is None:
        flat = r.reshape(1, -1)
        _, var = _centered(flat)  # around the first reward: an all-equal batch has std exactly 0
        std = var.sqrt().reshape(())
    adv = dev / (torch.as_tensor(std, dtype=dev.dtype, device=dev.device) + eps)
    return adv.reshape(-1).to(_float_dtypes(rewards.dtype)[1])


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantages: A_i = r_i - mean of the other G - 1 rewards of the group.

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
    "Back to Basics" (RLOO). Equivalent to G / (G - 1) · (r_i - mean(group)); a group's advantages
    sum to 0.

    Args:
        rewards: [B] one scalar reward per completion, B = num_prompts · G, groups contiguous.
        group_size: G >= 2 (with one sample there is no "other" to form a baseline).

    Returns:
        [B] advantages in the dtype of `rewards` (float32 for integer rewards).
    """
    r = _grouped(rewards, group_size, min_size=2)  # [B/G, G]
    dev, _ = _centered(r)
    adv = dev * (group_size / (group_size - 1))
    return adv.reshape(-1).to(_float_dtypes(rewards.dtype)[1])


def reinforce_baseline_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE++-baseline advantages: A_i = r_i - mean(group).

    Hu et al. 2025, "REINFORCE++". The paper then whitens the advantages across the whole batch
    (not per group): do that afterwards, e.g. with `lmrl.algorithms.masked_whiten` on the
    per-token advantages. Numerically the same as ``grpo_advantages(..., scale_by_std=False)``.

    Args:
        rewards: [B] one scalar reward per completion, B = num_prompts · G, groups contiguous.
        group_size: G >= 1.

    Returns:
        [B] advantages in the dtype of `rewards` (float32 for integer rewards).
    """
    return grpo_advantages(rewards, group_size, scale_by_std=False)


def informative_groups(scores: torch.Tensor, group_size: int, tol: float = 1e-6) -> torch.Tensor:
    """[B / G] bool: groups whose rewards are not all equal (DAPO dynamic sampling keeps only these:
    a group of equal rewards has zero advantage and teaches nothing)."""
    g = scores.view(-1, group_size)
    return (g.max(1).values - g.min(1).values) > tol


def clip_filter_like_weights(
    rewards: torch.Tensor,
    group_size: int,
    max_weight: float = 3.0,
    equal_weight: float = 1.0,
    informative_fraction: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sample loss weights that make up for groups without signal (LightRFT's clip-filter-like weight).

    A group whose rewards are all equal has advantage 0: it adds nothing to the gradient but still
    counts in the loss's normaliser, so the batch's signal shrinks with the share of such groups.
    Instead of filtering them out and sampling again (DAPO's dynamic sampling), every sample of an
    informative group is weighted by

        w = min(P / P_informative, max_weight)        (P groups in the batch, P_informative not all equal)

    and every sample of an all-equal group by `equal_weight` (LightRFT, "clip_filter_like_weight",
    named after the clip-filter of early RLHF code). A batch with no informative group gets weight 1
    everywhere.

    Args:
        rewards: [B] one scalar reward per completion, B = P · G, groups contiguous.
        group_size: G >= 1.
        max_weight: cap of the informative groups' weight (LightRFT's default 3.0), > 0.
        equal_weight: the weight of all-equal groups (LightRFT's lamda, default 1.0), >= 0.
        informative_fraction: P_informative / P of a larger batch this one is a share of (several
            ranks); None counts this batch's groups.

    Returns:
        [B] float32 weights (float64 for float64 rewards), constants.
    """
    if not max_weight > 0:
        raise ValueError(f"max_weight: must be > 0, got {max_weight!r}")
    if not equal_weight >= 0:
        raise ValueError(f"equal_weight: must be >= 0, got {equal_weight!r}")
    r = _grouped(rewards, group_size)  # [P, G]
    informative = (r != r[:, :1]).any(dim=1)  # [P]
    fraction = informative.float().mean() if informative_fraction is None else informative_fraction
    fraction = torch.as_tensor(fraction, dtype=r.dtype, device=r.device)
    if not bool(fraction > 0):
        return torch.ones_like(r).reshape(-1)
    boost = (1.0 / fraction).clamp(max=max_weight)
    weights = torch.where(informative, boost, torch.full((), equal_weight, dtype=r.dtype, device=r.device))
    return weights[:, None].expand_as(r).reshape(-1).clone()


def gpg_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_by_std: bool = True,
    eps: float = 1e-8,
    max_weight: float | None = None,
    informative_fraction: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """GPG's advantages: group-normalised, scaled up for the groups that carry no signal (Chu et al. 2025,
    "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning", arXiv:2504.02546).

        A_i = α · (r_i - mean(group)) / (std(group) + eps),    α = B / (B - M)

    with M the samples of groups whose rewards are all equal (their advantage is 0). The loss averages
    over all B samples, so without α those zero rows dilute the gradient; α restores the scale of the
    informative ones (the paper's "accurate gradient estimation"). GPG trains these advantages with the
    plain policy gradient, no ratio and no clip (lmrl: `policy_loss` with both clips None).
    `scale_by_std=False` drops the std division; `max_weight` caps α (None: no cap; LightRFT's
    clip-filter-like weight is the same idea capped at 3). A batch without signal gets all 0.

    Args:
        rewards: [B] one scalar reward per completion, B = num_prompts · G, groups contiguous.
        group_size: G >= 1.
        scale_by_std, eps: as in `grpo_advantages`.
        max_weight: cap of α, > 0, or None.
        informative_fraction: (B - M) / B of a larger batch this one is a share of (several ranks); None
            counts this batch's groups.

    Returns:
        [B] advantages in the dtype of `rewards` (float32 for integer rewards).
    """
    adv = grpo_advantages(rewards, group_size, scale_by_std=scale_by_std, eps=eps)
    r = _grouped(rewards, group_size)
    informative = (r != r[:, :1]).any(dim=1).to(adv.dtype)  # [P]
    fraction = informative.mean() if informative_fraction is None else informative_fraction
    fraction = torch.as_tensor(fraction, dtype=adv.dtype, device=adv.device)
    if not bool(fraction > 0):
        return adv
    alpha = 1.0 / fraction  # B / (B - M): groups have equal sizes
    if max_weight is not None:
        alpha = alpha.clamp(max=max_weight)
    return adv * alpha


def remax_advantages(rewards: torch.Tensor, baseline: torch.Tensor, group_size: int = 1) -> torch.Tensor:
    """ReMax: REINFORCE with the reward of the greedy completion as the baseline (Li et al. 2023, "ReMax: A
    Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large Language Models",
    arXiv:2310.10505, eq. 7).

        A_i = r_i - r(ŷ_p),     ŷ_p = argmax decoding of sample i's prompt p

    The greedy completion costs one extra generation per prompt but no critic; the baseline does not
    depend on the samples, so the gradient stays unbiased.

    Args:
        rewards: [B] rewards of the sampled completions, B = P · G, groups contiguous.
        baseline: [P] reward of each prompt's greedy completion.
        group_size: G, samples per prompt (>= 1).

    Returns:
        [B] advantages in the promoted dtype of `rewards` and `baseline` (float32 at least).
    """
    r = _grouped(rewards, group_size)  # [P, G]
    if baseline.shape != (r.shape[0],):
        raise ValueError(f"baseline: expected shape [P] = ({r.shape[0]},), one per prompt, got {tuple(baseline.shape)}")
    work = torch.promote_types(r.dtype, baseline.dtype)
    return (r.to(work) - baseline.to(work)[:, None]).reshape(-1)


def pass_at_k_advantages(rewards: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """Pass@k-style group advantages, in closed form (Chen et al. 2025, "Pass@k Training for Adaptively
    Balancing Exploration and Exploitation of Large Reasoning Models", arXiv:2508.10751, §4).

    Pass@k training rewards a k-subset of a group's N = G samples with 1 when any of its members is
    correct, normalises over all C(N, k) subsets, and gives each sample the mean advantage of the
    subsets that contain it. With c correct samples (reward > 0) in the group:

        R̄   = 1 - C(N - c, k) / C(N, k)                 (the group's unbiased pass@k)
        σ   = sqrt(R̄ (1 - R̄))
        A+  = (1 - R̄) / σ                                for a correct sample
        A-  = (1 - R̄ - C(N - c - 1, k - 1) / C(N - 1, k - 1)) / σ   for a wrong one

    k = 1 gives GRPO's advantages with the population std. A wrong sample is punished less than under
    pass@1 (a subset it is in may still be solved): exploration is cheaper. Groups where R̄ is 0 or 1
    (every subset solved, or none) get 0.

    Args:
        rewards: [B] rewards, B = P · G, groups contiguous; reward > 0 counts as correct.
        group_size: G = N >= k.
        k: subset size, 1 <= k <= G.

    Returns:
        [B] advantages in the dtype of `rewards` (float32 for integer rewards).
    """
    r = _grouped(rewards, group_size)  # [P, N]
    n = r.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k: must be an int in [1, group_size={n}], got {k!r}")
    correct = (r > 0).to(r.dtype)
    c = correct.sum(dim=1, keepdim=True)  # [P, 1]

    def ratio_of_binomials(a: torch.Tensor, b: int, j: int) -> torch.Tensor:
        # C(a, j) / C(b, j) = Π_{m<j} (a - m) / (b - m): 0 when a < j, never a huge factorial
        out = torch.ones_like(a)
        for m in range(j):
            out = out * ((a - m).clamp(min=0) / (b - m))
        return out

    mean = 1.0 - ratio_of_binomials(n - c, n, k)  # [P, 1]
    std = (mean * (1.0 - mean)).clamp(min=0).sqrt()
    wrong_all = ratio_of_binomials(n - c - 1, n - 1, k - 1)  # P(every other member of its subset is wrong)
    adv = torch.where(correct > 0, 1.0 - mean, 1.0 - mean - wrong_all)
    adv = torch.where(std > 0, adv / std.clamp(min=torch.finfo(std.dtype).tiny), torch.zeros_like(adv))
    return adv.reshape(-1).to(_float_dtypes(rewards.dtype)[1])


class _GroupStats(NamedTuple):
    dev: torch.Tensor  # [B] deviation of each reward from its group mean (compute dtype)
    count: torch.Tensor  # [B] size of each sample's group
    index: torch.Tensor  # [B] dense group index 0..K-1 of each sample
    num_groups: int  # K


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> _GroupStats:
    _check_rewards_1d(rewards)
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids: shape {tuple(group_ids.shape)} does not match rewards {tuple(rewards.shape)}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids: expected an integer tensor, got {group_ids.dtype}")
    work, _ = _float_dtypes(rewards.dtype)
    r = rewards.to(work)
    # Dense ids 0..K-1 so that ids can be any integers (negative, huge, unsorted).
    unique_ids, index = torch.unique(group_ids, return_inverse=True)  # [K], [B]
    k = unique_ids.shape[0]
    count = torch.zeros(k, dtype=work, device=r.device).index_add_(0, index, torch.ones_like(r))  # [K]
    # Shift each group by its own minimum: equal rewards then give deviations exactly 0.
    low = torch.zeros(k, dtype=work, device=r.device)
    low = low.scatter_reduce_(0, index, r, reduce="amin", include_self=False)  # [K]
    shifted = r - low[index]
    mean = torch.zeros(k, dtype=work, device=r.device).index_add_(0, index, shifted) / count  # [K]
    return _GroupStats(shifted - mean[index], count[index], index, k)


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """GRPO advantages for groups of any sizes given by integer ids: (r - mean) / (std + eps).

    Same formula as `grpo_advantages` (unbiased std; ``scale_by_std=False`` is Dr. GRPO), but the
    group of sample i is ``group_ids[i]``: groups need not be contiguous nor of equal size (e.g.
    TapeAgents' ``group_id`` per prompt, or a batch after dropping failed rollouts). A group of
    size 1 gets advantage 0: a lone sample has no baseline, and its unbiased std is undefined.

    Args:
        rewards: [B] one scalar reward per completion.
        group_ids: [B] integer tensor; samples with the same id form a group. Any integer values.
        scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std; a group of equal rewards gets exactly 0 regardless.

    Returns:
        [B] advantages in the dtype of `rewards` (float32 for integer rewards).
    """
    stats = _group_stats(rewards, group_ids)
    adv = stats.dev
    if scale_by_std:
        sq = torch.zeros(stats.num_groups, dtype=adv.dtype, device=adv.device)
        sq = sq.index_add_(0, stats.index, adv.square())[stats.index]  # [B] group sum of squares
        # Unbiased std; a size-1 group has dev = 0 and std = 0 (not NaN), hence advantage 0.
        std = (sq / (stats.count - 1).clamp(min=1)).sqrt()
        adv = torch.where(std > 0, adv / (std + eps), adv)  # equal rewards: dev is exactly 0, also for eps = 0
    return adv.to(_float_dtypes(rewards.dtype)[1])


def leave_one_out_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO for groups of any sizes given by integer ids: r_i - mean of the other rewards of its group.

    Equals n / (n - 1) · (r_i - mean(group)) for a group of size n (Kool et al. 2019). A group of
    size 1 has no other sample to form a baseline: its advantage is 0.

    Args:
        rewards: [B] one scalar reward per completion.
        group_ids: [B] integer tensor; samples with the same id form a group.

    Returns:
        [B] advantages in the dtype of `rewards` (float32 for integer rewards).
    """
    stats = _group_stats(rewards, group_ids)
    adv = stats.dev * stats.count / (stats.count - 1).clamp(min=1)  # size-1 groups: dev is exactly 0
    return adv.to(_float_dtypes(rewards.dtype)[1])


def _check_per_token(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected a 2-D [B, T] tensor, got shape {tuple(rewards.shape)}")
    if mask.shape != rewards.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match rewards {tuple(rewards.shape)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma: must be in [0, 1], got {gamma}")


def _scan_dtype(device: torch.device) -> torch.dtype:
    # float64 makes the blockwise matmul exact enough whatever the TF32 / matmul-precision
    # settings (they silently cut float32 matmuls to 10 mantissa bits); MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def _reverse_discounted_cumsum(x: torch.Tensor, c: float, block: int = 64) -> torch.Tensor:
    """y_t = x_t + c · y_{t+1} (y = 0 past the end) along dim 1 of x [B, T], without a loop over T.

    Each block of `block` steps is one matmul with W[j, i] = c^(j-i) for j >= i (0 otherwise). The
    values carried into each block from the right obey the same recursion with factor c^block,
    solved the same way (recursion depth log_block T). All powers are <= 1: nothing overflows, and
    underflow to 0 only drops terms that are below float precision anyway.
    """
    batch, steps = x.shape
    if steps == 0:
        return x.clone()
    length = min(block, steps)
    n = -(-steps // length)  # blocks
    xb = torch.nn.functional.pad(x, (0, n * length - steps)).reshape(batch, n, length)
    k = torch.arange(length, dtype=x.dtype, device=x.device)
    expo = k[:, None] - k[None, :]  # [L, L]: j - i
    w = torch.where(expo >= 0, c ** expo.clamp(min=0), 0.0)  # 0^0 = 1, so c = 0 gives W = I
    y = xb @ w  # [B, n, L]: sums within each block
    if n > 1:
        # starts[:, b] = y at the first step of block b, everything to its right included
        starts = _reverse_discounted_cumsum(y[:, :, 0], c**length, block)  # [B, n]
        carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # [B, n]: enters block b from the right
        y = y + carry[:, :, None] * c ** (length - k)  # position i is L - i steps before the next block
    return y.reshape(batch, n * length)[:, :steps]


def _packing(mask: torch.Tensor) -> torch.Tensor | None:
    """Per-row permutation [B, T] that moves real tokens to the front, keeping their order.

    Skipping masked positions is then the plain recursion on a right-padded sequence. None when
    every row is already a prefix of real tokens (plain right padding, the common case).
    """
    if bool((mask[:, 1:] <= mask[:, :-1]).all()):
        return None
    return torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)


def _pack(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    return x if order is None else x.gather(1, order)


def _unpack(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    return x if order is None else torch.zeros_like(x).scatter(1, order, x)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go over real tokens: G_t = r_t + γ · G_{t'}, t' the next real token after t.

    Used as the per-token advantage of REINFORCE / REINFORCE++ (Williams 1992; Hu et al. 2025).
    Masked positions are skipped (they neither add reward nor discount) and are 0 in the output;
    after the last real token G = 0. Vectorised: real tokens are packed to the front of each row,
    then a blockwise scan replaces the loop over T (see `_reverse_discounted_cumsum`).

    Args:
        rewards: [B, T] per-token rewards, e.g. from `kl_shaped_rewards`.
        mask: [B, T] bool or 0/1, true on real response tokens; may have holes.
        gamma: discount γ in [0, 1].

    Returns:
        [B, T] returns in the dtype of `rewards`, 0 at masked positions.
    """
    _check_per_token(rewards, mask, gamma)
    _, out_dtype = _float_dtypes(rewards.dtype)
    real = mask.to(torch.bool)
    order = _packing(real)  # [B, T] or None
    # where(), not rewards * mask: masked entries may be inf / NaN.
    r = _pack(torch.where(real, rewards.to(_scan_dtype(rewards.device)), 0.0), order)  # [B, T]
    returns = _unpack(_reverse_discounted_cumsum(r, gamma), order)  # back to the original positions
    return torch.where(real, returns, 0.0).to(out_dtype)


class GAEResult(NamedTuple):
    """Output of `gae`; unpacks as ``advantages, returns = gae(...)``."""

    advantages: torch.Tensor
    """[B, T] GAE advantages, 0 at masked positions."""
    returns: torch.Tensor
    """[B, T] value targets A_t + V_t, 0 at masked positions."""


def gae(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> GAEResult:
    """Generalized Advantage Estimation over the real tokens of each response.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", as used by PPO for RLHF:

        δ_t = r_t + γ · V_{t'} - V_t          t' = next real token after t (V = 0 past the last one)
        A_t = δ_t + γλ · A_{t'}
        R_t = A_t + V_t                        (value-loss target)

    Masked positions are skipped as if absent and are 0 in both outputs. λ = 1 with V = 0 gives the
    discounted returns; λ = 0 gives the one-step TD errors δ_t. Vectorised like
    `discounted_returns` (no loop over T). Not differentiated in practice (values come from a
    no-grad critic pass); detach before use if yours carry a graph.

    Args:
        values: [B, T] critic values V(s_t) at each response token.
        rewards: [B, T] per-token rewards, e.g. from `kl_shaped_rewards`.
        mask: [B, T] bool or 0/1, true on real response tokens; may have holes.
        gamma: discount γ in [0, 1].
        lam: GAE λ in [0, 1].

    Returns:
        GAEResult(advantages [B, T], returns [B, T]) in the dtype of ``rewards`` and ``values``
        promoted together; a NamedTuple, so it also unpacks as a tuple.
    """
    _check_per_token(rewards, mask, gamma)
    if values.shape != rewards.shape:
        raise ValueError(f"values: shape {tuple(values.shape)} does not match rewards {tuple(rewards.shape)}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam: must be in [0, 1], got {lam}")
    _, out_dtype = _float_dtypes(torch.result_type(values, rewards))
    scan = _scan_dtype(rewards.device)
    real = mask.to(torch.bool)
    order = _packing(real)  # [B, T] or None
    real_packed = _pack(real, order)  # [B, T], true on a prefix of each row
    # where() first, so garbage (inf / NaN) at masked positions never enters the arithmetic.
    v = _pack(torch.where(real, values.to(scan), 0.0), order)  # 0 past the last real token
    r = _pack(torch.where(real, rewards.to(scan), 0.0), order)
    v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))  # V_{t'}: the next real token's value
    delta = torch.where(real_packed, r + gamma * v_next - v, 0.0)  # δ_t = r_t + γ V_{t'} - V_t
    adv_packed = _reverse_discounted_cumsum(delta, gamma * lam)  # A_t = δ_t + γλ A_{t'}
    advantages = torch.where(real, _unpack(adv_packed, order), 0.0)
    returns = torch.where(real, advantages + values.to(scan), 0.0)
    return GAEResult(advantages.to(out_dtype), returns.to(out_dtype))
