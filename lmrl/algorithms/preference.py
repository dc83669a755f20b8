"""Reward-model training on preference pairs: the Bradley-Terry loss and the metrics people watch.

Each pair is one prompt with a chosen and a rejected completion; the reward model gives each side a
scalar, `r_chosen` and `r_rejected` (both `[B]`). The Bradley-Terry model (Bradley & Terry 1952; the
InstructGPT reward model, Ouyang et al. 2022, eq. 1) says P(chosen preferred) = sigmoid(r_chosen -
r_rejected), so the loss is its negative log-likelihood

    loss_i = -log sigmoid(r_chosen_i - r_rejected_i - margin_i) = softplus(-(r_chosen_i - r_rejected_i - margin_i))

with an optional per-pair `margin` (Llama 2, Touvron et al. 2023, eq. 2: how much better the chosen
answer was rated). TRL's `center_rewards_coefficient` (Eisenstein et al. 2023, "Helping or Herding?")
adds `coef * mean((r_chosen + r_rejected)^2)`, which pulls the rewards toward zero mean: the loss
depends on differences only, so without it the rewards drift freely.

How lmrl departs from TRL's RewardTrainer, on purpose:

1. The math runs in float32 at least (bf16 rewards are upcast), so a bf16 model's loss is that of its
   rewards, not of their rounding.
2. Both terms are sums divided by `normalizer` (default B, which gives TRL's two means): a run that
   splits a batch into micro-batches passes the whole batch's pair count and the accumulated
   gradient equals the whole batch's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

__all__ = ["PreferenceMetrics", "bradley_terry_loss", "preference_metrics"]


@dataclass(frozen=True)
class PreferenceMetrics:
    """What a batch of pair rewards says (Python floats).

    Attributes:
        accuracy: fraction of pairs with r_chosen > r_rejected (a tie counts as wrong, as in TRL).
        margin: mean of r_chosen - r_rejected (the model's margin, not the data's `margin` column).
        chosen: mean r_chosen.
        rejected: mean r_rejected.
        reward_mean: mean of all 2B rewards.
        reward_std: standard deviation of all 2B rewards (unbiased, n - 1).
    """

    accuracy: float
    margin: float
    chosen: float
    rejected: float
    reward_mean: float
    reward_std: float

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}


def _rewards(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if chosen.dim() != 1 or chosen.shape != rejected.shape:
        raise ValueError(f"chosen, rejected: expected two [B] tensors of one shape, got {tuple(chosen.shape)} "
                         f"and {tuple(rejected.shape)}")
    if chosen.numel() == 0:
        raise ValueError("chosen, rejected: no pairs")
    dtype = torch.promote_types(torch.promote_types(chosen.dtype, rejected.dtype), torch.float32)
    return chosen.to(dtype), rejected.to(dtype)


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
    normalizer: float | None = None,
) -> torch.Tensor:
    """The reward model's pairwise loss, a scalar (float32 at least).

        loss = sum_i softplus(-(r_chosen_i - r_rejected_i - margin_i)) / normalizer
             + center_rewards_coefficient * sum_i (r_chosen_i + r_rejected_i)^2 / normalizer

    Args:
        chosen: [B] rewards of the chosen completions.
        rejected: [B] rewards of the rejected completions.
        margin: [B] how much the chosen side should win by (a constant: no gradient); None is 0.
        center_rewards_coefficient: weight of the centering term; None or 0 leaves it out.
        normalizer: what the sums are divided by; None is B (the batch's means). Micro-batches of one
            batch pass the batch's B so that their gradients add up to the batch's.

    Returns:
        The loss, differentiable in `chosen` and `rejected`.
    """
    chosen, rejected = _rewards(chosen, rejected)
    diff = chosen - rejected  # [B]
    if margin is not None:
        if margin.shape != diff.shape:
            raise ValueError(f"margin: expected shape {tuple(diff.shape)}, got {tuple(margin.shape)}")
        diff = diff - margin.detach().to(diff.dtype)
    n = float(diff.numel()) if normalizer is None else float(normalizer)
    if not n > 0:
        raise ValueError(f"normalizer: must be > 0, got {normalizer}")
    # -log sigmoid(x) == softplus(-x), computed without overflow for large |x|
    loss = F.softplus(-diff).sum() / n
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).sum() / n
    return loss


@torch.no_grad()
def preference_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> PreferenceMetrics:
    """Pair accuracy, mean margin, the two sides' means and the rewards' mean and std.

    Args:
        chosen: [B] rewards of the chosen completions.
        rejected: [B] rewards of the rejected completions.
    """
    chosen, rejected = _rewards(chosen.detach(), rejected.detach())
    both = torch.cat([chosen, rejected])  # [2B]
    return PreferenceMetrics(
        accuracy=(chosen > rejected).to(chosen.dtype).mean().item(),
        margin=(chosen - rejected).mean().item(),
        chosen=chosen.mean().item(),
        rejected=rejected.mean().item(),
        reward_mean=both.mean().item(),
        reward_std=both.std().item(),
    )
