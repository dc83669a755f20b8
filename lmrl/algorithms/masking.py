"""Masked reductions over response tokens.

`mask` marks real response tokens (bool or 0/1, same shape as `x` or broadcastable to it).
Masked-out entries never influence a result, even when they hold inf or NaN.
"""

from __future__ import annotations

import torch

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten"]


def _check(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.shape != x.shape:
        try:
            mask = mask.expand_as(x)
        except RuntimeError:
            raise ValueError(f"mask: shape {tuple(mask.shape)} does not match x {tuple(x.shape)}") from None
    return mask.to(torch.bool)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over entries where `mask` is true, over all entries or along `dim`."""
    mask = _check(x, mask)
    # where(), not x * mask: 0 * inf would be NaN.
    zeroed = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over entries where `mask` is true. A row with no true entry gives 0, not NaN."""
    mask = _check(x, mask)
    total = masked_sum(x, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all masked entries; Bessel-corrected (n - 1) when `unbiased`."""
    mask = _check(x, mask)
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased:
        if n < 2:
            raise ValueError("masked_var: need at least 2 masked entries for an unbiased variance")
        return sq / (n - 1).to(sq.dtype)
    return sq / n.clamp(min=1).to(sq.dtype)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, unbiased: bool = True
) -> torch.Tensor:
    """(x - mean) / (std + eps) over masked entries; masked-out entries become 0.

    With `shift_mean=False` the mean is added back: only the scale changes, as in PPO
    implementations that whiten rewards without moving them. The std is unbiased (n - 1, as TRL and
    verl); `unbiased=False` divides by n, as OpenRLHF's advantage whitening does.
    """
    mask = _check(x, mask)
    mean = masked_mean(x, mask)
    std = masked_var(x, mask, unbiased=unbiased).sqrt()
    out = (x - mean) / (std + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))
