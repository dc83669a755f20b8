"""Typed, validated configuration: one section per concern, YAML files plus `key=value` overrides.

    cfg = load_config("examples/dapo.yaml", ["algorithm.clip_high=0.3", "train.steps=50"])

Choosing an algorithm by name (`algorithm.name=dapo`, or the shorthand `algorithm=dapo`) fills the
algorithm section from its preset in `ALGORITHM_PRESETS`; anything the user sets explicitly wins.
Every field has a docstring: `lmrl train --help-config` prints them. Invalid values fail here, before
any model loads, with one line that names the field and what is allowed.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lmrl.errors import ConfigError

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DEFAULT_TIS_CAP = 2.0  # truncated importance sampling cap when the sampler is another dtype


def _positive(section: BaseModel, *names: str) -> None:
    for name in names:
        if getattr(section, name) is not None and getattr(section, name) < 1:
            raise ValueError(f"{name} must be >= 1 (got {getattr(section, name)})")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class LoraConfig(_Section):
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt, or "all-linear"."""


class ModelConfig(_Section):
    name_or_path: str = "tiny-addition"
    """Policy model: a local directory, a hub id, or "tiny-addition" (the model shipped with lmrl)."""
    dtype: Dtype = "float32"
    """Weights' dtype. float32 is the safe default on CPU; bfloat16 halves memory on GPUs."""
    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:1", ..."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository (only for models you trust)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more compute."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (needs `pip install lmrl[peft]`) instead of all weights."""
    critic_name_or_path: str | None = None
    """PPO critic: a separate model; None copies the policy's backbone and adds a value head."""
    chat_template: bool | None = None
    """Apply the tokenizer's chat template to chat-style prompts (None: when prompts are message lists)."""
    attn_implementation: str | None = None
    """transformers' attention kernel for training forwards: "eager", "sdpa", "flash_attention_2", ...
    (None: transformers' choice). On CPU with bfloat16 autocast, "eager" trains faster than "sdpa"."""


class DataConfig(_Section):
    task: str | None = "addition"
    """A built-in task (prompts, reward and held-out split), e.g. "addition". Ignored when `path` is set."""
    path: str | None = None
    """Prompt dataset: a .jsonl / .json / .parquet file, or a hub dataset name (needs network)."""
    split: str = "train"
    """Split of `path` to train on."""
    eval_path: str | None = None
    """Held-out prompts for evaluation (defaults to the task's held-out split)."""
    eval_split: str = "test"
    """Split of `eval_path` (or of `path` when `eval_path` is unset) to evaluate on."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""
    num_eval_prompts: int = 200
    """How many held-out prompts each evaluation uses."""

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.task is None and self.path is None:
            raise ValueError("set data.task (a built-in task) or data.path (a prompt dataset)")
        return self


class RolloutConfig(_Section):
    prompts_per_step: int = 16
    """Prompts sampled per training step."""
    group_size: int = 8
    """Completions per prompt (G). Group-relative estimators need G >= 2."""
    max_prompt_length: int = 512
    """Longest prompt in tokens; longer prompts are an error, not silently cut."""
    max_new_tokens: int = 256
    """Longest completion in tokens."""
    temperature: float = 1.0
    """Sampling temperature; log-probs in training use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    stop: list[str] = []
    """Stop strings that end a completion besides EOS."""
    batch_size: int | None = None
    """Most sequences generated in one batch (None = all at once)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Weights the sampler uses. None: the policy itself. Another dtype: a copy of the policy in that
    dtype, refreshed from the policy before every generation; truncated importance sampling
    (algorithm.tis_cap, 2.0 unless set) corrects for the difference between its probabilities and
    the trainer's."""

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        _positive(self, "prompts_per_step", "group_size", "max_prompt_length", "max_new_tokens")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 for RL sampling (greedy rollouts have no variance)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        return self


