"""Policy losses beyond PPO's clip: SAPO's soft gate, GMPO's geometric-mean ratio, and the covariance-based
token selection of Clip-Cov and KL-Cov.

They share `policy_loss`'s conventions (lmrl/algorithms/losses.py): per-token tensors `[B, T]`, padding
sanitised, everything but `logp` detached, math in float32 at least, a per-token loss reduced by
`aggregate_loss` (with a global `normalizer` for gradient accumulation), the KL to the reference and
per-token `weights` applied the same way, and `PolicyLossMetrics` returned. With ρ = 1 (the first
minibatch) each of them has REINFORCE's gradient -A ∇logp per token (GMPO: per sequence, see there).

How lmrl departs from the papers: Clip-Cov and KL-Cov select tokens within the batch the loss is given
(a micro-batch in the trainer), as verl's implementation does; Clip-Cov's random choice takes an explicit
`generator` so that a run is reproducible.
"""

from __future__ import annotations

import torch

from lmrl.algorithms.aggregation import _check_aggregation
from lmrl.algorithms.checks import _check_clip, _check_kl, _prepare
from lmrl.algorithms.losses import PolicyLossMetrics, _finish, _policy_metrics, _ratio_bounds
from lmrl.algorithms.masking import masked_mean

__all__ = ["clip_cov_loss", "gmpo_loss", "kl_cov_loss", "sapo_loss", "token_covariance"]


def _checks(aggregation, norm_length, normalizer, kl_coef, ref_logp, kl_estimator, kl_clamp) -> None:
    _check_aggregation("aggregation", aggregation, norm_length, normalizer)
    _check_kl(kl_coef, ref_logp, kl_estimator, kl_clamp)


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    norm_length: float | None = None,
    weights: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    kl_clamp: str | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """SAPO: a smooth, temperature-controlled gate on the ratio instead of a hard clip (Gao et al. 2025, "Soft
    Adaptive Policy Optimization", Qwen team, arXiv:2511.20347).

    Per real token, with ρ = exp(logp - old_logp), σ the logistic function and τ = tau_pos where A > 0,
    tau_neg where A <= 0:

        ℓ = -(4 / τ) · σ(τ (ρ - 1)) · A

    d ℓ / d logp = -4 σ(1 - σ) ρ A: the gate 4σ(1 - σ) is 1 at ρ = 1 (REINFORCE's gradient on the first
    minibatch, as PPO) and decays smoothly as ρ leaves 1, where PPO's clip drops the gradient at once.
    A larger τ decays faster; the paper gives negative advantages the larger temperature (their updates
    raise many other tokens' probabilities, the less stable side). lmrl's defaults 1.0 / 1.05: tune them.

    Args:
        logp, old_logp, advantages, mask: as in `policy_loss`.
        tau_pos, tau_neg: gate temperatures (> 0) for positive and non-positive advantages.
        ref_logp, kl_coef, kl_estimator, aggregation, norm_length, weights, normalizer, kl_clamp: as in
            `policy_loss`.

    Returns:
        (loss, metrics); `clipfrac` counts tokens whose gate 4σ(1 - σ) fell below 1/2 (its gradient more
        than halved), split into `clipfrac_low` (ρ < 1) and `clipfrac_high` (ρ > 1).
    """
    _checks(aggregation, norm_length, normalizer, kl_coef, ref_logp, kl_estimator, kl_clamp)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos, tau_neg: must be > 0, got {tau_pos!r}, {tau_neg!r}")
    batch = _prepare(logp, old_logp, advantages, mask, ref_logp, weights)
    adv = batch.advantages
    ratio = torch.exp(batch.log_ratio)
    tau = torch.where(adv > 0, torch.tensor(tau_pos, dtype=ratio.dtype, device=ratio.device),
                      torch.tensor(tau_neg, dtype=ratio.dtype, device=ratio.device))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -(4.0 / tau) * gate * adv
    loss, kl = _finish(per_token, batch, kl_coef, kl_estimator, kl_clamp, aggregation, norm_length, normalizer)
    g, r = gate.detach(), ratio.detach()
    soft = 4.0 * g * (1.0 - g) < 0.5
    return loss, _policy_metrics(batch.log_ratio, r, batch.mask, soft & (r < 1), soft & (r > 1), None, kl)


def gmpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = 0.4,
    clip_high: float | None = 0.4,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "seq-mean-token-mean",
    norm_length: float | None = None,
    weights: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    kl_clamp: str | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """GMPO: the geometric mean of the token ratios instead of their arithmetic mean (Zhao et al. 2025,
    "Geometric-Mean Policy Optimization", arXiv:2507.20673).

    With l_t = logp_t - old_logp_t, A the sequence's advantage (the mean over its real tokens) and the
    token clip taken in log space, on the side that matters for the sign of A (as PPO's min does):

        l̂_t = sgn(A) · min(sgn(A) · l_t, sgn(A) · clip(l_t, -clip_low, clip_high))
        s   = exp((1 / |y|) Σ_t l̂_t)          (the geometric mean of the clipped token ratios)
        ℓ   = -A · s                          per sequence, on each of its real tokens

    so "seq-mean-token-mean" (the default) gives (1/B) Σ_i ℓ_i in value and gradient. One outlier token
    moves a geometric mean far less than an arithmetic one, which is why the paper can widen the clip to
    (e^-0.4, e^0.4), the defaults here. On the first minibatch (s = 1) a token's gradient is -A ∇logp / |y|.

    Args:
        logp, old_logp, advantages, mask: as in `policy_loss`.
        clip_low, clip_high: bounds of the token log-ratio, [-clip_low, clip_high] (>= 0); None = unbounded.
        ref_logp, kl_coef, kl_estimator, aggregation, norm_length, weights, normalizer, kl_clamp: as in
            `policy_loss`.

    Returns:
        (loss, metrics); `clipfrac` counts tokens whose clipped log-ratio was taken; ratios reported are s.
    """
    _checks(aggregation, norm_length, normalizer, kl_coef, ref_logp, kl_estimator, kl_clamp)
    _check_clip("clip_low", clip_low)
    _check_clip("clip_high", clip_high)
    batch = _prepare(logp, old_logp, advantages, mask, ref_logp, weights)
    mask, log_ratio = batch.mask, batch.log_ratio  # [B, T]
    adv = masked_mean(batch.advantages, mask, dim=-1)  # [B]
    sign = torch.sign(adv).unsqueeze(-1)  # [B, 1]
    lower = None if clip_low is None else -clip_low
    clipped = log_ratio if lower is None and clip_high is None else log_ratio.clamp(min=lower, max=clip_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clipped)  # [B, T]
    seq_ratio = torch.exp(masked_mean(kept, mask, dim=-1))  # [B] s_i
    per_token = (-adv * seq_ratio).unsqueeze(-1).expand_as(log_ratio)
    loss, kl = _finish(per_token, batch, kl_coef, kl_estimator, kl_clamp, aggregation, norm_length, normalizer)
    lr = log_ratio.detach()
    low = (sign < 0) & (lr < lower) if lower is not None else None
    high = (sign > 0) & (lr > clip_high) if clip_high is not None else None
    s = seq_ratio.detach().unsqueeze(-1).expand_as(lr)
    return loss, _policy_metrics(log_ratio, s, mask, low, high, None, kl)


