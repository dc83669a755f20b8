"""Argument checks and input sanitising, shared by the losses (`losses.py`, `surrogates.py`, `offpolicy.py`,
`aggregation.py`) and the importance weights (`importance.py`).

A bad argument fails at once, in one line that names it. A loss's tensors are then made safe to compute with
(`_prepare`): float32 at least, padding positions replaced by zeros before any arithmetic (so inf/NaN in padding
never reach the loss or the gradient of real tokens), and everything but `logp` detached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmrl.algorithms.kl import KL_CLAMPS, KL_ESTIMATORS

_KL_ESTIMATORS = tuple(KL_ESTIMATORS)


# --------------------------------------------------------------------------------------------------
# argument checks (one line per error, naming the argument)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: unknown value {value!r}; allowed: {', '.join(map(repr, allowed))}")


def _check_clip(name: str, value: float | None, upper: float | None = None) -> None:
    if value is None:
        return
    if not value >= 0 or (upper is not None and value > upper):
        bound = f"in [0, {upper}]" if upper is not None else ">= 0"
        raise ValueError(f"{name}: must be {bound} or None, got {value!r}")


def _check_2d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a [B, T] tensor, got shape {tuple(x.shape)}")


def _check_same_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if x.shape != ref.shape:
        raise ValueError(f"{name}: shape {tuple(x.shape)} does not match {ref_name} {tuple(ref.shape)}")


def _check_kl(kl_coef: float, ref_logp: torch.Tensor | None, kl_estimator: str, kl_clamp: str | None = None) -> None:
    _check_choice("kl_estimator", kl_estimator, _KL_ESTIMATORS)
    if kl_clamp is not None:
        _check_choice("kl_clamp", kl_clamp, KL_CLAMPS)
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef: must be >= 0, got {kl_coef!r}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(
            "ref_logp: required when kl_coef > 0 (the KL term is computed against the reference)"
        )


# --------------------------------------------------------------------------------------------------
# inputs: float32 at least, padding zeroed, constants detached


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 -> float32; float64 stays float64.
    return torch.promote_types(dtype, torch.float32)


def _clean(x: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype` with padding replaced by 0; where() keeps inf/NaN in padding out of forward and backward."""
    x = x.to(dtype)
    return torch.where(mask, x, torch.zeros((), dtype=dtype, device=x.device))


def _as_bool_mask(mask: torch.Tensor, logp: torch.Tensor, logp_name: str = "logp") -> torch.Tensor:
    _check_2d(logp_name, logp)
    _check_same_shape("mask", mask, logp_name, logp)
    return mask.to(torch.bool)


def _broadcast_advantages(advantages: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    batch, length = logp.shape
    if advantages.shape == (batch,):
        return advantages.unsqueeze(-1).expand(batch, length)
    if advantages.shape == (batch, length):
        return advantages
    raise ValueError(
        f"advantages: shape {tuple(advantages.shape)} must be [B] = ({batch},) or [B, T] = ({batch}, {length})"
    )


@dataclass(frozen=True)
class _TokenBatch:
    """Inputs of a policy loss after checks: same dtype, padding zeroed, everything but logp detached."""

    logp: torch.Tensor  # [B, T], carries the gradient
    log_ratio: torch.Tensor  # [B, T] logp - old_logp, 0 on padding; carries the gradient
    old_logp: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] bool
    ref_logp: torch.Tensor | None  # [B, T]
    weights: torch.Tensor | None  # [B, T]


def _prepare(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    weights: torch.Tensor | None,
) -> _TokenBatch:
    mask = _as_bool_mask(mask, logp)
    _check_same_shape("old_logp", old_logp, "logp", logp)
    advantages = _broadcast_advantages(advantages, logp)
    if ref_logp is not None:
        _check_same_shape("ref_logp", ref_logp, "logp", logp)
    if weights is not None:
        _check_same_shape("weights", weights, "logp", logp)
    dtype = _compute_dtype(logp.dtype)
    logp, old_logp = _clean(logp, mask, dtype), _clean(old_logp.detach(), mask, dtype)
    return _TokenBatch(
        logp=logp,
        log_ratio=logp - old_logp,
        old_logp=old_logp,
        advantages=_clean(advantages.detach(), mask, dtype),
        mask=mask,
        ref_logp=None if ref_logp is None else _clean(ref_logp.detach(), mask, dtype),
        weights=None if weights is None else _clean(weights.detach(), mask, dtype),
    )
