"""The `algorithm` section: the advantage estimator, the policy loss and its clipping, KL, importance sampling
and the update's passes. A preset (`algorithm.name`, lmrl.config.presets) fills the fields the user leaves.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from lmrl.config.base import Fraction, NonEmptyStr, NonNegativeFloat, PositiveFloat, PositiveInt, Section

Advantage = Literal["grpo", "dr_grpo", "grpo_batch_std", "rloo", "reinforce", "reinforce_baseline", "gae", "gpg",
                    "remax", "pass_at_k"]
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "grpo_batch_std", "rloo", "reinforce_baseline", "gpg", "pass_at_k")
Aggregation = Literal[
    "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
AlgorithmName = Literal[
    "grpo", "dr_grpo", "dapo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_baseline", "ppo", "gspo", "cispo",
    "sapo", "gmpo", "clip_cov", "kl_cov", "gpg", "cpgd", "remax"
]


class AlgorithmConfig(Section):
    name: AlgorithmName = "grpo"
    """Algorithm preset; its defaults fill every field below that you do not set."""
    advantage: Advantage = "grpo"
    """Advantage estimator. grpo_batch_std: r - group mean over the std of the whole batch (TRL's
    scale_rewards="batch"); dr_grpo is TRL's scale_rewards="none"; gpg: GRPO's scaled up by batch / informative
    samples; remax: r - the reward of the prompt's greedy completion; pass_at_k: the pass@k group advantage
    (pass_k)."""
    pass_k: PositiveInt = 4
    """k of advantage=pass_at_k, at most rollout.group_size."""
    loss: Literal["ppo", "cispo", "cpgd", "sapo", "gmpo", "clip_cov", "kl_cov"] = "ppo"
    """Policy loss: PPO-style clipped surrogate (GRPO, DAPO, GSPO, RLOO, REINFORCE), CISPO, CPGD (clipped
    log-ratio plus a policy-drift penalty, drift_coef), SAPO (soft gate, tau_pos / tau_neg), GMPO (geometric
    mean of the token ratios, clip_low / clip_high bound the log-ratio), Clip-Cov or KL-Cov (covariance-based
    token selection)."""
    tau_pos: PositiveFloat = 1.0
    """SAPO: gate temperature for positive advantages (loss=sapo)."""
    tau_neg: PositiveFloat = 1.05
    """SAPO: gate temperature for non-positive advantages (loss=sapo)."""
    clip_cov_fraction: Fraction = 2e-4
    """Clip-Cov: share of the real tokens whose gradient is dropped (loss=clip_cov)."""
    clip_cov_bounds: tuple[float, float] = (1.0, 5.0)
    """Clip-Cov: the covariance band (low, high) the dropped tokens are drawn from (loss=clip_cov)."""
    kl_cov_fraction: Fraction = 2e-3
    """KL-Cov: share of the real tokens, highest covariance first, held near the old policy (loss=kl_cov)."""
    kl_cov_coef: NonNegativeFloat = 1.0
    """KL-Cov: weight of the |log-ratio| penalty on those tokens (loss=kl_cov)."""
    drift_coef: NonNegativeFloat = 0.1
    """CPGD: weight of the policy-drift penalty, k3 of KL(old policy || policy) (loss=cpgd only)."""
    clip_low: Fraction | None = 0.2
    """Lower clip range in [0, 1]: the ratio is kept above 1 - clip_low (None = no clipping below)."""
    clip_high: NonNegativeFloat | None = 0.2
    """Upper clip range: the ratio is kept below 1 + clip_high (DAPO's clip-higher raises it)."""
    dual_clip: Annotated[float, Field(gt=1)] | None = None
    """Dual-clip constant (> 1) bounding the loss of negative-advantage tokens (None = off)."""
    ratio_level: Literal["token", "sequence", "sequence-sum"] = "token"
    """Importance ratio per token (PPO, GRPO), per sequence length-normalised (GSPO), or per sequence as
    exp of the summed token log-ratios, clipped per sequence (sequence-sum: TRL's RLOOTrainer; pair it with
    aggregation=seq-mean-token-sum for TRL's loss)."""
    aggregation: Aggregation = "seq-mean-token-mean"
    """How per-token losses become one number (token-mean is DAPO's, seq-mean-token-sum-norm Dr. GRPO's)."""
    norm_length: PositiveInt | None = None
    """Length normaliser of seq-mean-token-sum-norm (None = rollout.max_new_tokens)."""
    kl_coef: NonNegativeFloat = 0.0
    """Weight of the KL penalty against the reference model (0 skips the reference model entirely)."""
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
    """KL estimator: k1 = log-ratio (unbiased value), k3 = Schulman's low-variance estimator, k3+ = k3's
    value with k2's gradient (verl's low_var_kl+)."""
    kl_clamp: Literal["none", "verl", "openrlhf"] = "none"
    """Clamp the KL estimate as a peer does: verl (k3: log-ratio to [-20, 20], k3 to [-10, 10]), openrlhf (every
    estimator to [-10, 10]); none (lmrl's default) clamps nothing."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Put the KL term in the loss (GRPO) or subtract it from the reward (PPO, RLOO, REINFORCE++)."""
    kl_level: Literal["token", "sequence"] = "token"
    """With kl_in=reward: penalise each token, or the sequence's summed KL on its score."""
    kl_target: PositiveFloat | None = None
    """Adaptive KL controller (Ziegler et al. 2019): target KL per sequence; None = fixed kl_coef."""
    kl_horizon: PositiveInt = 10000
    """Adaptive KL controller horizon in samples."""
    teacher: NonEmptyStr | None = None
    """On-policy distillation: a teacher model (a directory written by save_pretrained, e.g. a run's final/, or
    a shipped model's name) that scores the student's own samples; each token's advantage gains
    distill_coef x (log p_teacher - log p_student). It must share the policy's tokenizer. Loaded and placed like
    the reference model, frozen. With no reward.functions (and no recipes or environment) no reward trains the
    policy: the signal alone (a built-in task's reward still scores the held-out evaluation). Metric:
    distill/reverse_kl."""
    distill_coef: NonNegativeFloat = 1.0
    """Weight of the teacher's per-token signal in the advantage (algorithm.teacher)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = none)."""
    entropy_top_fraction: Annotated[float, Field(gt=0, le=1)] | None = None
    """Train only on this top fraction of tokens by entropy (the "forking tokens"; e.g. 0.2)."""
    whiten_advantages: bool = False
    """Whiten advantages across the whole batch (REINFORCE++, PPO)."""
    whiten_std: Literal["unbiased", "population"] = "unbiased"
    """The std whitening divides by: unbiased (n - 1; TRL, verl) or population (n; OpenRLHF)."""
    use_advantages: bool = True
    """False: weigh each completion's log-probs by its reward itself instead of an advantage (TapeAgents'
    use_advantages=False; the advantage estimator is skipped)."""
    relu_log_p_weights: bool = False
    """Clamp the weights of the log-probs (advantages, or rewards with use_advantages=false) at 0 from below:
    train only on completions better than their baseline (TapeAgents). Metric: val/relu_zeroed_frac."""
    reward_minus_kl_coef: NonNegativeFloat = 0.0
    """Subtract this times the sequence's summed k3 KL (sampling policy vs reference) from its reward before
    advantages (TapeAgents' reward_minus_kl_coef; loads the reference model). Metric: objective/reward_minus_kl."""
    clip_filter_like_weight: PositiveFloat | None = None
    """LightRFT's clip-filter-like weight: completions of groups whose rewards differ are weighted by
    min(groups / informative groups, this cap), those of all-equal groups by 1 (None = off; LightRFT: 3.0).
    Metric: val/clip_filter_weight_mean."""
    gamma: Fraction = 1.0
    """Discount factor for per-token returns, in [0, 1]."""
    lam: Fraction = 0.95
    """GAE lambda (PPO), in [0, 1]."""
    value_clip: PositiveFloat | None = 0.2
    """PPO value clipping range (None = unclipped)."""
    vf_coef: NonNegativeFloat = 0.5
    """Value loss weight (PPO)."""
    num_iterations: PositiveInt = 1
    """Passes over each batch of experience (PPO epochs)."""
    num_minibatches: PositiveInt = 1
    """Optimizer steps per pass: the batch is split into this many shuffled minibatches."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts to refill the batch."""
    max_sampling_rounds: PositiveInt = 3
    """DAPO: at most this many generation rounds per step when refilling."""
    tis_cap: PositiveFloat | None = None
    """Truncated importance sampling cap, when the sampler's probabilities differ from the trainer's
    (2.0 when rollout.dtype makes the sampler a copy in another dtype); the band's upper end with tis_mode
    icepop or sequence-mask."""
    tis_mode: Literal["truncate", "icepop", "sequence-mask"] = "truncate"
    """How the sampler's mismatch is corrected: truncate each token's weight at tis_cap; icepop: weight ratio, but
    0 for tokens whose ratio leaves [tis_low, tis_cap]; sequence-mask: the sequence's ratio, 0 for sequences
    whose ratio leaves the band. Metric: val/tis_masked_frac."""
    tis_low: Annotated[float, Field(ge=0, lt=1)] = 0.5
    """Lower end of the band of tis_mode icepop and sequence-mask, in [0, 1)."""

    # kl_coef only starts the KL controller (kl_target adapts it): its caller passes the current value
    _not_options: ClassVar[frozenset[str]] = frozenset({"kl_coef"})

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("kl_coef: must be > 0 with kl_target: it is the adaptive controller's starting value")
        if self.clip_cov_bounds[0] >= self.clip_cov_bounds[1]:
            raise ValueError(f"clip_cov_bounds: the low bound must be below the high one, got {list(self.clip_cov_bounds)}")
        if self.tis_mode != "truncate" and self.tis_cap is not None and self.tis_cap <= 1:
            raise ValueError(f"tis_cap: the upper end of tis_mode={self.tis_mode}'s band must be > 1, got {self.tis_cap}")
        if self.advantage == "remax" and self.dynamic_sampling:
            raise ValueError("dynamic_sampling: not with advantage=remax (the greedy baselines follow the prompts)")
        if not self.use_advantages and self.advantage == "gae":
            raise ValueError("use_advantages: false weighs log-probs by the rewards themselves; it cannot be combined "
                             "with advantage=gae (a critic's advantages)")
        return self

    @property
    def needs_critic(self) -> bool:
        return self.advantage == "gae"
