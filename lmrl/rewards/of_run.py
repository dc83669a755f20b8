"""The reward functions of a run, as `lmrl.build` assembles them from the config and from what the user passed
(TRL's `reward_funcs` forms), and the verifier of held-out answers beside a learned reward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from lmrl.config import Config
from lmrl.errors import ConfigError


def run_rewards(cfg: Config, reward_fns: Any, task: Any):
    """The run's reward functions: those passed (`Trainer(reward_funcs=...)`: functions, reward models, names,
    `RewardSet`, `RewardRecipes`), else the config's (reward.recipes, reward.functions), else the task's own (and a
    configured environment's), else the environment's; a distillation run with none scores nothing."""
    from lmrl.rewards import RewardRecipes, RewardSet
    from lmrl.rewards.core import NO_REWARD, WeightedReward, no_reward

    if reward_fns is None:
        from lmrl.rewards import reward_recipes_from_config, reward_set_from_config

        if cfg.reward.recipes:
            return reward_recipes_from_config(cfg.reward.recipes, cfg.reward.recipe_column, sandbox=cfg.sandbox.limits())
        if cfg.reward.functions:
            reward_fns = reward_set_from_config(cfg.reward.functions, sandbox=cfg.sandbox.limits(),
                                                label_column=cfg.reward.recipe_column)
        elif task is not None:  # the task's own reward, plus a configured environment's (None where it gives none)
            reward_fns = list(task.reward_funcs) + ([reward_set_from_config(["env"]).rewards[0].fn] if cfg.env.name else [])
        elif cfg.env.name is not None:  # the environment's own reward
            reward_fns = reward_set_from_config(["env"])
        elif not cfg.trains_on_rewards:  # distillation alone: the teacher's signal trains, nothing scores
            reward_fns = [WeightedReward(no_reward, 1.0, NO_REWARD)]
        else:
            raise ConfigError("reward.functions: a dataset needs at least one reward function, "
                              "e.g. reward.functions=[math]")
    if isinstance(reward_fns, RewardRecipes):
        if cfg.reward.weights is not None:
            raise ConfigError("reward.weights: go with a list of reward functions; RewardRecipes holds its own weights")
        return reward_fns
    if isinstance(reward_fns, RewardSet):
        return RewardSet.of(reward_fns.rewards, cfg.reward.weights)
    entries = reward_fns if isinstance(reward_fns, (list, tuple)) else [reward_fns]
    return RewardSet.of([reward_of(entry) for entry in entries], cfg.reward.weights)


def run_verifier(cfg: Config, rewards: Any, task: Any):
    """The functions that verify held-out answers beside a learned reward (reward.verifier): as configured, else the
    task's own reward when a learned function is among the run's; None when there is none to verify with."""
    from lmrl.rewards import RewardSet, reward_set_from_config
    from lmrl.rewards.core import is_learned

    if cfg.reward.verifier is not None:
        return reward_set_from_config(cfg.reward.verifier, key="reward.verifier") if cfg.reward.verifier else None
    if task is not None and any(is_learned(r.fn) for r in rewards.rewards):
        return RewardSet.of(list(task.reward_funcs))
    return None


def reward_of(entry: Any) -> Any:
    """A `reward_funcs` entry as TRL takes them: a function; a reward model (a sequence-classification model
    object, its tokenizer loaded from where transformers loaded it); or a string: a reward spec (a built-in
    name, "file.py:function", "module:function") or else a reward model's directory or hub id. A directory
    holding a model (its config.json) is the reward model even where its name is a built-in's ("judge")."""
    from lmrl.rewards.reward_model import RewardModelScorer

    if isinstance(entry, nn.Module):
        from transformers import AutoTokenizer

        source = getattr(entry, "name_or_path", "")
        if not source:
            raise ConfigError(f"reward_funcs: a {type(entry).__name__} object without name_or_path: wrap it in "
                              "lmrl.rewards.reward_model.RewardModelScorer(model, tokenizer)")
        return RewardModelScorer(entry, AutoTokenizer.from_pretrained(source), name=Path(source).name or "reward_model")
    if isinstance(entry, str):
        from lmrl.rewards import reward_set_from_config
        from lmrl.rewards.registry import BUILTIN_REWARDS

        saved_model = (Path(entry) / "config.json").is_file()
        if (entry in BUILTIN_REWARDS and not saved_model) or ":" in entry:
            return reward_set_from_config([entry]).rewards[0]
        return RewardModelScorer.from_pretrained(entry, name=Path(entry).name or "reward_model")
    return entry
