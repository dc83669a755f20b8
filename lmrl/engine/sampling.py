"""Sampling one token per row from `[b, V]` logits, on the logits' device, with no host synchronisation.

The log-prob returned with each token is that of the full distribution (temperature applied, no top-k / top-p /
banned tokens), which is what the trainer's forward computes. `params` is anything with `temperature`, `top_k` and
`top_p` (`lmrl.rollout.SamplingParams`).

Randomness is per row, not per batch: row r's t-th token is drawn with the uniform number `uniform(key_r, t)`, a
counter-based hash (splitmix64: Steele et al., 2014) of the row's key and its step. A row therefore samples the same
tokens whichever rows it decodes beside, whenever it joined and whichever decode path runs it: continuous batching,
a `batch_size` split and the server's joining change the work, not the samples (tested).
"""

from __future__ import annotations

from typing import Any

import torch

# splitmix64's constants as signed 64-bit integers (torch's int64 arithmetic wraps around)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of int64 whose every output bit depends on every input bit."""
    x = (x ^ _shift(x, 30)) * _MIX1
    x = (x ^ _shift(x, 27)) * _MIX2
    return x ^ _shift(x, 31)


def row_keys(base: int, rows: torch.Tensor) -> torch.Tensor:
    """`[b]` int64 keys of rows numbered `rows` (`[b]` int64) in a call whose randomness is `base` (a seed)."""
    return _mix(_mix(torch.full_like(rows, base)) + rows * _GOLDEN)


def uniform(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`[b]` float64 uniform numbers in [0, 1): the `steps[r]`-th of row r's stream (`keys[r]`), 53 random bits each."""
    return _shift(_mix(keys + (steps + 1) * _GOLDEN), 11).double() * 2.0**-53


def _buffer(work: dict | None, name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A `[B, V]` buffer from `work` (grown when B grows), or None without a workspace."""
    if work is None:
        return None
    dtype = dtype or like.dtype
    buffer = work.get(name)
    if buffer is None or buffer.shape[0] < like.shape[0] or buffer.shape[1:] != like.shape[1:] or buffer.dtype != dtype:
        buffer = work[name] = torch.empty(like.shape, dtype=dtype, device=like.device)
    return buffer[: like.shape[0]]


def sample(
    logits: torch.Tensor, params: Any, keys: torch.Tensor, steps: torch.Tensor, banned: torch.Tensor | None = None,
    work: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its log-prob under the untruncated distribution.

    Args:
        logits: `[B, V]` float32 next-token logits.
        params: temperature (0 = argmax), top_k, top_p.
        keys, steps: `[B]` int64 each row's random stream and how many tokens it has sampled (`uniform`).
        banned: `[K]` token ids never sampled (a vision-language model's image placeholders: one in a
            completion would give the training forward more image tokens than images).
        work: a dict the caller keeps between calls: the `[B, V]` intermediates are written into buffers kept
            there instead of fresh tensors. On a CPU a fresh tensor that large is new memory from the system, and
            its page faults cost more than the arithmetic (the sampling of a 32k vocabulary ran 4x faster reusing
            them); the values are the same either way.

    Returns:
        `[B]` token ids and `[B]` float32 log softmax(logits / temperature)[token] (temperature 1 when
        greedy). Top-k / top-p and `banned` only restrict where samples are drawn from; the log-prob is that
        of the full distribution, which is what the trainer's forward pass computes.
    """
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = (logits if banned is None else logits.index_fill(1, banned, float("-inf"))).argmax(dim=-1)
    else:
        scaled = logits if params.temperature == 1 else torch.div(logits, params.temperature,
                                                                   out=_buffer(work, "scaled", logits))
        logp = torch.log_softmax(scaled, dim=-1, out=_buffer(work, "logp", logits))  # [B, V]
        allowed = logp if banned is None else logp.index_fill(1, banned, float("-inf"))
        if params.top_k > 0 or params.top_p < 1.0:
            probs = torch.softmax(truncate(allowed, params.top_k, params.top_p), dim=-1)
        else:
            probs = torch.exp(logp, out=_buffer(work, "probs", logits)) if banned is None else torch.softmax(allowed, dim=-1)
        token = sample_categorical(probs, uniform(keys, steps), _buffer(work, "cdf", logits, torch.float64))
    return token, logp.gather(1, token[:, None]).squeeze(1)


def sample_categorical(probs: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one index per row of `[B, V]` non-negative weights by inverting the cumulative sum at `[B]` uniform `u`.

    One uniform number per row instead of `torch.multinomial`, which is ~25x slower on CPU for a
    32k vocabulary. The float64 cumsum keeps the rounding error far below any probability that
    matters; `right=True` never returns an index of zero weight. `out`: a `[B, V]` float64 buffer for the sum.
    """
    cdf = torch.cumsum(probs, -1, dtype=torch.float64, out=out)  # [B, V]
    u = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def truncate(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf the `[B, V]` log-probs outside the top-k, then outside the top-p nucleus.

    Top-p keeps the smallest set of most likely tokens whose (top-k renormalised) mass reaches
    `top_p`; the most likely token is always kept.
    """
    if 0 < top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logp, dim=-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        remove = torch.zeros_like(logp, dtype=torch.bool).scatter_(1, order, mass_before >= top_p)
        logp = logp.masked_fill(remove, float("-inf"))
    return logp
