"""Typed, validated configuration: one section per concern, YAML files plus `key=value` overrides.

    cfg = load_config("examples/dapo.yaml", ["algorithm.clip_high=0.3", "train.steps=50"])

Choosing an algorithm by name (`algorithm.name=dapo`, or the shorthand `algorithm=dapo`) fills the
algorithm section from its preset in `ALGORITHM_PRESETS`; anything the user sets explicitly wins.
Every field has a docstring: `lmrl train --help-config` prints them. Invalid values fail here, before
any model loads, with one line that names the field and what is allowed.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from lmrl.errors import ConfigError
from lmrl.foreign_names import explain_foreign_name
from lmrl.sandbox import SandboxLimits

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DEFAULT_TIS_CAP = 2.0  # truncated importance sampling cap when the sampler is another dtype


# Ranges live in the field types, so that every value is checked on load, before torch is imported, and
# errors name the full key with the value given. No negative or zero value keeps an accidental meaning.
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
MAX_SEED = 2**32 - 1


def _takes_number(annotation: Any) -> bool:
    """The field holds an int or float (possibly optional, annotated or a tuple of them), not a bool."""
    args = get_args(annotation)
    if annotation in (int, float):
        return True
    if annotation is bool or bool in args:
        return False
    return any(_takes_number(a) for a in args)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _plain_values(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                # pydantic would read `train.steps=true` as 1: a bool where a number belongs is a mistake
                if field is not None and _takes_number(field.annotation) and _holds_bool(value):
                    raise ValueError(f"{name}: expected a number, got {value!r}")
            # a path may be a pathlib.Path wherever the config takes one; it is kept as a string
            data = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in data.items()}
        return data

    # fields `options_for` leaves out although a function takes them (a value the caller passes instead)
    _not_options: ClassVar[frozenset[str]] = frozenset()

    def options_for(self, fn: Callable[..., Any]) -> dict[str, Any]:
        """This section's fields that `fn` takes as keyword arguments of the same names, so that a call reads
        `make_experience(..., **cfg.algorithm.options_for(make_experience))` and no name is listed twice."""
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        params = {name for name, p in inspect.signature(fn).parameters.items() if p.kind in keyword}
        return {name: getattr(self, name) for name in type(self).model_fields
                if name in params and name not in self._not_options}

    def __setattr__(self, name: str, value: Any) -> None:
        # `cfg.train.steps = -3` is checked on assignment (validate_assignment): one line naming the full key
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise ConfigError(_one_line(e, prefix=_section_key(type(self)))) from None


def _holds_bool(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value))


class LoraConfig(_Section):
    r: PositiveInt = 16
    """LoRA rank."""
    alpha: PositiveFloat = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the LoRA input, in [0, 1)."""
    target_modules: Annotated[list[NonEmptyStr], Field(min_length=1)] | NonEmptyStr = "all-linear"
    """Module names to adapt, or "all-linear"."""


class ModelConfig(_Section):
    name_or_path: NonEmptyStr = "tiny-addition"
    """Policy model: a local directory, a hub id, or "tiny-addition" (the model shipped with lmrl)."""
    dtype: Dtype = "float32"
    """Weights' dtype. float32 is the safe default on CPU; bfloat16 halves memory on GPUs."""
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")] = "auto"
    """"auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:1", ..."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository (only for models you trust)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more compute."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (needs `pip install lmrl[peft]`) instead of all weights."""
    critic_name_or_path: NonEmptyStr | None = None
    """PPO critic: a separate model; None copies the policy's backbone and adds a value head."""
    shared_critic: bool = False
    """PPO: the value head sits on the policy's own backbone instead of a separate critic (TRL's
    AutoModelForCausalLMWithValueHead, trlx): one forward and backward serve both losses, and the value
    loss trains the backbone too (vf_coef weighs it). No second copy of the weights."""
    chat_template: bool | None = None
    """Apply the tokenizer's chat template to chat-style prompts (None: when prompts are message lists)."""
    attn_implementation: str | None = None
    """transformers' attention kernel for training forwards: "eager", "sdpa", "flash_attention_2", ...
    (None: transformers' choice). On CPU with bfloat16 autocast, "eager" trains faster than "sdpa"."""


class DataConfig(_Section):
    task: str | None = "addition"
    """A built-in task (prompts, reward and held-out split), e.g. "addition". Ignored when `path` is set."""
    path: NonEmptyStr | None = None
    """Prompt dataset: a .jsonl / .json / .parquet file, a directory datasets' save_to_disk wrote, or a hub
    dataset name (needs network)."""
    split: str = "train"
    """Split of `path` to train on."""
    streaming: bool = False
    """Read `path` as a stream: rows are read in order as steps ask for them and never held whole (for a
    dataset larger than memory). The first step's rows are checked before the model loads, the others as
    they are read (docs/python.md, streamed datasets)."""
    eval_path: NonEmptyStr | None = None
    """Held-out prompts for evaluation (defaults to the task's held-out split)."""
    eval_split: str = "test"
    """Split of `eval_path` (or of `path` when `eval_path` is unset) to evaluate on."""
    prompt_column: NonEmptyStr = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""
    num_eval_prompts: NonNegativeInt = 200
    """How many held-out prompts each evaluation uses (0 = no evaluation)."""
    on_bad_row: Literal["fail", "skip"] = "fail"
    """A row that cannot be trained on (no prompt, a blank or over-long prompt, a column a reward needs
    missing): "fail" stops before the model loads, naming the file and line; "skip" leaves such rows
    out with one warning and their count. Every row is checked up front either way."""

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.task is None and self.path is None:
            raise ValueError("set data.task (a built-in task) or data.path (a prompt dataset)")
        return self


