"""Reward shaping: functions applied to sequence-level scores before advantages.

The shaping functions are pure tensor functions: all inputs are [B] tensors (one entry per completion);
every function returns a new tensor and leaves its inputs unchanged. `shape_scores` applies them, as the
`reward` section configures them, to the scores of a rollout.

- `missing_eos_penalty`: TRL's "EOS trick" (RLOO / PPO trainer docs): subtract a fixed penalty from
  completions that were cut off before EOS.
- `overlong_penalty`: DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13).
- `overlong_filter_mask`: DAPO's overlong filtering: drop truncated completions from the loss.
- `clip_rewards`, `normalize_rewards`: REINFORCE++ options (Hu 2025; TRL RLOO docs): clip scores to
  [-c, c] (or a [low, high] range); normalise to mean 0, std 1 over the batch.
- `shape_scores`: the options above in the order they compose, on a rollout's scores; under torchrun the
  normalisation spans every rank's share of the batch (`lmrl.distributed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmrl.distributed import ONE_PROCESS, World, whiten_across_ranks

if TYPE_CHECKING:  # for annotations only: importing lmrl.rollout would import transformers
    from lmrl.rollout import Rollout


def _as_bool(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a [B] tensor, got shape {tuple(x.shape)}")
    return x.bool() if x.dtype != torch.bool else x


def missing_eos_penalty(scores: torch.Tensor, finished: torch.Tensor, penalty: float) -> torch.Tensor:
    """Subtract `penalty` from the score of every completion that did not end with EOS.

    r'_i = r_i - penalty * (1 - finished_i)   (TRL's `missing_eos_penalty`, the "EOS trick").

    Args:
        scores: [B] float scores.
        finished: [B] bool (or 0/1): True when the completion ended with EOS.
        penalty: the amount subtracted; >= 0.

    Returns:
        [B] shaped scores, same dtype as `scores`.
    """
    finished = _as_bool(finished, "finished")
    if scores.shape != finished.shape:
        raise ValueError(f"finished: shape {tuple(finished.shape)} does not match scores {tuple(scores.shape)}")
    if penalty < 0:
        raise ValueError(f"penalty: must be >= 0 (it is subtracted), got {penalty}")
    return scores - penalty * (~finished).to(scores.dtype)


def overlong_penalty(lengths: torch.Tensor, max_length: int, cache_length: int) -> torch.Tensor:
    """DAPO's soft overlong punishment, a length-aware penalty added to the score (Yu et al. 2025, eq. 13).

        R(y) = 0                                   if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                  if |y| > L_max

    The penalty grows linearly from 0 to -1 across the last `cache_length` tokens of the budget.
    With `cache_length = 0` it is a hard -1 beyond `max_length`.

    Args:
        lengths: [B] completion lengths |y| (tokens), integer or float.
        max_length: L_max, the length budget.
        cache_length: L_cache, the width of the soft-penalty band; 0 <= L_cache <= L_max.

    Returns:
        [B] float32 penalties in [-1, 0].
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths: expected a [B] tensor, got shape {tuple(lengths.shape)}")
    if max_length <= 0:
        raise ValueError(f"max_length: must be > 0, got {max_length}")
    if not 0 <= cache_length <= max_length:
        raise ValueError(f"cache_length: must be in [0, max_length={max_length}], got {cache_length}")
    lengths = lengths.to(torch.float32)
    start = float(max_length - cache_length)  # where the penalty band begins
    if cache_length == 0:
        return torch.where(lengths > max_length, -1.0, 0.0).to(torch.float32)
    soft = (start - lengths) / cache_length
    out = torch.where(lengths <= start, torch.zeros_like(lengths), soft)
    return torch.where(lengths > max_length, torch.full_like(lengths, -1.0), out)


def overlong_filter_mask(finished: torch.Tensor) -> torch.Tensor:
    """Keep mask that drops truncated completions from the loss (DAPO's overlong filtering).

    A completion cut off at the length limit gets no reward signal about its (unseen) ending, so
    DAPO masks its loss. Apply to per-token masks as `mask & keep[:, None]`.

    Args:
        finished: [B] bool (or 0/1): True when the completion ended with EOS.

    Returns:
        [B] bool: True = keep in the loss.
    """
    return _as_bool(finished, "finished").clone()


def clip_rewards(scores: torch.Tensor, clip: float | tuple[float, float]) -> torch.Tensor:
    """Clip scores to [-clip, clip], or to [low, high] (REINFORCE++ reward clipping; OpenRLHF's and LightRFT's
    `reward_clip_range` is the pair).

    Args:
        scores: [B] float scores.
        clip: c > 0 for [-c, c], or a pair (low, high) with low < high.

    Returns:
        [B] clipped scores.
    """
    if isinstance(clip, (tuple, list)):
        if len(clip) != 2 or not clip[0] < clip[1]:
            raise ValueError(f"clip: a range must be (low, high) with low < high, got {tuple(clip)}")
        low, high = clip
    elif not clip > 0:
        raise ValueError(f"clip: must be > 0, got {clip}")
    else:
        low, high = -clip, clip
    return scores.clamp(low, high)


def normalize_rewards(scores: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalise scores over the batch: (r - mean) / (std + eps) (REINFORCE++ reward normalisation).

    std is the unbiased (Bessel-corrected) batch std, as in `masked_whiten`. With fewer than two
    scores the std is taken as 0, so a single score normalises to 0.

    Args:
        scores: [B] float scores.
        eps: added to the std to avoid dividing by zero when all scores are equal.

    Returns:
        [B] normalised scores.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores: expected a [B] tensor, got shape {tuple(scores.shape)}")
    centered = scores - scores.mean()
    std = scores.std() if scores.numel() > 1 else scores.new_zeros(())
    return centered / (std + eps)


_missing_eos_penalty = missing_eos_penalty  # shape_scores' keyword of that name (the config field) hides it


def shape_scores(rollout: Rollout, scores: torch.Tensor, *, max_new_tokens: int, missing_eos_penalty: float | None = None,
                 overlong_buffer: int | None = None, clip: float | tuple[float, float] | None = None, normalize: bool = False,
                 drop_truncated: bool = False, world: World = ONE_PROCESS):
    """Reward-side options (the `reward` section's fields of the same names) in the order they compose:
    missing-EOS penalty, DAPO overlong penalty (the last `overlong_buffer` of `max_new_tokens`), clip, normalise
    (over the whole batch: every rank's share of it). Returns (scores [B], keep [B] bool or None: False leaves a
    truncated completion out of the loss, with `drop_truncated`)."""
    if missing_eos_penalty is not None:
        scores = _missing_eos_penalty(scores, rollout.finished, missing_eos_penalty)
    if overlong_buffer is not None:
        scores = scores + overlong_penalty(rollout.lengths, max_new_tokens, overlong_buffer)
    if clip is not None:
        scores = clip_rewards(scores, clip)
    if normalize and world.distributed:
        scores = whiten_across_ranks(scores, torch.ones_like(scores, dtype=torch.bool), world)
    elif normalize:
        scores = normalize_rewards(scores)
    keep = overlong_filter_mask(rollout.finished) if drop_truncated else None
    return scores, keep