class RewardConfig(_Section):
    functions: list[str | dict[str, Any]] = []
    """Reward functions; empty = the task's reward. Each entry is a built-in name (math, exact_match,
    format, regex, length, remote, reward_model), "file.py:function", "module:function", or a mapping
    {fn: NAME, weight: 0.5, OPTION: VALUE} (e.g. {fn: remote, url: "http://host:8000/score"})."""
    weights: list[float] | None = None
    """One weight per function (default: each entry's own weight, else 1.0)."""
    timeout: float = 60.0
    """Seconds one reward call may take before it counts as failed."""
    on_error: Literal["fail", "zero"] = "fail"
    """What a failing reward function does: stop training, or score 0 and count it in metrics."""
    missing_eos_penalty: float | None = None
    """Subtract this from the score of completions that never produced EOS (TRL)."""
    overlong_buffer: int | None = None
    """DAPO soft overlong penalty: the last `overlong_buffer` tokens before max_new_tokens cost up to 1."""
    drop_truncated: bool = False
    """Leave completions cut at max_new_tokens out of the loss."""
    clip: float | None = None
    """Clip scores to [-clip, clip] (REINFORCE++)."""
    normalize: bool = False
    """Normalise scores to mean 0, std 1 over the batch (REINFORCE++)."""


Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_baseline", "gae"]
Aggregation = Literal[
    "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
AlgorithmName = Literal[
    "grpo", "dr_grpo", "dapo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_baseline", "ppo", "gspo", "cispo"
]


class AlgorithmConfig(_Section):
    name: AlgorithmName = "grpo"
    """Algorithm preset; its defaults fill every field below that you do not set."""
    advantage: Advantage = "grpo"
    """Advantage estimator."""
    loss: Literal["ppo", "cispo"] = "ppo"
    """Policy loss: PPO-style clipped surrogate (GRPO, DAPO, GSPO, RLOO, REINFORCE) or CISPO."""
    clip_low: float | None = 0.2
    """Lower clip range: the ratio is kept above 1 - clip_low (None = no clipping below)."""
    clip_high: float | None = 0.2
    """Upper clip range: the ratio is kept below 1 + clip_high (DAPO's clip-higher raises it)."""
    dual_clip: float | None = None
    """Dual-clip constant (> 1) bounding the loss of negative-advantage tokens."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO, GRPO) or per sequence (GSPO)."""
    aggregation: Aggregation = "seq-mean-token-mean"
    """How per-token losses become one number (token-mean is DAPO's, seq-mean-token-sum-norm Dr. GRPO's)."""
    norm_length: int | None = None
    """Length normaliser of seq-mean-token-sum-norm (None = rollout.max_new_tokens)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against the reference model (0 skips the reference model entirely)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: k1 = log-ratio (unbiased value), k3 = Schulman's low-variance estimator."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Put the KL term in the loss (GRPO) or subtract it from the reward (PPO, RLOO, REINFORCE++)."""
    kl_level: Literal["token", "sequence"] = "token"
    """With kl_in=reward: penalise each token, or the sequence's summed KL on its score."""
    kl_target: float | None = None
    """Adaptive KL controller (Ziegler et al. 2019): target KL per sequence; None = fixed kl_coef."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon in samples."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = none)."""
    entropy_top_fraction: float | None = None
    """Train only on this top fraction of tokens by entropy (the "forking tokens"; e.g. 0.2)."""
    whiten_advantages: bool = False
    """Whiten advantages across the whole batch (REINFORCE++, PPO)."""
    gamma: float = 1.0
    """Discount factor for per-token returns."""
    lam: float = 0.95
    """GAE lambda (PPO)."""
    value_clip: float | None = 0.2
    """PPO value clipping range (None = unclipped)."""
    vf_coef: float = 0.5
    """Value loss weight (PPO)."""
    num_iterations: int = 1
    """Passes over each batch of experience (PPO epochs)."""
    num_minibatches: int = 1
    """Optimizer steps per pass: the batch is split into this many shuffled minibatches."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts to refill the batch."""
    max_sampling_rounds: int = 3
    """DAPO: at most this many generation rounds per step when refilling."""
    tis_cap: float | None = None
    """Truncated importance sampling cap, when the sampler's probabilities differ from the trainer's
    (2.0 when rollout.dtype makes the sampler a copy in another dtype)."""

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError("dual_clip must be > 1")
        if self.entropy_top_fraction is not None and not 0 < self.entropy_top_fraction <= 1:
            raise ValueError("entropy_top_fraction must be in (0, 1]")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError("gamma and lam must be in [0, 1]")
        if self.kl_coef < 0:
            raise ValueError("kl_coef must be >= 0")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("kl_coef must be > 0 with kl_target: it is the adaptive controller's starting value")
        _positive(self, "num_iterations", "num_minibatches")
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
}
# Reward-side defaults of an algorithm, as fractions of rollout.max_new_tokens. DAPO's soft overlong
# penalty starts in the last fifth of the length budget (4k of 20k tokens in the paper).
REWARD_PRESETS: dict[str, dict[str, float]] = {"dapo": dict(overlong_buffer=0.2)}