def token_covariance(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token centred covariance term (A_t - mean A) · (logp_t - mean logp) over the batch's real tokens.

    Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv:2505.22617) show that the policy's entropy falls by the covariance of a token's log-prob and its
    advantage: tokens with a large term are those that collapse the entropy. Detached; padding is 0.

    Args:
        logp: `[B, T]` log-probs of the sampled tokens. advantages: `[B, T]`. mask: `[B, T]` bool.

    Returns:
        `[B, T]` covariance terms.
    """
    with torch.no_grad():
        lp, adv = logp.detach(), advantages.detach()
        cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))
        return torch.where(mask, cov, torch.zeros((), dtype=cov.dtype, device=cov.device))


def clip_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = 0.2,
    clip_high: float | None = 0.2,
    clip_fraction: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    generator: torch.Generator | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    norm_length: float | None = None,
    weights: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    kl_clamp: str | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """Clip-Cov: PPO's clipped loss, with the gradient of a few high-covariance tokens dropped (Cui et al.
    2025, arXiv:2505.22617, eq. 10).

    Among the real tokens that PPO's clip did not already drop and whose `token_covariance` lies in
    (cov_low, cov_high), max(1, ⌊clip_fraction · N⌋) are chosen at random (N real tokens) and their loss
    is set to 0 (no gradient): the updates that would collapse the entropy most are skipped, keeping
    exploration alive. Everything else is `policy_loss` with token ratios.

    Args:
        logp, old_logp, advantages, mask, clip_low, clip_high: as in `policy_loss`.
        clip_fraction: share of the real tokens to drop, in [0, 1] (the paper: 2e-4).
        cov_low, cov_high: the covariance band the dropped tokens come from (the paper: 1 and 5).
        generator: the random choice's generator (None: torch's global one).
        ref_logp, kl_coef, kl_estimator, aggregation, norm_length, weights, normalizer, kl_clamp: as in
            `policy_loss`.

    Returns:
        (loss, metrics); `clipfrac` adds the dropped tokens (`dual_clipfrac` reports them alone).
    """
    _checks(aggregation, norm_length, normalizer, kl_coef, ref_logp, kl_estimator, kl_clamp)
    _check_clip("clip_low", clip_low, upper=1.0)
    _check_clip("clip_high", clip_high)
    if not 0 <= clip_fraction <= 1:
        raise ValueError(f"clip_fraction: must be in [0, 1], got {clip_fraction!r}")
    if not cov_low < cov_high:
        raise ValueError(f"cov_low: must be below cov_high, got {cov_low!r} and {cov_high!r}")
    batch = _prepare(logp, old_logp, advantages, mask, ref_logp, weights)
    adv, mask = batch.advantages, batch.mask
    ratio = torch.exp(batch.log_ratio)
    lower, upper = _ratio_bounds(clip_low, clip_high)
    unclipped_loss, clipped_loss = -adv * ratio, -adv * ratio.clamp(min=lower, max=upper)
    per_token = torch.maximum(unclipped_loss, clipped_loss)
    with torch.no_grad():
        clipped = mask & (clipped_loss > unclipped_loss)  # PPO's clip already dropped these
        cov = token_covariance(batch.logp, adv, mask)
        band = mask & ~clipped & (cov > cov_low) & (cov < cov_high)
        candidates = band.flatten().nonzero().flatten()
        count = min(max(int(clip_fraction * int(mask.sum())), 1), candidates.numel()) if clip_fraction > 0 else 0
        pick = torch.randperm(candidates.numel(), generator=generator, device="cpu")[:count].to(candidates.device)
        dropped = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        dropped[candidates[pick]] = True
        dropped = dropped.view_as(mask)
    per_token = torch.where(dropped, torch.zeros((), dtype=per_token.dtype, device=per_token.device), per_token)
    loss, kl = _finish(per_token, batch, kl_coef, kl_estimator, kl_clamp, aggregation, norm_length, normalizer)
    low, high = clipped & (adv < 0), clipped & (adv > 0)
    return loss, _policy_metrics(batch.log_ratio, ratio.detach(), mask, low, high | dropped, dropped, kl)


def kl_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_fraction: float = 2e-3,
    cov_kl_coef: float = 1.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    norm_length: float | None = None,
    weights: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    kl_clamp: str | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """KL-Cov: the unclipped surrogate, with a KL penalty on the highest-covariance tokens only (Cui et al.
    2025, arXiv:2505.22617, eq. 11).

    Per real token, ℓ = -ρ A; on the max(1, ⌊kl_fraction · N⌋) tokens with the largest
    `token_covariance` (N real tokens), ℓ = -ρ A + cov_kl_coef · |logp - old_logp|: those tokens are held
    near the old policy, the rest move freely (no clip).

    Args:
        logp, old_logp, advantages, mask: as in `policy_loss`.
        kl_fraction: share of the real tokens penalised, in [0, 1] (the paper: 2e-3 for Qwen2.5-7B).
        cov_kl_coef: weight of the |log-ratio| penalty (>= 0; the paper: 1).
        ref_logp, kl_coef, kl_estimator, aggregation, norm_length, weights, normalizer, kl_clamp: as in
            `policy_loss` (that KL is to the reference; this one is to the old policy).

    Returns:
        (loss, metrics); `clipfrac` (and `dual_clipfrac`) report the penalised tokens' share.
    """
    _checks(aggregation, norm_length, normalizer, kl_coef, ref_logp, kl_estimator, kl_clamp)
    if not 0 <= kl_fraction <= 1:
        raise ValueError(f"kl_fraction: must be in [0, 1], got {kl_fraction!r}")
    if not cov_kl_coef >= 0:
        raise ValueError(f"cov_kl_coef: must be >= 0, got {cov_kl_coef!r}")
    batch = _prepare(logp, old_logp, advantages, mask, ref_logp, weights)
    adv, mask, log_ratio = batch.advantages, batch.mask, batch.log_ratio
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        real = int(mask.sum())
        count = min(max(int(kl_fraction * real), 1), real) if kl_fraction > 0 else 0
        cov = torch.where(mask, token_covariance(batch.logp, adv, mask), float("-inf")).flatten()
        chosen = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        chosen[torch.topk(cov, count).indices] = True
        chosen = chosen.view_as(mask)
    per_token = -adv * ratio + torch.where(chosen, cov_kl_coef * log_ratio.abs(), 0.0)
    loss, kl = _finish(per_token, batch, kl_coef, kl_estimator, kl_clamp, aggregation, norm_length, normalizer)
    return loss, _policy_metrics(log_ratio, ratio.detach(), mask, None, chosen, chosen, kl)