class RolloutConfig(_Section):
    prompts_per_step: PositiveInt = 16
    """Prompts sampled per training step."""
    group_size: PositiveInt = 8
    """Completions per prompt (G). Group-relative estimators need G >= 2."""
    max_prompt_length: PositiveInt = 512
    """Longest prompt in tokens; longer prompts are an error (or skipped, data.on_bad_row), never cut."""
    max_new_tokens: PositiveInt = 256
    """Longest completion in tokens."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (> 0); log-probs in training use the same temperature."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling threshold in (0, 1] (1.0 = off)."""
    top_k: NonNegativeInt = 0
    """Top-k sampling (0 = off)."""
    stop: list[NonEmptyStr] = []
    """Stop strings that end a completion besides EOS."""
    batch_size: PositiveInt | None = None
    """Most sequences generated in one batch (None = all at once)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Weights the sampler uses. None: the policy itself. Another dtype: a copy of the policy in that
    dtype, refreshed from the policy before every generation; truncated importance sampling
    (algorithm.tis_cap, 2.0 unless set) corrects for the difference between its probabilities and
    the trainer's."""
    cuda_graph: bool = True
    """On a GPU, decode with fixed shapes (a KV cache of the whole rollout) and replay each step as one
    CUDA graph, where the model allows it (full attention, sdpa or eager kernel); the run says which
    decode path it took and why. Ignored on a CPU."""