# Defaults for the model that ships with lmrl (a 0.5M-parameter character-level Llama): the general
# defaults suit billion-parameter models (lr 1e-6); a tiny model learns at 1e-4 and runs fastest on one
# thread. Measured in scripts/make_tiny_model.py's notes and the README's demo run. User values win.
MODEL_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny-addition": {
        "rollout": dict(prompts_per_step=32, group_size=8, max_new_tokens=4),
        "optim": dict(lr=1e-4),
        "data": dict(num_eval_prompts=500),
        "train": dict(steps=2000, max_minutes=4.5, eval_every=50, threads=1, output_dir="runs/tiny-addition"),
        "log": dict(every=25, samples_every=250),
    },
}


class OptimConfig(_Section):
    lr: float = 1e-6
    """Policy learning rate (AdamW)."""
    critic_lr: float = 1e-5
    """Critic learning rate (PPO)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up, in optimizer steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm (None = no clipping)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward; gradients accumulate over a minibatch (memory knob, same result)."""

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if self.lr <= 0:
            raise ValueError("lr must be > 0")
        _positive(self, "micro_batch_size")
        return self


class TrainConfig(_Section):
    steps: int = 100
    """Training steps (one step = one batch of experience)."""
    seed: int = 0
    """Seed of every random choice: data order, sampling, initialisation."""
    output_dir: str = "runs/lmrl"
    """Where metrics, checkpoints and the final model go."""
    eval_every: int = 10
    """Evaluate on held-out prompts every this many steps (0 = only at start and end)."""
    save_every: int = 0
    """Save a resumable checkpoint every this many steps, and at the last step (0 = none: only `final/`,
    and a checkpoint when a signal or a failing reward stops the run)."""
    keep_last: int | None = None
    """Keep only the newest this many checkpoints (None = keep all)."""
    resume: str | None = None
    """Continue a run: "auto" from the newest complete checkpoint in output_dir (starts afresh when there
    is none), or a checkpoint directory's path. Only steps, cadences, max_minutes, threads, output_dir,
    reward.timeout and log.* may differ from the checkpoint's config."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds an earlier run, deleting that run's files."""
    max_minutes: float | None = None
    """Stop (after an evaluation and a save) once this much wall time has passed."""
    autocast_bf16: bool = False
    """Run forwards under bfloat16 autocast (weights stay in their dtype)."""
    threads: int | None = None
    """torch CPU threads (None = torch's default)."""
    logprob_chunk_size: int | None = 128
    """Rows of the [B*T, V] logits turned into float32 log-probs at once (None = all): bounds memory at large V."""
    share_prompt: bool = True
    """Update and reference forwards run each distinct prompt once for all its completions (Llama / Qwen2)."""

    @field_validator("resume", mode="before")
    @classmethod
    def _resume(cls, value: Any) -> Any:
        if isinstance(value, bool):  # train.resume=true reads as "auto"
            return "auto" if value else None
        return value

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        _positive(self, "keep_last")
        return self


