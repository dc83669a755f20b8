"""Importance weights for a sampler whose probabilities differ from the trainer's (another dtype, another
engine, an older policy): the ratio exp(old_logp - rollout_logp) of each sampled token, truncated at a cap
(`truncated_is_weights`, TIS) or zeroed outside a band (`masked_is_weights`, IcePop / sequence masking).

The weights multiply a policy loss's per-token terms (its `weights` argument); they carry no gradient.
Inputs are sanitised as the losses' are (`lmrl.algorithms.checks`): padding zeroed, float32 at least.
"""

from __future__ import annotations

import math

import torch

from lmrl.algorithms.checks import _as_bool_mask, _check_choice, _check_same_shape, _clean, _compute_dtype

__all__ = ["masked_is_weights", "truncated_is_weights"]

_IS_LEVELS = ("token", "sequence")


def truncated_is_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None = 2.0,
    level: str = "token",
) -> torch.Tensor:
    """Truncated importance-sampling weights for a sampler whose probabilities differ from the trainer's.

    The rollout engine (another dtype, kernels or engine) samples from π_rollout while the loss
    assumes π_old. Reweighting each token by π_old / π_rollout, truncated at `cap`, corrects the
    bias at bounded variance (Ionides 2008, truncated IS; Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"):

        token:    w_{i,t} = min(exp(old_logp_{i,t} - rollout_logp_{i,t}), cap)
        sequence: w_{i,t} = min(exp(Σ_t m (old_logp - rollout_logp)), cap), the same on every token of i

    Pass the result as `weights=` to `policy_loss` / `cispo_loss`.

    Args:
        old_logp: `[B, T]` trainer log-probs of the sampled tokens (before the update).
        rollout_logp: `[B, T]` log-probs reported by the sampler for the same tokens.
        mask: `[B, T]` bool or 0/1, real response tokens.
        cap: truncation level (> 0); None for plain (untruncated) importance weights.
        level: "token" or "sequence".

    Returns:
        `[B, T]` weights, detached (constants), float32 at least; padding positions are 0 so the
        weights double as a mask.
    """
    if cap is not None and not cap > 0:
        raise ValueError(f"cap: must be > 0 or None, got {cap!r}")
    mask, log_ratio = _log_ratio(old_logp, rollout_logp, mask, level)
    with torch.no_grad():
        dtype = log_ratio.dtype
        if cap is not None:
            # Truncate in log space: exp of a long sequence's summed log-ratio would overflow.
            log_ratio = log_ratio.clamp(max=math.log(cap))
        weights = torch.exp(log_ratio)
        return torch.where(mask, weights, torch.zeros((), dtype=dtype, device=weights.device))


def masked_is_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    low: float = 0.5,
    high: float = 2.0,
    level: str = "token",
) -> torch.Tensor:
    """Importance weights that *mask* what the sampler got too wrong, instead of truncating it.

    With ρ = π_old / π_rollout on the sampled tokens:

        token (IcePop):  w_{i,t} = ρ_{i,t} if low <= ρ_{i,t} <= high, else 0
        sequence:        w_{i,t} = ρ_i if low <= ρ_i <= high, else 0,   ρ_i = exp(Σ_t m (old_logp - rollout_logp))

    Token level is IcePop's double-sided masking (inclusionAI 2025, "Small Leak Can Sink a Great Ship",
    the Ring-1T report): tokens whose trainer and sampler probabilities disagree beyond the band carry
    no gradient at all, since truncating their weight (`truncated_is_weights`) still trains on a
    mismatch that compounds. Sequence level is masked sequence IS ("MIS", Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"): a sequence whose likelihood
    ratio leaves the band is dropped whole.

    Args:
        old_logp: `[B, T]` trainer log-probs of the sampled tokens.
        rollout_logp: `[B, T]` the sampler's log-probs of the same tokens.
        mask: `[B, T]` bool or 0/1, real response tokens.
        low, high: the band, 0 <= low < 1 < high.
        level: "token" or "sequence".

    Returns:
        `[B, T]` weights, detached, float32 at least; padding and masked-out tokens are 0.
    """
    if not 0 <= low < 1 < high:
        raise ValueError(f"low, high: must satisfy 0 <= low < 1 < high, got {low!r}, {high!r}")
    mask, log_ratio = _log_ratio(old_logp, rollout_logp, mask, level)
    with torch.no_grad():
        dtype = log_ratio.dtype
        log_low = math.log(low) if low > 0 else -math.inf
        inside = (log_ratio >= log_low) & (log_ratio <= math.log(high))
        weights = torch.exp(log_ratio.clamp(max=math.log(high)))  # no overflow where the band masks anyway
        return torch.where(mask & inside, weights, torch.zeros((), dtype=dtype, device=weights.device))


def _log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
               level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The bool mask and the detached `[B, T]` log ρ = old_logp - rollout_logp on real tokens (0 on padding),
    each token's own (level "token") or its sequence's sum on every token (level "sequence")."""
    _check_choice("level", level, _IS_LEVELS)
    mask = _as_bool_mask(mask, old_logp, "old_logp")
    _check_same_shape("rollout_logp", rollout_logp, "old_logp", old_logp)
    with torch.no_grad():
        dtype = _compute_dtype(old_logp.dtype)
        log_ratio = _clean(old_logp, mask, dtype) - _clean(rollout_logp, mask, dtype)
        if level == "sequence":
            log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    return mask, log_ratio