class RewardConfig(_Section):
    functions: list[str | dict[str, Any]] = []
    """Reward functions; empty = the task's reward. Each entry is a built-in name (math, exact_match,
    format, regex, length, remote, reward_model), "file.py:function", "module:function", or a mapping
    {fn: NAME, weight: 0.5, OPTION: VALUE} (e.g. {fn: remote, url: "http://host:8000/score"}); `call: queries`
    calls a user function as OpenRLHF and LightRFT do, reward_func(queries, prompts, labels)."""
    weights: list[float] | None = None
    """One weight per function (default: each entry's own weight, else 1.0)."""
    recipes: dict[NonEmptyStr, list[str | dict[str, Any]]] = {}
    """Reward recipes (LightRFT): label -> reward functions, written as in `functions`, for the rows whose
    `recipe_column` holds that label (e.g. {math: [math], code: [{fn: code, weight: 0.5}]}); a recipe named
    `default` scores rows whose label has none. Each function runs once per batch, on its recipes' rows.
    Use instead of `functions`."""
    recipe_column: NonEmptyStr = "data_source"
    """The dataset column whose value picks each row's recipe (verl's data_source; LightRFT: label)."""
    timeout: PositiveFloat = 60.0
    """Seconds one reward call may take before it counts as failed (> 0)."""
    on_error: Literal["fail", "zero"] = "fail"
    """What a failing reward function does: stop training, or score 0 and count it in metrics."""
    missing_eos_penalty: float | None = None
    """Subtract this from the score of completions that never produced EOS (TRL)."""
    overlong_buffer: PositiveInt | None = None
    """DAPO soft overlong penalty: the last `overlong_buffer` tokens before max_new_tokens cost up to 1."""
    drop_truncated: bool = False
    """Leave completions cut at max_new_tokens out of the loss."""
    clip: PositiveFloat | tuple[float, float] | None = None
    """Clip scores to [-clip, clip], or to [low, high] given a pair (REINFORCE++; OpenRLHF's reward_clip_range;
    None = no clipping)."""
    normalize: bool = False
    """Normalise scores to mean 0, std 1 over the batch (REINFORCE++)."""

    @field_validator("clip", mode="before")
    @classmethod
    def _clip_shape(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and len(value) != 2:
            raise ValueError(f"clip: expected a number c (for [-c, c]) or a pair [low, high], got {list(value)}")
        return value

    @field_validator("recipes", mode="before")
    @classmethod
    def _labels(cls, value: Any) -> Any:
        for label in value if isinstance(value, dict) else ():
            if not isinstance(label, str):
                raise ValueError(f"recipes: a label must be a string (quote it: '{label}'), got {label!r}")
        return value

    @field_validator("clip")
    @classmethod
    def _clip_range(cls, value: float | tuple[float, float] | None) -> float | tuple[float, float] | None:
        if isinstance(value, tuple) and not value[0] < value[1]:
            raise ValueError(f"clip: [low, high] needs low < high (got {list(value)})")
        return value

    @model_validator(mode="after")
    def _recipes(self) -> RewardConfig:
        if self.recipes and self.functions:
            raise ValueError("recipes: set reward.functions (every row) or reward.recipes (a recipe per "
                             f"{self.recipe_column}), not both")
        if self.recipes and self.weights is not None:
            raise ValueError("weights: go with reward.functions; give each reward.recipes entry its own weight, "
                             "e.g. {fn: math, weight: 0.5}")
        for label, entries in self.recipes.items():
            if not entries:
                raise ValueError(f"recipes: recipe {label!r} has no reward functions")
        return self

    def shaping_options(self) -> dict[str, Any]:
        """The fields `lmrl.experience.shape_scores` takes, as its keyword arguments of the same names."""
        return {name: getattr(self, name) for name in ("missing_eos_penalty", "overlong_buffer", "clip", "normalize",
                                                       "drop_truncated")}


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


class AlgorithmConfig(_Section):
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



# Defaults of each algorithm, as its paper (or the reference implementation) sets them. Fields not listed
# keep AlgorithmConfig's defaults. Reading guide:
#   grpo     Shao et al. 2024: group-normalised advantages, per-sequence token mean, KL (k3) in the loss.
#            lmrl defaults the KL coefficient to 0 as DAPO and Dr. GRPO recommend (set kl_coef=0.04 for the paper).
#   dr_grpo  Liu et al. 2025: no std division, constant length normaliser.
#   dapo     Yu et al. 2025: clip-higher, dynamic sampling, token-level loss, soft overlong penalty.
#   rloo     Ahmadian et al. 2024: leave-one-out baseline, KL in the reward.
#   reinforce_pp  Hu 2025: REINFORCE++ with token-level k1 KL in the reward and batch-whitened returns;
#            the _baseline variant subtracts the group mean first.
#   ppo      Schulman et al. 2017 / Ouyang et al. 2022: GAE with a critic, KL in the reward, whitened advantages.
#   gspo     Zheng et al. 2025: sequence-level ratio with tiny clip ranges.
#   cispo    MiniMax 2025: clipped, stop-gradient importance weights on a REINFORCE objective.
#   sapo     Gao et al. 2025: a soft sigmoid gate on the ratio instead of the clip.
#   gmpo     Zhao et al. 2025: the geometric mean of the token ratios, clipped in log space to (e^-0.4, e^0.4).
#   clip_cov, kl_cov  Cui et al. 2025: drop the gradient of / put a KL on the highest-covariance tokens.
#   gpg      Chu et al. 2025: plain policy gradient (no ratio, no clip), advantages scaled by B / informative.
#   cpgd     Liu et al. 2025: clipped log-ratio plus a policy-drift penalty.
#   remax    Li et al. 2023: REINFORCE with the greedy completion's reward as the baseline.
ALGORITHM_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(advantage="grpo", aggregation="seq-mean-token-mean"),
    "dr_grpo": dict(advantage="dr_grpo", aggregation="seq-mean-token-sum-norm"),
    "dapo": dict(
        advantage="grpo", clip_low=0.2, clip_high=0.28, aggregation="token-mean", dynamic_sampling=True
    ),
    "rloo": dict(advantage="rloo", aggregation="token-mean", kl_coef=0.05, kl_in="reward", kl_estimator="k1",
                 kl_level="sequence"),
    "reinforce": dict(advantage="reinforce", clip_low=None, clip_high=None, aggregation="token-mean"),
    "reinforce_pp": dict(advantage="reinforce", aggregation="token-mean", kl_coef=0.01, kl_in="reward",
                         kl_estimator="k1", whiten_advantages=True),
    "reinforce_pp_baseline": dict(advantage="reinforce_baseline", aggregation="token-mean", kl_coef=0.01,
                                  kl_in="reward", kl_estimator="k1", whiten_advantages=True),
    "ppo": dict(advantage="gae", aggregation="token-mean", kl_coef=0.05, kl_in="reward", kl_estimator="k1",
                whiten_advantages=True, gamma=1.0, lam=0.95),
    "gspo": dict(advantage="grpo", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4,
                 aggregation="seq-mean-token-mean"),
    "cispo": dict(advantage="grpo", loss="cispo", clip_low=None, clip_high=5.0, aggregation="token-mean"),
    "sapo": dict(advantage="grpo", loss="sapo", aggregation="token-mean"),
    "gmpo": dict(advantage="grpo", loss="gmpo", clip_low=0.4, clip_high=0.4, aggregation="seq-mean-token-mean"),
    "clip_cov": dict(advantage="grpo", loss="clip_cov", aggregation="token-mean"),
    "kl_cov": dict(advantage="grpo", loss="kl_cov", aggregation="token-mean"),
    "gpg": dict(advantage="gpg", clip_low=None, clip_high=None, aggregation="token-mean"),
    "cpgd": dict(advantage="grpo", loss="cpgd", aggregation="token-mean"),
    "remax": dict(advantage="remax", clip_low=None, clip_high=None, aggregation="token-mean"),
}
# Reward-side defaults of an algorithm, as fractions of rollout.max_new_tokens. DAPO's soft overlong
# penalty starts in the last fifth of the length budget (4k of 20k tokens in the paper); a budget too short
# for a fifth of it to be a whole token (under 5 tokens: the shipped task's 4, where a correct answer fills
# the budget) gets no buffer, rather than a penalty on every answer that uses the budget.
REWARD_PRESETS: dict[str, dict[str, float]] = {"dapo": dict(overlong_buffer=0.2)}

