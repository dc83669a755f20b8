"""Pure tensor math for RL post-training. Imports torch only, never the rest of lmrl.

Conventions: per-token tensors are [B, T] over response tokens; `mask` [B, T] marks real response
tokens; sequence-level tensors are [B]. Groups are contiguous: sample i belongs to group i // G.
"""

from lmrl.algorithms.advantages import (
    GAEResult,
    batch_std_advantages,
    clip_filter_like_weights,
    discounted_returns,
    gae,
    gpg_advantages,
    group_advantages,
    grpo_advantages,
    informative_groups,
    leave_one_out_advantages,
    pass_at_k_advantages,
    reinforce_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from lmrl.algorithms.aggregation import AGGREGATION_MODES, aggregate_loss, loss_normalizer
from lmrl.algorithms.distillation import distill_advantages, distill_reverse_kl
from lmrl.algorithms.importance import masked_is_weights, truncated_is_weights
from lmrl.algorithms.kl import (
    KL_CLAMPS,
    KL_ESTIMATORS,
    KLController,
    kl_penalty,
    kl_shaped_rewards,
    sequence_kl,
)
from lmrl.algorithms.logprobs import DEFAULT_CHUNK_SIZE, hidden_logprobs, token_entropy, token_logprobs
from lmrl.algorithms.losses import (
    PolicyLossMetrics,
    ValueLossMetrics,
    cispo_loss,
    cpgd_loss,
    explained_variance,
    policy_loss,
    value_loss,
)
from lmrl.algorithms.masking import masked_mean, masked_sum, masked_var, masked_whiten
from lmrl.algorithms.offpolicy import BEHAV_MODES, DecoupledLossMetrics, decoupled_policy_loss
from lmrl.algorithms.preference import PreferenceMetrics, bradley_terry_loss, preference_metrics
from lmrl.algorithms.surrogates import clip_cov_loss, gmpo_loss, kl_cov_loss, sapo_loss, token_covariance

__all__ = [
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "GAEResult",
    "batch_std_advantages",
    "clip_filter_like_weights",
    "discounted_returns",
    "gae",
    "gpg_advantages",
    "grpo_advantages",
    "group_advantages",
    "informative_groups",
    "leave_one_out_advantages",
    "pass_at_k_advantages",
    "reinforce_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "distill_advantages",
    "distill_reverse_kl",
    "KL_CLAMPS",
    "KL_ESTIMATORS",
    "KLController",
    "kl_penalty",
    "kl_shaped_rewards",
    "sequence_kl",
    "AGGREGATION_MODES",
    "PolicyLossMetrics",
    "ValueLossMetrics",
    "aggregate_loss",
    "cispo_loss",
    "cpgd_loss",
    "explained_variance",
    "loss_normalizer",
    "masked_is_weights",
    "policy_loss",
    "truncated_is_weights",
    "value_loss",
    "PreferenceMetrics",
    "bradley_terry_loss",
    "preference_metrics",
    "BEHAV_MODES",
    "DecoupledLossMetrics",
    "decoupled_policy_loss",
    "clip_cov_loss",
    "gmpo_loss",
    "kl_cov_loss",
    "sapo_loss",
    "token_covariance",
    "DEFAULT_CHUNK_SIZE",
    "hidden_logprobs",
    "token_entropy",
    "token_logprobs",
]
