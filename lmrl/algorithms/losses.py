"""Policy and value losses: PPO-clip (GRPO, Dr. GRPO, DAPO, REINFORCE), GSPO, CISPO.

Every loss is built the same way: its inputs are checked and sanitised (`checks.py`), a per-token loss
`[B, T]` is computed from the sampled tokens' log-probs, then `aggregate_loss` (`aggregation.py`) reduces
it to a scalar with one of five normalisations. Which normalisation an algorithm uses matters as much as
its surrogate (Dr. GRPO, Liu et al. 2025).

How lmrl departs from the papers, on purpose:

1. Inputs are sanitised first: padding positions of `logp`, `old_logp`, `advantages`, `ref_logp`
   and `weights` are replaced by zeros before any arithmetic, so inf/NaN in padding never reach the
   loss or the gradient of real tokens.
2. The math runs in float32 at least (bf16 log-probs are upcast): ratios are exponentials of
   differences of nearly equal numbers, where bf16's 8-bit mantissa is too coarse.
3. `old_logp`, `advantages`, `ref_logp` and `weights` are treated as constants (detached); only
   `logp` (and `values` in `value_loss`) carries gradient.
4. Every aggregation accepts a global `normalizer` so that gradient accumulation over micro-batches
   reproduces the full-batch loss exactly (see `aggregate_loss` and `loss_normalizer`).

The entropy bonus is not part of these losses: the trainer adds
`-entropy_coef * aggregate_loss(entropy, mask, mode)` with the same aggregation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass

import torch

from lmrl.algorithms.aggregation import _check_aggregation, aggregate_loss
from lmrl.algorithms.checks import (
    _as_bool_mask,
    _check_choice,
    _check_clip,
    _check_kl,
    _check_same_shape,
    _clean,
    _compute_dtype,
    _prepare,
    _TokenBatch,
)
from lmrl.algorithms.kl import kl_penalty
from lmrl.algorithms.masking import masked_mean, masked_sum, masked_var

__all__ = [
    "PolicyLossMetrics",
    "ValueLossMetrics",
    "cispo_loss",
    "cpgd_loss",
    "explained_variance",
    "policy_loss",
    "value_loss",
]

_RATIO_LEVELS = ("token", "sequence", "sequence-sum")


# --------------------------------------------------------------------------------------------------
# records


class _Metrics(Mapping):
    """Read-only mapping view of a metrics record: `m["clipfrac"]`, `"kl" in m`, `dict(m)`.

    Fields that are None (e.g. `kl` without a reference) are absent from the mapping.
    """

    def to_dict(self) -> dict[str, float]:
        """The metrics as a flat dict for metric sinks, without None fields."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def __getitem__(self, key: str) -> float:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


@dataclass(frozen=True)
class PolicyLossMetrics(_Metrics):
    """Diagnostics of one `policy_loss` / `cispo_loss` call, as Python floats (masked token means).

    Attribute access (`m.clipfrac`) and mapping access (`m["clipfrac"]`, `dict(m)`) both work.

    Attributes:
        clipfrac: fraction of real tokens whose ratio was clipped, `clipfrac_low + clipfrac_high`.
            For PPO-clip a token counts when the clipped branch of the min is the one taken, i.e. its
            gradient is zeroed: (A > 0 and ρ > 1 + clip_high) or (A < 0 and ρ < 1 - clip_low). A
            ratio outside the range with the other sign of A is not clipped (the unclipped branch is
            smaller and keeps its gradient). For CISPO a token counts when its IS weight was
            truncated, whatever the sign of A (CISPO never zeroes a gradient).
        clipfrac_low: the part of `clipfrac` at the lower bound.
        clipfrac_high: the part of `clipfrac` at the upper bound.
        dual_clipfrac: fraction of real tokens where the dual-clip bound (A < 0) was active; 0 without it.
        approx_kl: KL(π_old ‖ π_θ) estimated with k3 on the sampled tokens (Schulman 2020):
            mean of (ρ - 1) - log ρ with ρ = π_θ / π_old per token. Unbiased for samples from π_old,
            never negative, exactly 0 when `logp == old_logp`. Always token-level, also for GSPO.
        ratio_mean: mean of the ratio used in the loss (the sequence ratio s_i for GSPO).
        ratio_max: max of that ratio over real tokens.
        kl: mean per-token KL to the reference with the chosen estimator; None when no `ref_logp`.
    """

    clipfrac: float
    clipfrac_low: float
    clipfrac_high: float
    dual_clipfrac: float
    approx_kl: float
    ratio_mean: float
    ratio_max: float
    kl: float | None = None


