"""Loss aggregation: how a per-token loss `[B, T]` becomes a scalar (`aggregate_loss`, with one of
`AGGREGATION_MODES`), and the normaliser that makes the losses of micro-batches add up to the full batch's
(`loss_normalizer`). Every loss of `lmrl.algorithms` ends with it.
"""

from __future__ import annotations

import torch

from lmrl.algorithms.checks import _as_bool_mask, _check_2d
from lmrl.algorithms.masking import masked_mean, masked_sum

__all__ = ["AGGREGATION_MODES", "aggregate_loss", "loss_normalizer"]

AGGREGATION_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _check_aggregation(name: str, mode: str, norm_length: float | None, normalizer: object) -> None:
    if mode not in AGGREGATION_MODES:
        allowed = ", ".join(map(repr, AGGREGATION_MODES))
        raise ValueError(f"{name}: unknown aggregation {mode!r}; allowed: {allowed}")
    if mode == "seq-mean-token-sum-norm" and normalizer is None and norm_length is None:
        raise ValueError(
            "norm_length: required for aggregation 'seq-mean-token-sum-norm' "
            "(Dr. GRPO divides by B * norm_length, e.g. the maximum response length)"
        )
    if norm_length is not None and not norm_length > 0:
        raise ValueError(f"norm_length: must be > 0, got {norm_length!r}")
    if isinstance(normalizer, (int, float)) and not normalizer > 0:
        raise ValueError(f"normalizer: must be > 0, got {normalizer!r}")


def loss_normalizer(
    mask: torch.Tensor, mode: str = "token-mean", norm_length: float | None = None
) -> torch.Tensor:
    """The normaliser `aggregate_loss` divides by for the batch marked by `mask`.

    Compute it once on the full batch and pass it as `normalizer=` to every micro-batch's loss:
    the micro-batch losses then add up to the full-batch loss, and so do their gradients.

    ==========================  =============================
    mode                        normalizer
    ==========================  =============================
    "token-mean"                number of real tokens (at least 1)
    "token-sum"                 1
    "seq-mean-token-mean"       B
    "seq-mean-token-sum"        B
    "seq-mean-token-sum-norm"   B * norm_length
    ==========================  =============================

    Every normalizer except "token-sum"'s is additive over micro-batches and ranks. Under DDP,
    which averages gradients over W ranks, pass the sum over ranks divided by W
    (`all_reduce(loss_normalizer(local_mask)) / W`) so that the average is the global loss.

    Args:
        mask: `[B, T]` bool or 0/1, real response tokens.
        mode: one of `AGGREGATION_MODES`.
        norm_length: the constant length for "seq-mean-token-sum-norm" (e.g. max new tokens).

    Returns:
        A 0-dim float32 tensor on `mask`'s device (a tensor, so that no device sync is forced).
    """
    _check_aggregation("mode", mode, norm_length, None)
    _check_2d("mask", mask)
    batch = mask.shape[0]
    if mode == "token-mean":
        return mask.to(torch.bool).sum().clamp(min=1).to(torch.float32)
    if mode == "token-sum":
        value = 1.0
    elif mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        value = float(batch)
    else:
        assert norm_length is not None  # checked above
        value = float(batch) * float(norm_length)
    return torch.tensor(value, dtype=torch.float32, device=mask.device)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    norm_length: float | None = None,
    *,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the real tokens.

    With ℓ_{i,t} the loss of token t of sequence i, m the mask, |y_i| = Σ_t m_{i,t}:

    - "token-mean":  Σ_{i,t} m ℓ / Σ_{i,t} m. Every token weighs the same (DAPO, Yu et al. 2025).
    - "token-sum":   Σ_{i,t} m ℓ.
    - "seq-mean-token-mean": (1/B) Σ_i (1/|y_i|) Σ_t m ℓ. Original GRPO (Shao et al. 2024); tokens of
      short answers weigh more, which biases toward short correct and long wrong answers.
    - "seq-mean-token-sum":  (1/B) Σ_i Σ_t m ℓ.
    - "seq-mean-token-sum-norm": Σ_{i,t} m ℓ / (B · norm_length). Dr. GRPO (Liu et al. 2025): a
      constant normaliser, so no length bias; `norm_length` is usually the maximum response length.

    Gradient accumulation: "token-mean" of a batch is not the mean of its micro-batches'
    token-means. Pass `normalizer=loss_normalizer(full_mask, mode, norm_length)` to every
    micro-batch; the numerator (Σ m ℓ, or Σ_i of per-sequence means) is additive, so the sum of
    the micro-batch losses equals the full-batch loss::

        denom = loss_normalizer(mask, "token-mean")
        for sl in micro_batches:
            aggregate_loss(loss[sl], mask[sl], "token-mean", normalizer=denom).backward()

    Args:
        per_token_loss: `[B, T]` loss of each token; padding may hold anything (even inf/NaN).
        mask: `[B, T]` bool or 0/1, real response tokens.
        mode: one of `AGGREGATION_MODES`.
        norm_length: required for "seq-mean-token-sum-norm" unless `normalizer` is given.
        normalizer: overrides the batch's own normaliser (see `loss_normalizer`).

    Returns:
        A 0-dim tensor in `per_token_loss`'s dtype.
    """
    _check_aggregation("mode", mode, norm_length, normalizer)
    mask = _as_bool_mask(mask, per_token_loss, "per_token_loss")
    if mode == "seq-mean-token-mean":
        numerator = masked_mean(per_token_loss, mask, dim=-1).sum()  # Σ_i of per-sequence means
    else:
        numerator = masked_sum(per_token_loss, mask)
    if normalizer is None:
        normalizer = loss_normalizer(mask, mode, norm_length)
    normalizer = torch.as_tensor(normalizer, dtype=numerator.dtype, device=numerator.device)
    return numerator / normalizer