class GuardConfig(_Section):
    max_skipped_steps: int = 3
    """Steps in a row whose loss or gradient was not finite (each is skipped: no weight changes) before
    the run stops, keeping its last good checkpoint."""
    max_unscored_steps: int = 3
    """Steps in a row where no reward function scored any completion (all None / NaN) before the run stops."""
    collapse_entropy: float = 0.02
    """Collapse warning: the policy's per-token entropy (nats) is below this ..."""
    collapse_drop: float = 0.5
    """... and held-out accuracy (or, without evaluation, the mean reward of the last 10 steps) fell by
    this fraction of its best. Warned once and recorded as `guard/collapse`; the run goes on."""

    @model_validator(mode="after")
    def _check(self) -> GuardConfig:
        _positive(self, "max_skipped_steps", "max_unscored_steps")
        if not 0 < self.collapse_drop <= 1:
            raise ValueError(f"collapse_drop must be in (0, 1] (got {self.collapse_drop})")
        return self


class LogConfig(_Section):
    console: bool = True
    """Live console: progress with ETA and a metrics line per step."""
    jsonl: bool = True
    """Write metrics.jsonl in the output directory."""
    tensorboard: bool = False
    """Write TensorBoard events (needs `pip install lmrl[tensorboard]`)."""
    wandb: bool = False
    """Log to Weights & Biases (needs `pip install lmrl[wandb]`)."""
    every: int = 1
    """Print a metrics line every this many steps (evaluation steps always print)."""
    samples_every: int = 10
    """Show a table of sample completions every this many steps (0 = never)."""
    num_samples: int = 4
    """Rows in each sample table."""


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        a, r = self.algorithm, self.rollout
        if a.advantage in ("grpo", "dr_grpo", "rloo", "reinforce_baseline") and r.group_size < 2:
            raise ValueError(f"rollout.group_size must be >= 2 for the {a.advantage} advantage (got {r.group_size})")
        batch = r.prompts_per_step * r.group_size
        if batch % a.num_minibatches:
            raise ValueError(
                f"algorithm.num_minibatches={a.num_minibatches} must divide the batch of "
                f"{batch} sequences (rollout.prompts_per_step x rollout.group_size)"
            )
        if self.reward.weights is not None and self.reward.functions and len(self.reward.weights) != len(
            self.reward.functions
        ):
            raise ValueError("reward.weights must have one weight per entry of reward.functions")
        if self.reward.overlong_buffer is not None and not 0 < self.reward.overlong_buffer <= r.max_new_tokens:
            raise ValueError("reward.overlong_buffer must be in [1, rollout.max_new_tokens]")
        if self.samples_with_copy and a.tis_cap is None:
            a.tis_cap = DEFAULT_TIS_CAP  # another sampler: correct for it rather than pretend on-policy
        return self

    @property
    def samples_with_copy(self) -> bool:
        """The sampler is a copy of the policy in another dtype (`rollout.dtype`)."""
        return self.rollout.dtype is not None and self.rollout.dtype != self.model.dtype

    @property
    def needs_reference(self) -> bool:
        """The reference model is loaded only when a KL term can use it."""
        return self.algorithm.kl_coef > 0 or self.algorithm.kl_target is not None


# ---------------------------------------------------------------------------------------------- loading

