"""The decoupled PPO objective for stale data (AReaL, Fu et al. 2025): clip against the proximal policy,
importance-weight for the behaviour policy.

A batch sampled by an older policy π_behav (asynchronous rollouts) is trained on with PPO, but the trust
region is taken around π_prox, the trainer's policy at the start of the update, not around π_behav; the
gap between the two is corrected by an importance weight π_prox / π_behav, detached and bounded. Hilton et
al. 2021 ("Batch size-invariance for policy optimization") first split PPO's π_old in two this way. The
function is a composition: the weight comes from `lmrl.algorithms.importance` and is passed as `weights=` to
`lmrl.algorithms.losses.policy_loss` with the proximal log-probs as its `old_logp`.

How lmrl departs from AReaL, on purpose: AReaL's `behav_imp_weight_cap` *drops* tokens whose weight is above
the cap (weight 0) and keeps every weight below it. lmrl truncates at the cap by default (TIS, as its trainer
does for any sampler mismatch); `behav_mode="icepop", behav_low=0.0` is AReaL's rule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from lmrl.algorithms.checks import _as_bool_mask, _check_choice, _check_same_shape
from lmrl.algorithms.importance import masked_is_weights, truncated_is_weights
from lmrl.algorithms.losses import PolicyLossMetrics, _to_floats, policy_loss
from lmrl.algorithms.masking import masked_mean

__all__ = ["BEHAV_MODES", "DecoupledLossMetrics", "decoupled_policy_loss"]

# The behaviour weight's rule, by name (the same names as the trainer's algorithm.tis_mode).
BEHAV_MODES = ("truncate", "icepop", "sequence-mask")


@dataclass(frozen=True, kw_only=True)
class DecoupledLossMetrics(PolicyLossMetrics):
    """`PolicyLossMetrics` of the PPO part (ratios against π_prox), plus the behaviour weights', as floats.

    Attributes:
        behav_weight_mean: mean over real tokens of the behaviour weight w (the caller's `weights` aside).
        behav_masked_frac: fraction of real tokens whose w is 0 (dropped by "icepop" / "sequence-mask").
    """

    behav_weight_mean: float
    behav_masked_frac: float


def decoupled_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    behav_mode: str = "truncate",
    behav_cap: float | None = 2.0,
    behav_low: float = 0.5,
    weights: torch.Tensor | None = None,
    **policy_loss_kwargs,
) -> tuple[torch.Tensor, DecoupledLossMetrics]:
    """AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
    Learning System for Language Reasoning", arXiv:2505.24298; Hilton et al. 2021, arXiv:2110.00641).

    Per real token, with ρ = exp(logp - prox_logp) and the behaviour weight w = sg(π_prox / π_behav):

        ℓ = -w · min(ρ A, clip(ρ, 1 - clip_low, 1 + clip_high) A)

    with w by `behav_mode`:

        "truncate":      w = min(exp(prox_logp - behav_logp), behav_cap)       (`truncated_is_weights`)
        "icepop":        w = exp(prox_logp - behav_logp), 0 outside [behav_low, behav_cap]   (IcePop)
        "sequence-mask": w = exp(Σ_t (prox_logp - behav_logp)) on every token of the sequence, 0 for
                         the whole sequence outside [behav_low, behav_cap]    (`masked_is_weights`)

    then `aggregate_loss` as `policy_loss` does. The ratio and its clip are against π_prox, so how stale
    the data is does not shrink the trust region: a token whose probability moved a lot since it was
    sampled still gets a gradient while the trainer's own policy stays within the clip. With
    `behav_logp == prox_logp` (on-policy data), w = 1 and this is exactly `policy_loss`.

    Computed as `policy_loss(logp, prox_logp, advantages, mask, weights=w * weights, **kwargs)`, so
    every option of `policy_loss` (clip ranges, dual clip, ratio_level, KL to a reference, aggregation,
    normalizer) passes through; the KL term is weighted by w as well, and a weight of 0 still counts in
    the normalizer (as AReaL's does).

    Args:
        logp: `[B, T]` log-probs of the sampled tokens under the policy being trained (with grad).
        prox_logp: `[B, T]` log-probs under the proximal policy, the trainer's at the start of the update
            (no grad).
        behav_logp: `[B, T]` log-probs under the behaviour policy that sampled the tokens (no grad).
        advantages: `[B]` (broadcast over tokens) or `[B, T]`.
        mask: `[B, T]` bool or 0/1, real response tokens. Padding may hold anything in every input.
        behav_mode: one of `BEHAV_MODES`.
        behav_cap: with "truncate" the cap (> 0), None for untruncated weights; otherwise the band's upper
            end (> 1).
        behav_low: the band's lower end, in [0, 1) ("icepop" and "sequence-mask" only).
        weights: `[B, T]` the caller's own per-token multipliers (constants), applied on top of w.
        **policy_loss_kwargs: `policy_loss`'s keyword options.

    Returns:
        (loss, metrics): a 0-dim tensor (float32, or float64 for float64 inputs) and `DecoupledLossMetrics`.
    """
    _check_choice("behav_mode", behav_mode, BEHAV_MODES)
    if behav_mode == "truncate" and behav_cap is not None and not behav_cap > 0:
        raise ValueError(f"behav_cap: must be > 0 or None with behav_mode 'truncate', got {behav_cap!r}")
    if behav_mode != "truncate" and not (behav_cap is not None and behav_cap > 1):
        raise ValueError(
            f"behav_cap: the band's upper end must be > 1 with behav_mode {behav_mode!r}, got {behav_cap!r}"
        )
    if behav_mode != "truncate" and not 0 <= behav_low < 1:
        raise ValueError(f"behav_low: must be in [0, 1), got {behav_low!r}")
    # shapes named as this function's arguments, before the weight functions check them under their own names
    bool_mask = _as_bool_mask(mask, logp)
    _check_same_shape("prox_logp", prox_logp, "logp", logp)
    _check_same_shape("behav_logp", behav_logp, "logp", logp)
    if weights is not None:
        _check_same_shape("weights", weights, "logp", logp)

    if behav_mode == "truncate":
        w = truncated_is_weights(prox_logp, behav_logp, bool_mask, cap=behav_cap)  # [B, T], 0 on padding
    else:
        level = "token" if behav_mode == "icepop" else "sequence"
        w = masked_is_weights(prox_logp, behav_logp, bool_mask, low=behav_low, high=behav_cap, level=level)
    total = w if weights is None else w * weights.detach()
    loss, m = policy_loss(logp, prox_logp, advantages, mask, weights=total, **policy_loss_kwargs)

    with torch.no_grad():
        dropped = (w == 0).to(w.dtype)
        weight_mean, masked_frac = _to_floats(masked_mean(w, bool_mask), masked_mean(dropped, bool_mask))
    return loss, DecoupledLossMetrics(**asdict(m), behav_weight_mean=weight_mean,
                                      behav_masked_frac=masked_frac)
