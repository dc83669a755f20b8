"""KL divergence against a frozen reference policy, estimated from sampled tokens.

Only the log-probabilities of the sampled tokens are known, so KL(π ‖ π_ref) is estimated per token
from the log-ratio r = log π_ref(x) - log π(x), with x ~ π (J. Schulman, "Approximating KL
divergence", 2020, http://joschu.net/blog/kl-approx.html):

    k1 = -r                  unbiased, high variance, can be negative per token
    k2 = r² / 2              biased (its expectation is ~KL only for close policies), always >= 0
    k3 = (e^r - 1) - r       unbiased and always >= 0, lower variance when π ≈ π_ref

Where each belongs (DESIGN.md, "Correctness rules"): k1 is the textbook form for a KL penalty *in the
reward* (PPO-RLHF, REINFORCE++); k3 is what GRPO (DeepSeekMath, eq. 4) puts *in the loss*. As a
value k3 is unbiased; as a loss its gradient is not the gradient of KL(π ‖ π_ref). For on-policy
samples (x drawn from π, treated as fixed): E[∇k1] = E[∇log π] = 0, E[∇k2] = ∇KL(π ‖ π_ref), and
E[∇k3] = ∇KL(π_ref ‖ π), the forward KL.

"k3+" (verl's name) is k3's value with k2's gradient, through a straight-through estimator: the
number reported and added to the loss is k3's, the gradient is the on-policy-unbiased ∇KL(π ‖ π_ref)
of k2.

Clamping, as the peers do it (`KL_CLAMPS`; lmrl clamps nothing by default): ``"verl"`` clamps the
log-ratio to [-20, 20] and the result to [-10, 10] for k3 (and k3+'s value) only; ``"openrlhf"``
clamps every estimator's result to [-10, 10]. A clamped entry has no gradient.

Half-precision inputs are computed in float32 and the result is cast back to the input dtype.

`KLController` holds the coefficient of the KL term, fixed or adaptive toward a target KL (Ziegler et
al. 2019): plain Python arithmetic, checkpointed with the run (`state_dict` / `load_state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmrl.algorithms.masking import masked_sum

__all__ = ["KL_CLAMPS", "KL_ESTIMATORS", "KLController", "kl_penalty", "kl_shaped_rewards", "sequence_kl"]


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # r = log π_ref - log π = -log_ratio. expm1 keeps precision when r ≈ 0, where e^r - 1 - r
    # would otherwise subtract nearly equal numbers.
    r = -log_ratio
    return torch.expm1(r) - r


def _k3_plus(log_ratio: torch.Tensor) -> torch.Tensor:
    # value k3, gradient k2 (straight-through)
    k2 = _k2(log_ratio)
    return k2 + (_k3(log_ratio) - k2).detach()


# One table, chosen by name: each maps log π(x) - log π_ref(x) to a per-token KL estimate.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1, "k2": _k2, "k3": _k3, "k3+": _k3_plus
}
# Peer frameworks' clamping conventions (see the module docstring).
KL_CLAMPS = ("verl", "openrlhf")


def _estimate(log_ratio: torch.Tensor, estimator: str, clamp: str | None) -> torch.Tensor:
    if estimator == "k3+" and clamp is not None:  # the (clamped) k3 value on k2's gradient
        k2 = _k2(log_ratio)
        return k2 + (_estimate(log_ratio, "k3", clamp) - k2).detach()
    if clamp == "verl" and estimator == "k3":
        return _k3(log_ratio.clamp(-20.0, 20.0)).clamp(-10.0, 10.0)
    kl = KL_ESTIMATORS[estimator](log_ratio)
    return kl.clamp(-10.0, 10.0) if clamp == "openrlhf" else kl


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float16 / bfloat16 round the small differences KL is made of; work in float32 at least.
    return torch.promote_types(dtype, torch.float32)


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1", clamp: str | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from the log-probs of tokens sampled from π.

    With log_ratio = logp - ref_logp:

    - ``"k1"``: log_ratio
    - ``"k2"``: ½ · log_ratio²
    - ``"k3"``: exp(ref_logp - logp) - (ref_logp - logp) - 1
    - ``"k3+"``: the value of k3 with the gradient of k2

    (Schulman 2020, "Approximating KL divergence"). Differentiable in both arguments. By default no
    clamping is applied, so a huge log-ratio gives a huge k3; `clamp` reproduces a peer's.

    Args:
        logp: [B, T] (any shape) log-probs of the sampled tokens under the policy.
        ref_logp: same shape as `logp`, log-probs of the same tokens under the reference model.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"k3+"``.
        clamp: None, ``"verl"`` (k3: log-ratio to [-20, 20], result to [-10, 10]) or ``"openrlhf"``
            (every estimator's result to [-10, 10]).

    Returns:
        Tensor of the shape of `logp` and dtype of ``logp - ref_logp`` (computed in at least float32).
        Entries at padding positions are whatever the inputs hold there: mask them downstream.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator: unknown {estimator!r}; allowed: {', '.join(map(repr, KL_ESTIMATORS))}")
    if clamp is not None and clamp not in KL_CLAMPS:
        raise ValueError(f"clamp: unknown {clamp!r}; allowed: None, {', '.join(map(repr, KL_CLAMPS))}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp: shape {tuple(ref_logp.shape)} does not match logp {tuple(logp.shape)}")
    out_dtype = torch.result_type(logp, ref_logp)
    work = _compute_dtype(out_dtype)
    log_ratio = logp.to(work) - ref_logp.to(work)
    return _estimate(log_ratio, estimator, clamp).to(out_dtype)


def sequence_kl(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str = "k1",
    clamp: str | None = None,
) -> torch.Tensor:
    """Sequence-level KL estimate: the per-token estimate summed over each sequence's real tokens.

    KL between two autoregressive policies over whole sequences is the sum of the per-token KLs
    (chain rule), so sum_t k(x_t) estimates KL(π(·|prompt) ‖ π_ref(·|prompt)). This is the
    sequence-level KL that REINFORCE++ / TRL's RLOO subtract from the score
    (``score - kl_coef · sequence_kl``), as opposed to the token-level shaping of `kl_shaped_rewards`.

    Args:
        logp: [B, T] policy log-probs of the sampled response tokens.
        ref_logp: [B, T] reference log-probs of the same tokens.
        mask: [B, T] bool or 0/1, true on real response tokens. Masked entries may hold anything.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"k3+"`` (see `kl_penalty`).
        clamp: a peer's clamping convention (see `kl_penalty`), applied per token.

    Returns:
        [B] summed KL per sequence; 0 for a sequence with no real token.
    """
    if mask.shape != logp.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match logp {tuple(logp.shape)}")
    return masked_sum(kl_penalty(logp, ref_logp, estimator, clamp), mask, dim=-1)


def kl_shaped_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    clip: float | None = None,
) -> torch.Tensor:
    """Per-token rewards with a KL penalty on every token and the score on the last one.

    reward_t = -kl_coef · kl_t on each real response token, plus clip(score, -clip, clip) on the
    last real token of each row (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences"; Ouyang et al. 2022, eq. 2). The last real token is the last true entry of
    `mask`, not ``mask.sum() - 1``: masks may have holes (environment or tool tokens masked out).

    Args:
        scores: [B] sequence scores (reward-function or reward-model outputs).
        kl: [B, T] per-token KL estimates, e.g. ``kl_penalty(logp, ref_logp, "k1")``.
        mask: [B, T] bool or 0/1, true on real response tokens. Masked `kl` entries may hold
            anything (inf, NaN): they never reach the output.
        kl_coef: KL coefficient β >= 0.
        clip: if given (> 0), scores are clamped to [-clip, clip] before being added.

    Returns:
        [B, T] rewards, 0 at masked positions; a row with no real token is all 0 (its score is dropped).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores: expected a 1-D [B] tensor, got shape {tuple(scores.shape)}")
    if kl.dim() != 2 or kl.shape[0] != scores.shape[0]:
        raise ValueError(f"kl: expected shape [B={scores.shape[0]}, T], got {tuple(kl.shape)}")
    if mask.shape != kl.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match kl {tuple(kl.shape)}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef: must be >= 0, got {kl_coef}")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip: must be > 0 or None, got {clip}")

    mask = mask.to(torch.bool)
    out_dtype = torch.result_type(kl, scores)
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    zero = torch.zeros((), dtype=out_dtype, device=kl.device)
    # where(), not kl * mask: garbage (inf / NaN) at masked positions must not leak as NaN.
    rewards = torch.where(mask, -kl_coef * kl.to(out_dtype), zero)  # [B, T]

    if kl.shape[1] == 0:  # no token to put a score on
        return rewards
    # Index of the last true entry per row; -1 for an empty row, which then matches no position.
    positions = torch.arange(kl.shape[1], device=kl.device)  # [T]
    last = torch.where(mask, positions, -1).amax(dim=1, keepdim=True)  # [B, 1]
    at_last = positions == last  # [B, T]
    return rewards + torch.where(at_last, scores.to(out_dtype).unsqueeze(1), zero)


class KLController:
    """The KL coefficient: fixed, or adaptive (Ziegler et al. 2019, sec. 2.2) when a target is set.

    Adaptive: e = clip(KL / target - 1, -0.2, 0.2); coef *= 1 + e * n / horizon, with KL the mean summed
    KL per sequence of the last batch and n its number of samples.
    """

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000):
        self.value, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, n: int) -> None:
        if self.target is None:
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]