@dataclass(frozen=True)
class ValueLossMetrics(_Metrics):
    """Diagnostics of one `value_loss` call, as Python floats.

    Attributes:
        vf_clipfrac: fraction of real tokens where the clipped value error was the larger one (taken by the
            max, so the token has no value gradient). A value within `clip` of its old value never counts.
        value_mean: masked mean of the predicted values.
    """

    vf_clipfrac: float
    value_mean: float


# --------------------------------------------------------------------------------------------------
# helpers


def _masked_max(x: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    if x.numel() == 0:
        return x.new_full((), fill)
    return torch.where(mask, x, torch.full((), fill, dtype=x.dtype, device=x.device)).max()


def _to_floats(*values: torch.Tensor) -> list[float]:
    # One device->host copy for all metrics instead of one .item() sync each; float64 inputs keep
    # float64 precision, everything else is reported from float32.
    dtype = torch.float64 if any(v.dtype == torch.float64 for v in values) else torch.float32
    return torch.stack([v.detach().to(dtype) for v in values]).tolist()


def _finish(
    per_token: torch.Tensor,
    batch: _TokenBatch,
    kl_coef: float,
    kl_estimator: str,
    kl_clamp: str | None,
    aggregation: str,
    norm_length: float | None,
    normalizer: float | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss, aggregate_loss((per_token + kl_coef * KL) * weights), and the `[B, T]` KL (or None)."""
    kl = None
    if batch.ref_logp is not None:
        kl = kl_penalty(batch.logp, batch.ref_logp, kl_estimator, kl_clamp)
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl
    if batch.weights is not None:
        per_token = per_token * batch.weights
    return aggregate_loss(per_token, batch.mask, aggregation, norm_length, normalizer=normalizer), kl


def _ratio_bounds(clip_low: float | None, clip_high: float | None) -> tuple[float | None, float | None]:
    """The ratio's clip range (1 - clip_low, 1 + clip_high); None leaves that side open."""
    return None if clip_low is None else 1.0 - clip_low, None if clip_high is None else 1.0 + clip_high


def _clipped_surrogate(
    adv: torch.Tensor,
    ratio: torch.Tensor,
    clip_low: float | None,
    clip_high: float | None,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's -min(ρA, clip(ρ)A), capped at dual_clip * |A| where A < 0, and where that cap held; [B, T] or [B]."""
    loss = -adv * ratio
    if clip_low is not None or clip_high is not None:
        lower, upper = _ratio_bounds(clip_low, clip_high)
        loss = torch.maximum(loss, -adv * ratio.clamp(min=lower, max=upper))
    if dual_clip is None:
        return loss, torch.zeros_like(adv, dtype=torch.bool)
    bound = -dual_clip * adv  # dual_clip * |A| where A < 0
    negative = adv < 0
    return torch.where(negative, torch.minimum(loss, bound), loss), negative & (loss > bound)


def _clipped_sides(
    adv: torch.Tensor, ratio: torch.Tensor, clip_low: float | None, clip_high: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where PPO's clipped branch is taken (gradient zeroed), at the lower and the upper bound; [B, T] or [B]."""
    # only where clipping moves the objective down: A < 0 below the range, A > 0 above it
    nowhere = torch.zeros_like(adv, dtype=torch.bool)
    low = (adv < 0) & (ratio < 1.0 - clip_low) if clip_low is not None else nowhere
    high = (adv > 0) & (ratio > 1.0 + clip_high) if clip_high is not None else nowhere
    return low, high


# --------------------------------------------------------------------------------------------------
# policy losses


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = 0.2,
    clip_high: float | None = 0.2,
    dual_clip: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    ratio_level: str = "token",
    norm_length: float | None = None,
    weights: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    kl_clamp: str | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """PPO clipped surrogate with the variants of GRPO, Dr. GRPO, DAPO, REINFORCE(++) and GSPO.

    Per real token, with ρ = exp(logp - old_logp):

        ℓ = -min(ρ A, clip(ρ, 1 - clip_low, 1 + clip_high) A)            (Schulman et al. 2017)
        ℓ = min(ℓ, dual_clip · |A|)   for A < 0, when dual_clip is set    (Ye et al. 2020, dual-clip PPO)
        ℓ = ℓ + kl_coef · KL_est(π_θ ‖ π_ref)   when ref_logp is given    (GRPO, Shao et al. 2024)
        ℓ = ℓ · w                               when weights are given

    then `aggregate_loss(ℓ, mask, aggregation, norm_length)`.

    - Separate `clip_low` / `clip_high` give DAPO's clip-higher (Yu et al. 2025, e.g. 0.2 / 0.28).
    - `clip_low=None` and `clip_high=None` disable clipping: with `old_logp = logp.detach()` the
      gradient is that of -A · logp (REINFORCE). One side may be None alone.
    - `dual_clip` (> 1) bounds the loss of negative-advantage tokens whose ratio exploded: without
      it, -ρA grows without limit when ρ ≫ 1 and A < 0.
    - `ratio_level="sequence"` is GSPO (Zheng et al. 2025): s_i = exp((1/|y_i|) Σ_t (logp - old_logp))
      replaces ρ on every token of sequence i, in the GSPO-token form
      s_{i,t} = sg(s_i) · exp(logp_t - sg(logp_t)), whose value is s_i and whose gradient with
      "seq-mean-token-mean" and sequence-level A equals the GSPO gradient. GSPO's clip ranges are
      tiny (the paper: 3e-4 / 4e-4); pass them, nothing is hard-coded.
    - `ratio_level="sequence-sum"` treats each sequence as one action, as TRL's RLOOTrainer does:
      s_i = exp(Σ_t (logp - old_logp)) (no length normalisation), and the sequence's surrogate
      ℓ_i = -min(s_i Ā_i, clip(s_i) Ā_i) (Ā_i the mean advantage over its real tokens; dual clip
      applies to ℓ_i) is spread evenly over its |y_i| real tokens (ℓ_i / |y_i| each), so that
      "seq-mean-token-sum" gives TRL's (1/B) Σ_i ℓ_i, value and gradient. Metrics report s_i.
    - With `kl_coef=0`, one update per batch and group-normalised advantages, the loss is about 0
      while learning happens (ρ = 1 and A averages to 0); that is expected, the gradient is not 0.
    - `weights` (truncated importance sampling, entropy masks) scale the whole per-token loss,
      KL term included; they do not change the normalizer (a weight of 0 still counts as a token).

    Args:
        logp: `[B, T]` log-probs of the sampled tokens under the policy being trained (with grad).
        old_logp: `[B, T]` log-probs under the policy that the advantages were computed for (no grad).
        advantages: `[B]` (one per sequence, broadcast over tokens) or `[B, T]`.
        mask: `[B, T]` bool or 0/1, real response tokens. Padding may hold anything in every input.
        clip_low: ε_low, ratio lower bound 1 - ε_low (in [0, 1]); None = no lower bound.
        clip_high: ε_high, ratio upper bound 1 + ε_high (>= 0); None = no upper bound.
        dual_clip: c > 1 of dual-clip PPO; None disables it.
        ref_logp: `[B, T]` reference-model log-probs; enables the KL term and the `kl` metric.
        kl_coef: β, weight of the KL term (>= 0); > 0 requires `ref_logp`.
        kl_estimator: "k1", "k2", "k3" (GRPO uses k3) or "k3+" (k3's value, k2's gradient).
        aggregation: one of `AGGREGATION_MODES`.
        ratio_level: "token" (PPO/GRPO), "sequence" (GSPO) or "sequence-sum" (TRL's RLOO).
        norm_length: the constant of "seq-mean-token-sum-norm".
        weights: `[B, T]` per-token multipliers, treated as constants.
        normalizer: global normaliser for gradient accumulation (see `aggregate_loss`).
        kl_clamp: None, "verl" or "openrlhf": that framework's clamping of the KL term (`kl_penalty`).

    Returns:
        (loss, metrics): a 0-dim tensor (float32, or float64 for float64 inputs) and `PolicyLossMetrics`.
    """
    _check_aggregation("aggregation", aggregation, norm_length, normalizer)
    _check_choice("ratio_level", ratio_level, _RATIO_LEVELS)
    _check_clip("clip_low", clip_low, upper=1.0)
    _check_clip("clip_high", clip_high)
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip: must be > 1 or None, got {dual_clip!r}")
    _check_kl(kl_coef, ref_logp, kl_estimator, kl_clamp)
    batch = _prepare(logp, old_logp, advantages, mask, ref_logp, weights)
    if ratio_level == "sequence-sum":
        return _sequence_sum_loss(batch, clip_low, clip_high, dual_clip, kl_coef, kl_estimator, kl_clamp,
                                  aggregation, norm_length, normalizer)
    log_ratio = batch.log_ratio  # [B, T], 0 on padding
    if ratio_level == "sequence":
        seq_log_ratio = masked_mean(batch.log_ratio, batch.mask, dim=-1)  # [B]
        # GSPO-token: value s_i on every token, d/d logp_t = s_i.
        log_ratio = seq_log_ratio.detach().unsqueeze(-1) + batch.logp - batch.logp.detach()
    ratio = torch.exp(log_ratio)
    per_token, dual = _clipped_surrogate(batch.advantages, ratio, clip_low, clip_high, dual_clip)
    loss, kl = _finish(per_token, batch, kl_coef, kl_estimator, kl_clamp, aggregation, norm_length, normalizer)
    low, high = _clipped_sides(batch.advantages, ratio.detach(), clip_low, clip_high)
    return loss, _policy_metrics(batch.log_ratio, ratio.detach(), batch.mask, low, high, dual, kl)


def _sequence_sum_loss(
    batch: _TokenBatch,
    clip_low: float | None,
    clip_high: float | None,
    dual_clip: float | None,
    kl_coef: float,
    kl_estimator: str,
    kl_clamp: str | None,
    aggregation: str,
    norm_length: float | None,
    normalizer: float | torch.Tensor | None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """`policy_loss` with ratio_level="sequence-sum": one clipped surrogate per sequence (TRL's RLOOTrainer)."""
    mask = batch.mask
    lengths = mask.sum(dim=-1)  # [B]
    adv = masked_mean(batch.advantages, mask, dim=-1)  # [B]
    ratio = torch.exp(masked_sum(batch.log_ratio, mask, dim=-1))  # [B] s_i = π_θ(y_i) / π_old(y_i)
    loss_seq, dual = _clipped_surrogate(adv, ratio, clip_low, clip_high, dual_clip)  # [B]
    # spread each sequence's surrogate over its real tokens: their sum is ℓ_i
    per_token = (loss_seq / lengths.clamp(min=1)).unsqueeze(-1).expand_as(batch.log_ratio)
    loss, kl = _finish(per_token, batch, kl_coef, kl_estimator, kl_clamp, aggregation, norm_length, normalizer)
    r = ratio.detach()
    low, high = _clipped_sides(adv, r, clip_low, clip_high)
    r, low, high, dual = (x.unsqueeze(-1).expand_as(mask) for x in (r, low, high, dual))  # [B] -> [B, T]
    return loss, _policy_metrics(batch.log_ratio, r, mask, low, high, dual, kl)


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float | None = 3.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    norm_length: float | None = None,
    weights: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    kl_clamp: str | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """CISPO: clip the importance-sampling weight, not the update (MiniMax-M1, Chen et al. 2025, eq. 4-5).

    Per real token, with ρ = exp(logp - old_logp) and sg the stop-gradient:

        ℓ = -sg(clip(ρ, 1 - clip_low, 1 + clip_high)) · A · logp  (+ kl_coef · KL, · weights)

    The gradient is -sg(ρ̂) A ∇logp: every token keeps a gradient (PPO's clip drops tokens whose
    ratio left the range, often the rare "fork" tokens of a reasoning chain); only the weight's size
    is bounded. The loss *value* is not a surrogate objective (it scales with logp); only its
    gradient is meaningful, as for REINFORCE.

    Defaults follow the paper where it says something: no lower bound (it sets ε_low^IS large so
    only ε_high^IS matters), no KL term, token-level normalisation 1/Σ_i |o_i| ("token-mean"). The
    report gives no value for ε_high^IS; the default cap ρ̂ <= 4 (`clip_high=3.0`) is the one
    Tinker's CISPO loss documents; tune it.

    Args:
        logp: `[B, T]` log-probs of the sampled tokens under the policy being trained (with grad).
        old_logp: `[B, T]` log-probs under the behaviour policy (no grad).
        advantages: `[B]` (broadcast over tokens) or `[B, T]`.
        mask: `[B, T]` bool or 0/1, real response tokens.
        clip_low: weight lower bound 1 - clip_low (in [0, 1]); None = no lower bound.
        clip_high: weight upper bound 1 + clip_high (>= 0); None = no upper bound.
        ref_logp, kl_coef, kl_estimator, aggregation, norm_length, weights, normalizer, kl_clamp: as in
            `policy_loss`.

    Returns:
        (loss, metrics) as in `policy_loss`; `clipfrac` counts tokens whose weight was truncated.
    """
    _check_aggregation("aggregation", aggregation, norm_length, normalizer)
    _check_clip("clip_low", clip_low, upper=1.0)
    _check_clip("clip_high", clip_high)
    _check_kl(kl_coef, ref_logp, kl_estimator, kl_clamp)
    batch = _prepare(logp, old_logp, advantages, mask, ref_logp, weights)
    ratio = torch.exp(batch.log_ratio.detach())  # [B, T]
    lower, upper = _ratio_bounds(clip_low, clip_high)
    is_weight = ratio if lower is None and upper is None else ratio.clamp(min=lower, max=upper)
    per_token = -is_weight * batch.advantages * batch.logp
    loss, kl = _finish(per_token, batch, kl_coef, kl_estimator, kl_clamp, aggregation, norm_length, normalizer)
    low = ratio < lower if lower is not None else None
    high = ratio > upper if upper is not None else None
    return loss, _policy_metrics(batch.log_ratio, ratio, batch.mask, low, high, None, kl)


def cpgd_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = 0.2,
    clip_high: float | None = 0.2,
    drift_coef: float = 0.1,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    norm_length: float | None = None,
    weights: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    kl_clamp: str | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """CPGD: a clipped *log*-ratio surrogate plus a policy-drift penalty (Liu et al. 2025, "CPGD: Toward
    Stable Rule-based Reinforcement Learning for Language Models", arXiv:2505.12504; LightRFT's "cpgd").

    Per real token, with l = logp - old_logp (the log of PPO's ratio ρ):

        ℓ = -min(l A, clip(l, ln(1 - clip_low), ln(1 + clip_high)) A) + drift_coef · ((ρ - 1) - l)

    PPO's surrogate ρA grows exponentially in l when A > 0; l A grows linearly, so one step cannot
    push a token's probability far (the paper's argument for stability). The drift term is the k3
    estimate of KL(π_old ‖ π_θ) on tokens sampled from π_old: 0 with gradient 0 at ρ = 1, so the first
    minibatch's update is REINFORCE's -A ∇logp, as for PPO; later minibatches are pulled back toward
    π_old. lmrl's default drift_coef = 0.1 is not the paper's (tune it); the KL to the reference and
    `weights` act as in `policy_loss`.

    Args:
        logp, old_logp, advantages, mask: as in `policy_loss`.
        clip_low, clip_high: ε of the log-ratio bounds ln(1 - ε_low), ln(1 + ε_high); None = unbounded.
        drift_coef: α >= 0, weight of the policy-drift penalty.
        ref_logp, kl_coef, kl_estimator, aggregation, norm_length, weights, normalizer, kl_clamp: as in
            `policy_loss`.

    Returns:
        (loss, metrics) as in `policy_loss`; `clipfrac` counts tokens whose clipped branch was taken.
    """
    _check_aggregation("aggregation", aggregation, norm_length, normalizer)
    _check_clip("clip_low", clip_low, upper=1.0)
    _check_clip("clip_high", clip_high)
    if not drift_coef >= 0:
        raise ValueError(f"drift_coef: must be >= 0, got {drift_coef!r}")
    _check_kl(kl_coef, ref_logp, kl_estimator, kl_clamp)
    if clip_low == 1.0:
        clip_low = None  # ln(0): no lower bound
    batch = _prepare(logp, old_logp, advantages, mask, ref_logp, weights)
    adv, log_ratio = batch.advantages, batch.log_ratio  # [B, T]
    lower = None if clip_low is None else math.log(1.0 - clip_low)
    upper = None if clip_high is None else math.log1p(clip_high)
    clipped = log_ratio if lower is None and upper is None else log_ratio.clamp(min=lower, max=upper)
    per_token = torch.maximum(-adv * log_ratio, -adv * clipped)  # -min(l A, clip(l) A)
    if drift_coef:
        per_token = per_token + drift_coef * (torch.expm1(log_ratio) - log_ratio)
    loss, kl = _finish(per_token, batch, kl_coef, kl_estimator, kl_clamp, aggregation, norm_length, normalizer)
    lr = log_ratio.detach()
    low = (adv < 0) & (lr < lower) if lower is not None else None
    high = (adv > 0) & (lr > upper) if upper is not None else None
    return loss, _policy_metrics(log_ratio, torch.exp(lr), batch.mask, low, high, None, kl)


@torch.no_grad()
def _policy_metrics(
    token_log_ratio: torch.Tensor,
    ratio: torch.Tensor,
    mask: torch.Tensor,
    low: torch.Tensor | None,
    high: torch.Tensor | None,
    dual: torch.Tensor | None,
    kl: torch.Tensor | None,
) -> PolicyLossMetrics:
    """A loss's metrics from its `[B, T]` token log-ratio, the ratio it used and its clipped tokens (None: none)."""
    lr = token_log_ratio.detach()
    low, high, dual = (torch.zeros_like(mask) if x is None else x for x in (low, high, dual))
    values = [
        masked_mean(low.to(lr.dtype), mask),
        masked_mean(high.to(lr.dtype), mask),
        masked_mean(dual.to(lr.dtype), mask),
        masked_mean(torch.expm1(lr) - lr, mask),  # k3 estimate of KL(old ‖ new)
        masked_mean(ratio, mask),
        _masked_max(ratio, mask, fill=0.0),  # ratios are > 0, so 0 never wins over a real token
    ]
    if kl is not None:
        values.append(masked_mean(kl.detach(), mask))
    floats = _to_floats(*values)
    clip_low, clip_high, dual_frac, approx_kl, ratio_mean, ratio_max = floats[:6]
    return PolicyLossMetrics(
        clipfrac=clip_low + clip_high,
        clipfrac_low=clip_low,
        clipfrac_high=clip_high,
        dual_clipfrac=dual_frac,
        approx_kl=approx_kl,
        ratio_mean=ratio_mean,
        ratio_max=ratio_max,
        kl=floats[6] if kl is not None else None,
    )


# --------------------------------------------------------------------------------------------------
# value losses


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    *,
    aggregation: str = "token-mean",
    norm_length: float | None = None,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, ValueLossMetrics]:
    """PPO clipped value loss (Schulman et al. 2017; as in OpenAI baselines' ppo2).

    Per real token:

        ℓ = ½ max((V - R)², (clip(V, V_old - c, V_old + c) - R)²)

    i.e. the critic cannot gain by moving further than c from its rollout-time prediction. `clip=None`
    gives the plain ½ (V - R)². Aggregated like the policy loss ("token-mean" by default).

    Args:
        values: `[B, T]` critic predictions being trained (with grad).
        old_values: `[B, T]` predictions at rollout time (no grad).
        returns: `[B, T]` regression targets, e.g. GAE returns (no grad).
        mask: `[B, T]` bool or 0/1, real response tokens.
        clip: c > 0, or None for no clipping.
        aggregation, norm_length, normalizer: as in `aggregate_loss`.

    Returns:
        (loss, metrics): a 0-dim tensor and `ValueLossMetrics`.
    """
    _check_aggregation("aggregation", aggregation, norm_length, normalizer)
    if clip is not None and not clip > 0:
        raise ValueError(f"clip: must be > 0 or None, got {clip!r}")
    mask = _as_bool_mask(mask, values, "values")
    _check_same_shape("old_values", old_values, "values", values)
    _check_same_shape("returns", returns, "values", values)
    dtype = _compute_dtype(values.dtype)
    v = _clean(values, mask, dtype)
    v_old = _clean(old_values.detach(), mask, dtype)
    ret = _clean(returns.detach(), mask, dtype)

    err = (v - ret) ** 2
    if clip is None:
        per_token = 0.5 * err
        clipped = torch.zeros_like(mask)
    else:
        # Clamp V itself (not V_old + clamp(V - V_old), which rounds differently from V inside the
        # range): a value within c of V_old is then bit-exactly V, and never counted as clipped.
        v_clipped = torch.minimum(torch.maximum(v, v_old - clip), v_old + clip)
        err_clipped = (v_clipped - ret) ** 2
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clipped = err_clipped > err
    loss = aggregate_loss(per_token, mask, aggregation, norm_length, normalizer=normalizer)

    with torch.no_grad():
        vf_clipfrac, value_mean = _to_floats(masked_mean(clipped.to(dtype), mask), masked_mean(v, mask))
    return loss, ValueLossMetrics(vf_clipfrac=vf_clipfrac, value_mean=value_mean)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over real tokens: 1 is a perfect critic, 0 no better than a constant.

    Uses population variances (the correction would cancel). Returns NaN when the returns are
    constant (Var[R] = 0), where the ratio is undefined.

    Args:
        values: `[B, T]` critic predictions (usually the rollout-time ones).
        returns: `[B, T]` targets.
        mask: `[B, T]` bool or 0/1, real response tokens.
    """
    _check_same_shape("returns", returns, "values", values)
    _check_same_shape("mask", mask, "values", values)
    mask = mask.to(torch.bool)
    with torch.no_grad():
        dtype = _compute_dtype(values.dtype)
        v, ret = _clean(values, mask, dtype), _clean(returns, mask, dtype)
        var_ret, var_err = _to_floats(
            masked_var(ret, mask, unbiased=False), masked_var(ret - v, mask, unbiased=False)
        )
    if var_ret == 0.0:
        return float("nan")
    return 1.0 - var_err / var_ret
