"""Typed, validated configuration: one section per concern, YAML files plus `key=value` overrides.

    cfg = load_config("examples/dapo.yaml", ["algorithm.clip_high=0.3", "train.steps=50"])

Choosing an algorithm by name (`algorithm.name=dapo`, or the shorthand `algorithm=dapo`) fills the
algorithm section from its preset in `ALGORITHM_PRESETS`; anything the user sets explicitly wins.
Every field has a docstring: `lmrl train --help-config` prints them. Invalid values fail here, before
any model loads, with one line that names the field and what is allowed.

The package, lowest layer first (each module imports only those above it in this list):

    foreign_names  other frameworks' config names and the lmrl field each one is
    messages       pydantic's errors as one line naming the full key
    base           the section base class and the constrained field types
    sections       the sections: model, data, rollout, reward, optim, train, guard, log, env, sandbox
    algorithm      the algorithm section
    presets        the algorithms' and the shipped models' presets, and putting them under a user's values
    schema         Config: the sections, the checks between them, derived values
    loading        YAML files and key=value overrides -> Config
    reward_training  RewardTrainingConfig: `lmrl train-rm`'s config (its own sections, the same rules)
    describe       --help-config, the resolved config's summary and YAML, warnings

This module only hands names on.
"""

# the algorithm section (`Config(algorithm=AlgorithmConfig(name="rloo"))`, lmrl.scored, tests)
from lmrl.config.algorithm import AlgorithmConfig

# --help-config, and the resolved config as a run prints and saves it (cli, trainer, lifecycle)
from lmrl.config.describe import config_summary, config_to_yaml, config_warnings, describe_fields

# building a Config from YAML files, overrides or a nested dict (cli, tests, benchmarks)
from lmrl.config.loading import build_config, load_config, parse_overrides, read_yaml

# what presets set, and the step that puts them under a user's values (docs/python.md, tests, benchmarks)
from lmrl.config.presets import ALGORITHM_PRESETS, MODEL_PRESETS, REWARD_PRESETS, with_presets

# `lmrl train-rm`'s config (lmrl.reward_trainer, cli)
from lmrl.config.reward_training import RewardTrainingConfig, load_reward_config

# the whole config (`from lmrl import Config`: lmrl/__init__.py), and the tis_cap it derives
from lmrl.config.schema import DEFAULT_TIS_CAP, Config

# the other sections, for building one as an object (`Config(rollout=RolloutConfig(...))`)
from lmrl.config.sections import (
    DataConfig,
    EnvConfig,
    GuardConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    SandboxConfig,
    TrainConfig,
)

# the error every invalid value raises (`from lmrl.config import ConfigError`: tests)
from lmrl.errors import ConfigError

__all__ = [
    "ALGORITHM_PRESETS", "DEFAULT_TIS_CAP", "MODEL_PRESETS", "REWARD_PRESETS", "AlgorithmConfig", "Config",
    "ConfigError", "DataConfig", "EnvConfig", "GuardConfig", "LogConfig", "LoraConfig", "ModelConfig",
    "OptimConfig", "RewardConfig", "RewardTrainingConfig", "RolloutConfig", "SandboxConfig", "TrainConfig", "build_config",
    "config_summary", "config_to_yaml", "config_warnings", "describe_fields", "load_config", "load_reward_config", "parse_overrides",
    "read_yaml", "with_presets",
]
