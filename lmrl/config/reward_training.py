"""`RewardTrainingConfig`: what `lmrl train-rm` and `lmrl.RewardTrainer` train a reward model with.

Built like the policy's `Config`: typed sections with a docstring on every field, YAML plus `key=value`
overrides, checked on load with one-line errors that name the full key. TRL's `RewardConfig` names map
onto these fields in docs/coming-from-trl.md.

    cfg = load_reward_config("rm.yaml", ["data.path=pairs.jsonl", "train.epochs=2"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from lmrl.config.base import (
    MAX_SEED,
    Dtype,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
)
from lmrl.config.loading import parse_overrides, read_yaml
from lmrl.config.messages import one_line, section_type
from lmrl.config.presets import merge
from lmrl.config.sections import LoraConfig
from lmrl.errors import ConfigError


class RMModelConfig(Section):
    name_or_path: NonEmptyStr = "tiny-addition"
    """A causal LM (a new one-output score head is added) or a reward model to train further: a local directory,
    a hub id, or a model shipped with lmrl."""
    dtype: Dtype = "float32"
    """The weights' dtype while training ("auto": the checkpoint's own)."""
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")] = "auto"
    """Where the model trains: cpu, cuda, cuda:N, or auto (cuda when there is one)."""
    trust_remote_code: bool = False
    """Run the model repository's own code (only for repositories you trust)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters and the score head instead of every weight (needs peft)."""


class PairDataConfig(Section):
    path: NonEmptyStr | None = None
    """The preference pairs: a .jsonl / .json / .parquet file with chosen and rejected (and an optional prompt
    and margin), a saved dataset directory, or a hub dataset."""
    split: str = "train"
    """The split of a hub or saved dataset (a file is one split)."""
    eval_path: NonEmptyStr | None = None
    """Held-out pairs, read like data.path; or set data.eval_fraction."""
    eval_split: str = "test"
    """The split of data.eval_path."""
    eval_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Hold out this fraction of data.path's pairs (drawn with train.seed) for evaluation."""
    prompt_column: NonEmptyStr = "prompt"
    """The explicit prompt's column; a row without it has an implicit prompt (what chosen and rejected share)."""
    margin_column: NonEmptyStr = "margin"
    """The optional column of per-pair margins: how much the chosen side should win by."""
    max_length: PositiveInt | None = 1024
    """The longest side of a pair in tokens (prompt + completion, rendered as the scorer renders it)."""
    on_too_long: Literal["skip", "fail", "truncate"] = "skip"
    """A pair longer than data.max_length: left out and counted (skip, as TRL does), refused (fail), or cut to its
    last data.max_length tokens (truncate), as `{fn: reward_model, max_length: N}` cuts what it scores."""
    on_bad_row: Literal["fail", "skip"] = "fail"
    """A row that is not a pair (a missing side, chosen == rejected, an empty side, ...): stop (fail) or leave it
    out (skip)."""


class RMTrainConfig(Section):
    output_dir: NonEmptyStr = "runs/reward-model"
    """The run directory: metrics.jsonl, checkpoints, and the trained model in OUTPUT/final."""
    epochs: PositiveInt = 1
    """Passes over the training pairs (train.steps, when set, wins)."""
    steps: PositiveInt | None = None
    """Optimizer steps to train; None: as many as train.epochs make."""
    batch_size: PositiveInt = 8
    """Pairs in one forward (each pair is two sequences, chosen and rejected, in the same forward)."""
    gradient_accumulation_steps: PositiveInt = 1
    """Forwards per optimizer step: a step learns from batch_size x gradient_accumulation_steps pairs."""
    center_rewards_coefficient: NonNegativeFloat | None = None
    """Weight of TRL's centering term coef x mean((r_chosen + r_rejected)^2), which keeps rewards near zero mean
    (Eisenstein et al. 2023); None: off."""
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    """Seeds the new score head, the held-out draw and the order of pairs."""
    eval_every: NonNegativeInt = 0
    """Evaluate on the held-out pairs every N steps (0: only at the end)."""
    save_every: NonNegativeInt = 0
    """Write a checkpoint every N steps (0: none; the final model is always written)."""
    resume: str | None = None
    """Resume from a checkpoint: "auto" (the newest in train.output_dir, or start) or a checkpoint directory."""
    overwrite: bool = False
    """Train into an output directory that already holds a run, replacing it."""
    threads: PositiveInt | None = None
    """torch's CPU threads (None: torch's default)."""
    share_prompt: bool = True
    """Compute the tokens a pair's two sides start with (the prompt, and any common start of the two answers) once for
    both, on a Llama / Qwen2 reward model (`lmrl.models.shared_prompt.shared_prefix_rewards`): the same rewards and
    gradients as two whole forwards, to float rounding; false: one right-padded forward of every chosen and rejected
    sequence, as TRL's."""


class RMOptimConfig(Section):
    lr: PositiveFloat = 1e-4
    """AdamW's learning rate (TRL's RewardConfig default)."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW's decoupled weight decay."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    """AdamW's betas."""
    warmup_steps: NonNegativeInt = 0
    """Steps of linear learning-rate warmup from 0."""
    max_grad_norm: PositiveFloat | None = 1.0
    """Clip the gradient's global norm to this (None: no clipping)."""


class RMLogConfig(Section):
    console: bool = True
    """Progress bar and a metrics line per train.log.every steps."""
    jsonl: bool = True
    """Write metrics.jsonl in train.output_dir."""
    every: PositiveInt = 1
    """Print a metrics line every N steps."""


class RewardTrainingConfig(Section):
    """The whole configuration of a reward-model run. An invalid value raises `ConfigError` with one line."""

    model: RMModelConfig = Field(default_factory=RMModelConfig)
    data: PairDataConfig = Field(default_factory=PairDataConfig)
    train: RMTrainConfig = Field(default_factory=RMTrainConfig)
    optim: RMOptimConfig = Field(default_factory=RMOptimConfig)
    log: RMLogConfig = Field(default_factory=RMLogConfig)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(one_line(e, RewardTrainingConfig)) from None

    @model_validator(mode="after")
    def _cross_checks(self) -> RewardTrainingConfig:
        d = self.data
        if d.path is None:
            raise ValueError("data.path: give the preference pairs to train on, e.g. data.path=pairs.jsonl")
        if d.eval_path is not None and d.eval_fraction > 0:
            raise ValueError("data.eval_fraction: give held-out pairs by data.eval_path or data.eval_fraction, not both")
        return self

    def checked(self) -> RewardTrainingConfig:
        """This config validated again as a whole (fields assigned after it was built)."""
        return RewardTrainingConfig(**self.model_dump())


def load_reward_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RewardTrainingConfig:
    """A YAML file (optional) with `key=value` overrides on top, validated."""
    raw: dict[str, Any] = read_yaml(path) if path is not None else {}
    return RewardTrainingConfig(**merge(raw, parse_overrides(overrides or [])))


def _place_sections(model: type[Section], prefix: str = "") -> None:
    for name, field in model.model_fields.items():
        section = section_type(field.annotation)
        if section is not None and section is not LoraConfig:  # LoraConfig's key is "model.lora" in both configs
            section._key = f"{prefix}.{name}".lstrip(".")
            _place_sections(section, section._key)


_place_sections(RewardTrainingConfig)