_SHORTHANDS = {"algorithm": "name", "model": "name_or_path", "data": "task"}


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["algorithm.clip_high=0.28", "train.steps=5"]` -> nested dict; values are parsed as YAML."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=50")
        value = _parse_value(raw)
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
    value = yaml.safe_load(raw)
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


def build_config(raw: dict[str, Any]) -> Config:
    """Validate a nested dict, filling the algorithm (and reward) section from the chosen preset."""
    raw = _normalise_shorthands(raw)
    model = (raw.get("model") or {}).get("name_or_path", ModelConfig().name_or_path)
    raw = _merge(MODEL_PRESETS.get(model, {}), raw)  # presets first: anything the user set wins
    algo = dict(raw.get("algorithm") or {})
    name = algo.get("name", "grpo")
    if name not in ALGORITHM_PRESETS:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; choose one of {', '.join(ALGORITHM_PRESETS)}")
    raw["algorithm"] = {**ALGORITHM_PRESETS[name], **algo, "name": name}
    max_new = (raw.get("rollout") or {}).get("max_new_tokens", RolloutConfig.model_fields["max_new_tokens"].default)
    reward_preset = {k: max(1, int(f * max_new)) if isinstance(max_new, int) else None
                     for k, f in REWARD_PRESETS.get(name, {}).items()}
    raw["reward"] = {**reward_preset, **dict(raw.get("reward") or {})}
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (optional), apply `key=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    raw = _merge(_normalise_shorthands(raw), parse_overrides(overrides or []))
    return build_config(raw)


def _one_line(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith("function-"))
    if err["type"] == "extra_forbidden":
        section_path, _, key = loc.rpartition(".")
        section = _section_at(section_path)
        allowed = list(section.model_fields) if section else []
        hint = difflib.get_close_matches(key, allowed, n=1)
        where = section_path or "config"
        suggestion = f"; did you mean {hint[0]!r}?" if hint else f"; allowed: {', '.join(allowed)}"
        return f"{loc}: {where} has no field {key!r}{suggestion}"
    msg = err["msg"].removeprefix("Value error, ")
    section = _section_at(loc)
    first = msg.split(" ", 1)[0]
    if loc and section is not None and first in section.model_fields:
        return f"{loc}.{msg}"  # a section validator naming its own field
    if err["type"] == "literal_error":
        return f"{loc}: got {err['input']!r}; {msg.lower()}"
    if loc and not err["type"].startswith("value_error"):
        return f"{loc}: {msg} (got {err.get('input')!r})"
    return f"{loc}: {msg}" if loc else msg


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


# fields a resumed run may change: none of them can make the saved state mean something else
RESUMABLE_CHANGES = ("train.steps", "train.eval_every", "train.save_every", "train.keep_last", "train.max_minutes",
                     "train.resume", "train.overwrite", "train.threads", "train.output_dir", "reward.timeout", "log.")


def resume_differences(saved: dict[str, Any], cfg: Config) -> list[str]:
    """`section.field (old -> new)` for every field that differs from a checkpoint's config and may not."""
    out = []
    now = cfg.model_dump(mode="json")
    for section, fields in now.items():
        for name, value in fields.items():
            key = f"{section}.{name}"
            old = (saved.get(section) or {}).get(name, value)
            if old != value and not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_CHANGES):
                out.append(f"{key} ({old!r} -> {value!r})")
    return out


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_summary(cfg: Config) -> str:
    """The resolved config, one line per section: `algorithm: name=grpo advantage=grpo ...`."""
    lines = []
    for section, values in cfg.model_dump(mode="json").items():
        lines.append(f"{section}: " + " ".join(f"{k}={v}" for k, v in values.items()))
    return "\n".join(lines)


def describe_fields() -> str:
    """Every field with its default and docstring, for `lmrl train --help-config`."""
    lines = []
    for section_name, field in Config.model_fields.items():
        section = field.annotation
        lines.append(f"{section_name}:")
        for name, f in section.model_fields.items():
            default = f.default
            lines.append(f"  {section_name}.{name} = {default!r}")
            if f.description:
                lines.append(f"      {f.description}")
    return "\n".join(lines)