# Defaults for the model that ships with lmrl (a 0.5M-parameter character-level Llama): the general
# defaults suit billion-parameter models (lr 1e-6); a tiny model learns at 1e-4 and runs fastest on one
# thread. The critic (PPO) learns at 1e-4 too: at the general 1e-5 its value loss took ~100 steps to settle
# instead of ~20 (docs/algorithms.md, "Learning on the shipped task"). It is a value head on the policy's own
# backbone (model.shared_critic): PPO learned as much per step as with a separate copy (300 steps: +27.8 and
# +26.2 points against +27.0 and +27.2) in 0.15 s per step instead of 0.22, so 75 s take it past +25 points
# (benchmarks/preset_gains.py). Measured in scripts/make_tiny_model.py's notes and the README's demo run. User
# values win; model.critic_name_or_path, when given, drops the shared head.
MODEL_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny-addition": {
        "rollout": dict(prompts_per_step=32, group_size=8, max_new_tokens=4),
        "optim": dict(lr=1e-4, critic_lr=1e-4),
        "data": dict(num_eval_prompts=500),
        "train": dict(steps=2000, max_minutes=4.5, eval_every=50, threads=1, output_dir="runs/tiny-addition"),
        "log": dict(every=25, samples_every=250),
        "model": dict(shared_critic=True),
    },
    "tiny-calculator": {  # the calculator task, multi-turn: a tool call, its result, the answer
        "data": dict(task="calculator", num_eval_prompts=500),
        "rollout": dict(prompts_per_step=32, group_size=8, max_new_tokens=24, stop=["</calc>"]),
        "env": dict(max_turns=2),
        "optim": dict(lr=1e-4),
        "train": dict(steps=2000, max_minutes=5.0, eval_every=50, threads=1, output_dir="runs/tiny-calculator"),
        "log": dict(every=25, samples_every=250),
    },
}


