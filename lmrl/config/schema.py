"""`Config`: the whole configuration, its sections as fields, and the checks between sections.

A Config is built in three steps, whichever way it comes (Python, YAML, overrides, `Config.model_validate`):
the presets go under the user's values (lmrl.config.presets), pydantic validates every field and then the
checks between sections, and `derive` fills the values derived from others. Nothing is set inside a validator.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from lmrl.config.algorithm import GROUP_ADVANTAGES, AlgorithmConfig
from lmrl.config.base import Section
from lmrl.config.messages import one_line, section_type
from lmrl.config.presets import merge, user_values, with_presets, without_presets
from lmrl.config.sections import (
    DataConfig,
    EnvConfig,
    GuardConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    SandboxConfig,
    TrainConfig,
)
from lmrl.errors import ConfigError

# optional packages a field needs: checked with the config (find_spec, no import), before any model loads
_EXTRAS = (("log.tensorboard", "tensorboard", "tensorboard"), ("log.wandb", "wandb", "wandb"), ("model.lora", "peft", "peft"))


class Config(Section):
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
        given = user_values(values)
        try:
            super().__init__(**with_presets(given))
        except ValidationError as e:
            raise ConfigError(one_line(e, Config)) from None
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
        values = without_presets(self.model_dump(), self._given)
        values["model"]["name_or_path"] = name
        out = Config(**values)
        out._given = merge(self._given, {"model": {"name_or_path": name}})
        return out

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        """The checks between sections (each section checks its own fields); they change nothing."""
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
        if r.backend == "vllm" or (r.backend == "vllm-server" and r.vllm.server_url is None):
            if importlib.util.find_spec("vllm") is None:
                raise ValueError("rollout.backend: vllm needs the vllm package, which is not installed: pip install "
                                 "'lmrl[vllm]' (docs/generation.md says where it runs)")
            if r.vllm.max_model_len is not None and r.vllm.max_model_len < self.longest_sequence:
                raise ValueError(f"rollout.vllm.max_model_len: {r.vllm.max_model_len} cannot hold a prompt and its "
                                 f"completion ({self.longest_sequence} tokens: rollout.max_prompt_length + "
                                 f"{'env.max_tokens' if self.env.name else 'rollout.max_new_tokens'}); raise it or unset it")
        if self.train.max_staleness is not None and self.train.async_steps:
            raise ValueError(f"train.max_staleness: a bound on staleness and a fixed lag (train.async_steps="
                             f"{self.train.async_steps}) are two schedules; set one of them")
        if r.partial and self.train.max_staleness is None:
            raise ValueError("rollout.partial: partial rollouts are a way of bounded staleness; set train.max_staleness "
                             "(2 is a start) or rollout.partial=false")
        if r.partial and self.train.max_staleness == 0:
            raise ValueError("rollout.partial: with train.max_staleness=0 every token must come from the policy being "
                             "updated, and a sequence that takes new weights mid-way has older ones; raise "
                             "train.max_staleness or set rollout.partial=false")
        if r.partial and (r.backend != "lmrl" or self.env.name):
            what = f"rollout.backend={r.backend}" if r.backend != "lmrl" else f"env.name={self.env.name}"
            raise ValueError(f"rollout.partial: needs lmrl's decode without an environment: {what} samples whole calls, "
                             "which cannot take new weights mid-sequence; set rollout.partial=false")
        for key, module, extra in _EXTRAS:
            section, _, name = key.partition(".")
            if getattr(getattr(self, section), name) not in (None, False) and importlib.util.find_spec(module) is None:
                raise ValueError(f"{key}: needs the {module} package, which is not installed: pip install 'lmrl[{extra}]'")
        return self

    @property
    def asynchronous(self) -> bool:
        """A generator process samples beside the trainer: a fixed lag (train.async_steps) or a bound
        (train.max_staleness)."""
        return self.train.async_steps > 0 or self.train.max_staleness is not None

    @property
    def samples_with_copy(self) -> bool:
        """lmrl's decode samples with a copy of the policy in another dtype (`rollout.dtype`). (An engine backend
        holds its own weights, in rollout.dtype when it is set.)"""
        r = self.rollout
        return r.backend == "lmrl" and r.dtype is not None and r.dtype != self.model.dtype

    @property
    def longest_sequence(self) -> int:
        """The most tokens one rollout row can hold: the longest prompt and its completion (with an environment,
        every turn and observation)."""
        return self.rollout.max_prompt_length + self.completion_budget(bool(self.env.name))

    def completion_budget(self, multi_turn: bool) -> int:
        """The most response tokens of one row: max_new_tokens, or an episode's (env.max_tokens, else every turn's)."""
        r, env = self.rollout, self.env
        return (env.max_tokens or env.max_turns * r.max_new_tokens) if multi_turn else r.max_new_tokens

    @property
    def trains_on_rewards(self) -> bool:
        """False for a distillation run that names no reward: the teacher's signal alone trains the policy."""
        r = self.reward
        return self.algorithm.teacher is None or bool(r.functions or r.recipes or self.env.name)

    @property
    def needs_reference(self) -> bool:
        """The reference model is loaded only when a KL term can use it."""
        a = self.algorithm
        return a.kl_coef > 0 or a.kl_target is not None or a.reward_minus_kl_coef > 0


DEFAULT_TIS_CAP = 2.0  # truncated importance sampling cap when the sampler is another dtype


def derive(cfg: Config) -> None:
    """Fill the values a Config derives from its other fields, where the user left them unset (None). Run once
    as each Config is built, after validation (`Config(...)`, `checked()`, `for_model()`), never inside a
    validator:

        algorithm.tis_cap  DEFAULT_TIS_CAP when the sampler is a copy of the policy in another dtype
                           (rollout.dtype), an engine (rollout.backend) or an older policy (train.async_steps,
                           train.max_staleness):
                           correct for it rather than pretend the run is on-policy
    """
    off_policy = cfg.samples_with_copy or cfg.rollout.backend != "lmrl" or cfg.asynchronous
    if off_policy and cfg.algorithm.tis_cap is None:
        cfg.algorithm.tis_cap = DEFAULT_TIS_CAP


def _place_sections(model: type[BaseModel], prefix: str = "") -> None:
    """Give each section class under `model` its key in Config (ModelConfig "model", LoraConfig "model.lora"):
    what a value assigned to one of its fields is named by in an error (`model.lora.r: must be >= 1`)."""
    for name, field in model.model_fields.items():
        section = section_type(field.annotation)
        if section is not None:
            section._key = f"{prefix}.{name}".lstrip(".")
            _place_sections(section, section._key)


# every section's assignment errors name its full key: `cfg.model.lora.r = 0` -> "model.lora.r: must be >= 1"
_place_sections(Config)