class OptimConfig(_Section):
    lr: PositiveFloat = 1e-6
    """Policy learning rate (AdamW)."""
    critic_lr: PositiveFloat = 1e-5
    """Critic learning rate (PPO)."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    warmup_steps: NonNegativeInt = 0
    """Linear warm-up, in optimizer steps (0 = none)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (> 0); null = no clipping (0 is refused: it would clip every
    gradient to zero, although HF Trainer reads it as "off")."""
    micro_batch_size: PositiveInt = 64
    """Sequences per forward/backward; gradients accumulate over a minibatch (memory knob, same result)."""

    @field_validator("max_grad_norm")
    @classmethod
    def _clip_norm(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError(f"max_grad_norm: must be > 0, or null for no clipping (got {value!r}; "
                             f"{value!r} would clip every gradient to zero)")
        return value


class TrainConfig(_Section):
    steps: PositiveInt = 100
    """Training steps (one step = one batch of experience)."""
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    """Seed of every random choice: data order, sampling, initialisation (0 to 2**32 - 1)."""
    output_dir: NonEmptyStr = "runs/lmrl"
    """Where metrics, checkpoints and the final model go."""
    eval_every: NonNegativeInt = 10
    """Evaluate on held-out prompts every this many steps (0 = only at start and end)."""
    save_every: NonNegativeInt = 0
    """Save a resumable checkpoint every this many steps, and at the last step (0 = none: only `final/`,
    and a checkpoint when a signal or a failing reward stops the run)."""
    keep_last: PositiveInt | None = None
    """Keep only the newest this many checkpoints (None = keep all)."""
    resume: str | None = None
    """Continue a run: "auto" from the newest complete checkpoint in output_dir (starts afresh when there
    is none), or a checkpoint directory's path. Only steps, cadences, max_minutes, threads, output_dir,
    reward.timeout and log.* may differ from the checkpoint's config."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds an earlier run, deleting that run's files."""
    max_minutes: PositiveFloat | None = None
    """Stop (after an evaluation and a save) once this much wall time has passed (None = no limit)."""
    autocast_bf16: bool = False
    """Run forwards under bfloat16 autocast (weights stay in their dtype)."""
    threads: PositiveInt | None = None
    """torch CPU threads (None = torch's default)."""
    logprob_chunk_size: PositiveInt | None = 128
    """Rows of the [B*T, V] logits turned into float32 log-probs at once (None = all): bounds memory at large V."""
    share_prompt: bool = True
    """Update and reference forwards run each distinct prompt once for all its completions (Llama / Qwen2)."""
    parallel: Literal["auto", "ddp", "fsdp"] = "auto"
    """Under torchrun: "ddp" keeps the whole policy on every rank and sums gradients; "fsdp" shards the
    policy, reference and critic per decoder layer (FSDP2), gathering a layer's weights when it runs and
    the whole policy for generation; "auto" takes fsdp for a policy of 1e9 parameters or more
    (`lmrl.distributed.FSDP_AUTO_PARAMS`), whose AdamW state no longer fits every GPU; one process ignores it."""

    @field_validator("resume", mode="before")
    @classmethod
    def _resume(cls, value: Any) -> Any:
        if isinstance(value, bool):  # train.resume=true reads as "auto"
            return "auto" if value else None
        if isinstance(value, str) and not value.strip():
            raise ValueError("resume: expected \"auto\", true or a checkpoint directory, got an empty string")
        return value


class GuardConfig(_Section):
    max_skipped_steps: PositiveInt = 3
    """Steps in a row whose loss or gradient was not finite (each is skipped: no weight changes) before
    the run stops, keeping its last good checkpoint."""
    max_unscored_steps: PositiveInt = 3
    """Steps in a row where no reward function scored any completion (all None) before the run stops."""
    max_empty_steps: PositiveInt = 3
    """Steps in a row whose update had nothing to learn from because every completion was left out of the
    loss (reward.drop_truncated with every completion truncated) before the run stops."""
    collapse_entropy: NonNegativeFloat = 0.02
    """Collapse warning: the policy's per-token entropy (nats) is below this ..."""
    collapse_drop: Annotated[float, Field(gt=0, le=1)] = 0.5
    """... and held-out accuracy (or, without evaluation, the mean reward of the last 10 steps) fell by
    this fraction of its best. Warned once and recorded as `guard/collapse`; the run goes on."""


class LogConfig(_Section):
    console: bool = True
    """Live console: progress with ETA and a metrics line per step."""
    jsonl: bool = True
    """Write metrics.jsonl in the output directory."""
    tensorboard: bool = False
    """Write TensorBoard events (needs `pip install lmrl[tensorboard]`)."""
    wandb: bool = False
    """Log to Weights & Biases (needs `pip install lmrl[wandb]`)."""
    every: PositiveInt = 1
    """Print a metrics line every this many steps (evaluation steps always print)."""
    samples_every: NonNegativeInt = 10
    """Show a table of sample completions every this many steps (0 = never)."""
    num_samples: PositiveInt = 4
    """Rows in each sample table."""


class EnvConfig(_Section):
    """Multi-turn episodes (`lmrl.envs`): the model acts, the environment answers, for several turns."""

    name: NonEmptyStr | None = None
    """None: one completion per prompt (no environment). "tools": the built-in tool environment (the model
    calls `env.tools`; a turn without a tool call ends the episode). "file.py:Class" or "module:Class": your
    environment, called with each dataset row to start an episode."""
    max_turns: PositiveInt = 4
    """Most model turns per episode."""
    max_tokens: PositiveInt | None = None
    """Most response tokens per episode, observations included; None: max_turns x rollout.max_new_tokens."""
    tools: list[NonEmptyStr] = []
    """Tools of the "tools" environment: "python" (the built-in, sandboxed), "file.py:function", "module:function"."""
    tool_call_pattern: NonEmptyStr | None = None
    """Regex finding a tool call: a group `json` holding {"name", "arguments"}, or a group `name` with a group
    `arguments` (a JSON object) and / or one group per argument. None: Hermes / Qwen `<tool_call>{...}</tool_call>`."""
    response_format: NonEmptyStr = "<tool_response>\n{output}\n</tool_response>\n"
    """How a tool's output is shown to the model: a string with {output}, or "chat" (a `tool` message rendered
    with the chat template)."""

    @field_validator("tool_call_pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        import re

        if value is None:
            return value
        try:
            groups = re.compile(value).groupindex
        except re.error as e:
            raise ValueError(f"not a valid regex ({e})") from None
        if "json" not in groups and "name" not in groups:
            raise ValueError("needs a group named json, or a group named name (and arguments, or one group per argument)")
        return value

    @field_validator("response_format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value != "chat" and "{output}" not in value:
            raise ValueError(f'expected "chat" or a string with {{output}}, got {value!r}')
        return value

    @model_validator(mode="after")
    def _tools_need_the_tools_env(self) -> EnvConfig:
        if self.name == "tools" and not self.tools:
            raise ValueError('tools: the "tools" environment needs at least one tool, e.g. env.tools=[python]')
        if self.tools and self.name != "tools":
            raise ValueError("tools: tools are for env.name=tools")
        return self


class SandboxConfig(_Section):
    """Limits for model-written code (the `python` tool, the `code` reward); see `lmrl.sandbox`. The defaults
    are `lmrl.sandbox.SandboxLimits`'s."""

    timeout: PositiveFloat = SandboxLimits.timeout
    """Wall-clock seconds per program before it and everything it started are killed."""
    cpu_seconds: PositiveInt = SandboxLimits.cpu_seconds
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: PositiveInt = SandboxLimits.memory_mb
    """Address space per process in MiB (RLIMIT_AS); Python itself needs about 30."""
    processes: PositiveInt = SandboxLimits.processes
    """Processes a program may have at once, itself included (RLIMIT_NPROC; as root programs run as nobody)."""
    file_mb: PositiveInt = SandboxLimits.file_mb
    """Largest file a program may write, in MiB (RLIMIT_FSIZE)."""
    disk_mb: PositiveInt = SandboxLimits.disk_mb
    """Size of each program's private tmpfs work directory, in MiB."""
    open_files: PositiveInt = SandboxLimits.open_files
    """File descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: PositiveInt = SandboxLimits.output_bytes
    """Bytes kept of stdout and of stderr each; a program that writes more is stopped."""
    max_parallel: PositiveInt = SandboxLimits.max_parallel
    """Programs run at once."""
    allow_network_fallback: bool = SandboxLimits.allow_network_fallback
    """Where namespaces are unavailable (no root, no unprivileged user namespaces), run model code anyway,
    without network, mount and pid isolation. Off: the run refuses to start with one line."""
    python: NonEmptyStr | None = SandboxLimits.python
    """Interpreter programs run with (standard library only). None: this Python, or /usr/bin/python3 when
    the sandbox user cannot read this one's files."""

    def limits(self) -> SandboxLimits:
        """These settings as `lmrl.sandbox.SandboxLimits`."""
        return SandboxLimits(**self.model_dump())


# optional packages a field needs: checked with the config (find_spec, no import), before any model loads
_EXTRAS = (("log.tensorboard", "tensorboard", "tensorboard"), ("log.wandb", "wandb", "wandb"), ("model.lora", "peft", "peft"))


class Config(_Section):
    """The whole configuration. Built from YAML, `key=value` overrides or Python alike, in three steps: presets
    fill what the user did not set (`with_presets`: the model's, then the algorithm's), pydantic validates, and
    `derive` fills the derived values. So `Config(algorithm={"name": "rloo"})` is the config
    `lmrl train algorithm=rloo` runs. An invalid value raises `ConfigError` with one line."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    _given: dict[str, Any] = PrivateAttr(default_factory=dict)  # the values the user set, before presets

    def __init__(self, **values: Any) -> None:
        # pydantic calls this for Config.model_validate too: every way of building a Config takes these steps
        given = _user_values(values)
        try:
            super().__init__(**with_presets(given))
        except ValidationError as e:
            raise ConfigError(_one_line(e)) from None
        self._given = given
        derive(self)

    def user_set(self, key: str) -> bool:
        """The user gave a value for `key` ("section.field"), rather than a preset or the default."""
        section, _, name = key.partition(".")
        return name in (self._given.get(section) or {})

    def checked(self) -> Config:
        """This config validated again as a whole: fields assigned after it was built (`cfg.rollout.group_size
        = 1`) are each checked on assignment, and the checks between fields run here."""
        out = Config(**self.model_dump())
        out._given = self._given
        return out

    def for_model(self, name: str) -> Config:
        """This config for a model that is not `model.name_or_path` (a model object given to the Trainer):
        what the old model's preset set and the user did not is dropped, and `model.name_or_path` records
        `name`. Reward presets that follow the length budget follow it again."""
        values = self.model_dump()
        for section, fields in MODEL_PRESETS.get(self.model.name_or_path, {}).items():
            for key, preset in fields.items():
                if key not in self._given.get(section, {}) and values[section][key] == preset:
                    del values[section][key]
        for key in REWARD_PRESETS.get(self.algorithm.name, {}):
            if key not in self._given.get("reward", {}):
                del values["reward"][key]
        values["model"]["name_or_path"] = name
        out = Config(**values)
        out._given = _merge(self._given, {"model": {"name_or_path": name}})
        return out

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        a, r = self.algorithm, self.rollout
        if a.advantage in GROUP_ADVANTAGES and r.group_size < 2:
            raise ValueError(f"rollout.group_size: must be >= 2 for the {a.advantage} advantage (got {r.group_size})")
        if a.advantage == "pass_at_k" and a.pass_k > r.group_size:
            raise ValueError(f"algorithm.pass_k: must be <= rollout.group_size={r.group_size} (got {a.pass_k})")
        batch = r.prompts_per_step * r.group_size
        if batch % a.num_minibatches:
            raise ValueError(
                f"algorithm.num_minibatches: {a.num_minibatches} must divide the batch of "
                f"{batch} sequences (rollout.prompts_per_step x rollout.group_size)"
            )
        if self.reward.weights is not None and self.reward.functions and len(self.reward.weights) != len(
            self.reward.functions
        ):
            raise ValueError(f"reward.weights: {len(self.reward.weights)} weights for {len(self.reward.functions)} "
                             "reward.functions; give one weight per function")
        if self.reward.overlong_buffer is not None and not 0 < self.reward.overlong_buffer <= r.max_new_tokens:
            raise ValueError(f"reward.overlong_buffer: must be <= rollout.max_new_tokens={r.max_new_tokens} "
                             f"(got {self.reward.overlong_buffer})")
        if self.model.shared_critic and self.model.critic_name_or_path:
            raise ValueError("model.shared_critic: the value head sits on the policy's backbone, so there is no separate "
                             f"critic to load; unset model.critic_name_or_path (got {self.model.critic_name_or_path!r})")
        if self.train.parallel == "fsdp" and self.model.lora is not None:
            raise ValueError("train.parallel: fsdp does not shard LoRA runs yet; use train.parallel=ddp (the "
                             "adapters are small; every rank keeps the frozen base)")
        if self.train.parallel == "fsdp" and self.samples_with_copy:
            raise ValueError("train.parallel: fsdp does not keep a sampler copy in rollout.dtype; unset rollout.dtype "
                             "or use train.parallel=ddp")
        for key, module, extra in _EXTRAS:
            section, _, name = key.partition(".")
            if getattr(getattr(self, section), name) not in (None, False) and importlib.util.find_spec(module) is None:
                raise ValueError(f"{key}: needs the {module} package, which is not installed: pip install 'lmrl[{extra}]'")
        return self

    @property
    def samples_with_copy(self) -> bool:
        """The sampler is a copy of the policy in another dtype (`rollout.dtype`)."""
        return self.rollout.dtype is not None and self.rollout.dtype != self.model.dtype

    @property
    def needs_reference(self) -> bool:
        """The reference model is loaded only when a KL term can use it."""
        a = self.algorithm
        return a.kl_coef > 0 or a.kl_target is not None or a.reward_minus_kl_coef > 0


def derive(cfg: Config) -> None:
    """Fill the values a Config derives from its other fields, where the user left them unset (None). Run once
    as each Config is built, after validation (`Config(...)`, `checked()`, `for_model()`), never inside a
    validator:

        algorithm.tis_cap  DEFAULT_TIS_CAP when the sampler is a copy of the policy in another dtype
                           (rollout.dtype): correct for it rather than pretend the run is on-policy
    """
    if cfg.samples_with_copy and cfg.algorithm.tis_cap is None:
        cfg.algorithm.tis_cap = DEFAULT_TIS_CAP


# ---------------------------------------------------------------------------------------------- loading

_SHORTHANDS = {"algorithm": "name", "model": "name_or_path", "data": "task"}


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["algorithm.clip_high=0.28", "train.steps=5"]` -> nested dict; values are parsed as YAML."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            hint = f"; write {item}=VALUE (no spaces around =)" if _looks_like_key(item) else ""
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=50{hint}")
        try:
            value = _parse_value(raw)
        except ConfigError as e:
            raise ConfigError(f"override {key.strip()}: {e}") from None
        parts = key.strip().split(".")
        if len(parts) == 1 and parts[0] in _SHORTHANDS:
            parts.append(_SHORTHANDS[parts[0]])
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = value
    return out


def _parse_value(raw: str) -> Any:
    """YAML, except that numbers YAML 1.1 leaves as strings ("1e-3") become floats."""
    if not raw.strip():
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"value {raw!r} is not valid YAML ({problem}); quote the whole key=value for the shell, "
                          "e.g. 'reward.functions=[{fn: math}]'") from None
    if isinstance(value, str):
        try:
            return float(value) if value.strip().lower() not in ("nan", "inf", "-inf", "infinity") else value
        except ValueError:
            return value
    return value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _normalise_shorthands(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    for section, field in _SHORTHANDS.items():
        if isinstance(raw.get(section), str):
            raw[section] = {field: raw[section]}
    return raw


def _user_values(data: dict[str, Any]) -> dict[str, Any]:
    """A config's input as plain nested dicts: shorthands expanded (`algorithm="rloo"`), and a section given as
    an object (`algorithm=AlgorithmConfig(name="rloo")`) as the fields set in it."""
    out = {}
    for key, value in _normalise_shorthands(data).items():
        out[key] = value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
    return out


def with_presets(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the presets under it: the model's (`MODEL_PRESETS`), then the algorithm's (`ALGORITHM_PRESETS`,
    `REWARD_PRESETS`); anything set in `raw` wins."""
    model = (raw.get("model") or {}).get("name_or_path", ModelConfig.model_fields["name_or_path"].default)
    preset = MODEL_PRESETS.get(model, {}) if isinstance(model, str) else {}
    if (raw.get("model") or {}).get("critic_name_or_path"):  # a critic to load: no shared value head from the preset
        preset = {**preset, "model": {k: v for k, v in preset.get("model", {}).items() if k != "shared_critic"}}
    raw = _merge(preset, raw) if isinstance(model, str) else dict(raw)
    algo = raw.get("algorithm") or {}
    if not isinstance(algo, dict):
        return raw  # (pydantic names the section and what is wrong with it)
    name = algo.get("name", "grpo")
    if name not in ALGORITHM_PRESETS:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; choose one of {', '.join(ALGORITHM_PRESETS)}")
    raw["algorithm"] = {**ALGORITHM_PRESETS[name], **algo, "name": name}
    max_new = (raw.get("rollout") or {}).get("max_new_tokens", RolloutConfig.model_fields["max_new_tokens"].default)
    reward_preset = {k: (int(f * max_new) or None) if isinstance(max_new, int) else None
                     for k, f in REWARD_PRESETS.get(name, {}).items()}
    if isinstance(raw.get("reward") or {}, dict):
        raw["reward"] = {**reward_preset, **dict(raw.get("reward") or {})}
    return raw


def build_config(raw: dict[str, Any]) -> Config:
    """Validate a nested dict (presets fill what it does not set: `Config`)."""
    return Config(**_normalise_shorthands(raw))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (optional), apply `key=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
    raw = _merge(_normalise_shorthands(raw), parse_overrides(overrides or []))
    return build_config(raw)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's mapping of sections; a key written twice is an error (YAML would keep the last)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory, expected a YAML file")
    if not p.is_file():
        hint = ""
        if "=" not in str(path) and _looks_like_key(str(path)):
            hint = f"; to set a field write {path}=VALUE (no spaces around =)"
        raise ConfigError(f"config file {str(p)!r} does not exist{hint}")
    try:
        raw = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ConfigError as e:
        raise ConfigError(f"config file {str(p)!r} {e}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{line}: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, not a {type(raw).__name__}")
    return raw


def _looks_like_key(text: str) -> bool:
    """`train.steps` or `algorithm`: what a user meant as an override when they forgot the `=`."""
    section, _, field = text.partition(".")
    model = Config.model_fields.get(section)
    if model is None:
        return False
    return not field or field.split(".")[0] in getattr(model.annotation, "model_fields", {})


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping key given twice, naming both lines."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"line {line}: key {key!r} appears twice (first on line {seen[key]}); "
                                  "YAML would silently keep the second")
            seen[key] = line
        return super().construct_mapping(node, deep)


_RANGE_WORDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
                "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def _one_line(e: ValidationError, prefix: str = "") -> str:
    """The first validation error as `full.key: what is wrong (got VALUE)`; `prefix` is the key of the
    section that raised it, when that is not the whole Config (an assignment to one of its fields)."""
    err = e.errors()[0]
    parts = [*filter(None, prefix.split(".")), *(x for x in err["loc"] if not str(x).startswith("function-"))]
    # pydantic names a union's member in the location (`list[...]`, `constrained-int`): not a user's key
    parts = [x for x in parts if isinstance(x, int) or "[" not in str(x) and "-" not in str(x)]
    loc = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in parts).lstrip(".")
    kind, got = err["type"], err.get("input")
    if kind in ("extra_forbidden", "no_such_attribute"):
        if (foreign := explain_foreign_name(loc, got)) is not None:  # learning_rate=..., beta=..., verl's paths
            return foreign
        section_path, _, key = loc.rpartition(".")
        section = _section_at(section_path)
        allowed = list(section.model_fields) if section else []
        hint = difflib.get_close_matches(key, allowed, n=1)
        where = section_path or "config"
        suggestion = f"; did you mean {hint[0]!r}?" if hint else f"; allowed: {', '.join(allowed)}"
        return f"{loc}: {where} has no field {key!r}{suggestion}"
    msg = err["msg"].removeprefix("Value error, ")
    if kind in _RANGE_WORDS:
        word, key = _RANGE_WORDS[kind]
        bound = err["ctx"][key]
        bound = int(bound) if float(bound).is_integer() else bound
        return f"{loc}: must be {word} {bound} (got {got!r})"
    if got is None and kind.endswith("_type"):
        return f"{loc}: must be set (got null or an empty value)"
    if kind == "missing" and parts and isinstance(parts[-1], int):
        return f"{loc.rpartition('[')[0]}: too few values (got {got!r})"
    if kind == "too_long":
        return f"{loc}: too many values (got {got!r})"
    if kind == "finite_number":
        return f"{loc}: must be a finite number (got {got!r})"
    if kind in ("int_from_float", "int_parsing", "int_type"):
        return f"{loc}: must be a whole number (got {got!r})"
    if kind in ("float_parsing", "float_type"):
        return f"{loc}: must be a number (got {got!r})"
    if kind == "string_too_short":
        return f"{loc}: must not be empty"
    if kind == "string_pattern_mismatch" and loc == "model.device":
        return f"{loc}: must be auto, cpu, cuda or cuda:N (got {got!r})"
    section = _section_at(loc)
    first = msg.split(" ", 1)[0].rstrip(":")
    if loc and section is not None and first in section.model_fields:
        return f"{loc}.{msg}"  # a section validator naming its own field
    if kind == "literal_error":
        return f"{loc}: got {got!r}; {msg.lower()}"
    if loc and not kind.startswith("value_error"):
        return f"{loc}: {msg} (got {got!r})"
    if loc and msg.startswith(loc.rpartition(".")[2] + ":"):
        msg = msg.split(":", 1)[1].strip()  # a field validator naming its field: the full key says it
    return f"{loc}: {msg}" if loc else msg


def _section_key(section: type[BaseModel], model: type[BaseModel] | None = None, prefix: str = "") -> str:
    """Where a section class sits in Config: ModelConfig -> "model", LoraConfig -> "model.lora"."""
    model = model or Config
    if section is model:
        return prefix
    for name, field in model.model_fields.items():
        for candidate in (field.annotation, *get_args(field.annotation)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                found = _section_key(section, candidate, f"{prefix}.{name}".lstrip("."))
                if found or candidate is section:
                    return found
    return ""


def _section_at(path: str) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in filter(None, path.split(".")):
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        if ann is None:
            return None
        candidates = [ann, *getattr(ann, "__args__", ())]
        found = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if found is None:
            return None
        model = found
    return model


def config_warnings(cfg: Config) -> list[str]:
    """Values that are valid but quietly waste a run: one line each, printed when a run starts."""
    out = []
    o, a = cfg.optim, cfg.algorithm
    updates = cfg.train.steps * a.num_iterations * a.num_minibatches
    if o.warmup_steps > updates:
        out.append(f"optim.warmup_steps={o.warmup_steps} is longer than the run's {updates} optimizer steps: the "
                   f"learning rate never reaches optim.lr (it ends at {updates / o.warmup_steps:.0%} of it)")
    return out


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_summary(cfg: Config) -> str:
    """The resolved config, one line per section: `algorithm: name=grpo advantage=grpo ...`."""
    lines = []
    for section, values in cfg.model_dump(mode="json").items():
        # a string with a line break (env.response_format) is shown as a literal, so each section stays one line
        lines.append(f"{section}: " + " ".join(f"{k}={v!r}" if isinstance(v, str) and "\n" in v else f"{k}={v}"
                                               for k, v in values.items()))
    return "\n".join(lines)


def describe_fields() -> str:
    """Every field (nested ones too: `model.lora.r`) with its default, its allowed values and its docstring,
    then what each preset changes: for `lmrl train --help-config`."""
    lines: list[str] = []

    def section(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            key = f"{prefix}.{name}"
            nested = next((a for a in (f.annotation, *get_args(f.annotation))
                           if isinstance(a, type) and issubclass(a, BaseModel)), None)
            choices = _choices(f.annotation)
            lines.append(f"  {key} = {f.default!r}" + (f"   (one of: {', '.join(map(str, choices))})" if choices else ""))
            if f.description:
                lines.extend(f"      {line.strip()}" for line in f.description.splitlines())
            if nested is not None:
                section(nested, key)

    for name, f in Config.model_fields.items():
        lines.append(f"{name}:")
        section(f.annotation, name)
    lines.append("presets (algorithm.name=NAME fills these fields unless you set them):")
    for name, preset in ALGORITHM_PRESETS.items():
        changed = {k: v for k, v in preset.items() if AlgorithmConfig.model_fields[k].default != v}
        extra = [f"reward.{k}={f:g} x rollout.max_new_tokens" for k, f in REWARD_PRESETS.get(name, {}).items()]
        lines.append(f"  {name}: " + (", ".join([*(f"{k}={v}" for k, v in changed.items()), *extra]) or "the defaults"))
    for model, sections in MODEL_PRESETS.items():
        fields = [f"{s}.{k}={str(v).lower() if isinstance(v, bool) else v}" for s, values in sections.items()
                  for k, v in values.items()]
        lines.append(f"  model.name_or_path={model}: {', '.join(fields)}")
    return "\n".join(lines)


def _choices(annotation: Any) -> list[Any]:
    """The values a Literal field (possibly optional or annotated) allows; [] for other fields."""
    if getattr(annotation, "__origin__", None) is Literal:
        return list(get_args(annotation))
    return [c for a in get_args(annotation) for c in _choices(a)]
