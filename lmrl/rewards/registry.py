"""Resolving reward functions by name, as written in a config file.

A spec is one of:

- a built-in name from `BUILTIN_REWARDS` below ("math", "exact_match", "format", "regex", "length",
  "remote", "judge", "reward_model", "code", "env"); options are passed to its factory, e.g. `math` with `column: solution`;
- `"path/to/file.py:function_name"`: a function defined in a Python file (loaded as a module);
- `"package.module:function_name"`: a function importable from an installed module.

For user functions, options are bound as keyword arguments (`functools.partial`). Loading a user
file (`lmrl.user_code.load_function`) runs that file, as importing any module does: only load files
you trust. Model outputs, by contrast, are never executed.

Every problem is a one-line `lmrl.errors.ConfigError` (a ValueError) naming the spec, and, from
`reward_set_from_config`, the entry: `reward.functions[2]: reward spec 'r.py:f': file 'r.py' not found`
(`reward.recipes.math[0]: ...` for an entry of a recipe, `reward_recipes_from_config`).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lmrl.errors import ConfigError, LmrlError
from lmrl.rewards.core import RewardRecipes, RewardSet, WeightedReward, completion_text, is_chat, reward_name
from lmrl.rewards.verifiers import (
    exact_match_reward,
    format_reward,
    length_penalty_reward,
    math_reward,
    regex_reward,
)
from lmrl.user_code import load_function


def _remote(**kwargs: Any) -> Callable[..., Any]:
    from lmrl.rewards.remote import RemoteScorer

    return RemoteScorer(**kwargs)


def _judge(**kwargs: Any) -> Callable[..., Any]:
    from lmrl.rewards.judge import JudgeScorer

    return JudgeScorer(**kwargs)


def _code(**kwargs: Any) -> Callable[..., Any]:
    from lmrl.rewards.code import code_reward

    return code_reward(**kwargs)


def _env(**kwargs: Any) -> Callable[..., Any]:
    from lmrl.envs import env_reward

    if kwargs:
        raise ValueError(f"takes no options, got {sorted(kwargs)}")
    return env_reward


def _reward_model(**kwargs: Any) -> Callable[..., Any]:
    from lmrl.rewards.reward_model import RewardModelScorer

    return RewardModelScorer.from_pretrained(**kwargs)


# name -> factory(**options) -> reward function. The whole list of built-ins: grep here.
BUILTIN_REWARDS: dict[str, Callable[..., Callable[..., Any]]] = {
    "math": math_reward,
    "exact_match": exact_match_reward,
    "format": format_reward,
    "regex": regex_reward,
    "length": length_penalty_reward,
    "remote": _remote,
    "judge": _judge,
    "reward_model": _reward_model,
    "code": _code,
    "env": _env,
}
SANDBOXED_REWARDS = ("code",)
"""Built-ins that run model-written code: they get the config's `sandbox` limits unless an entry sets its own."""


def _check_options(spec: str, fn: Callable[..., Any], options: Mapping[str, Any]) -> None:
    """Options bound to a user function must be parameters of it (or go to its **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigError(f"reward {spec!r}: option(s) {unknown} are not parameters of the function; it takes {sorted(names)}")


def resolve_reward(spec: str | Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """Turn a spec into a reward function.

    Args:
        spec: a built-in name, "file.py:function", "module:function", or a callable (returned as is,
            with options bound).
        **options: factory options for a built-in; bound keyword arguments for a user function.

    Raises:
        ConfigError: an unknown name, a spec that does not load, options the factory or function
            does not take, or an option value the built-in rejects.
    """
    if callable(spec):
        fn = spec
    elif not isinstance(spec, str):
        raise ConfigError(f"reward spec: expected a string or a callable, got {type(spec).__name__} ({spec!r:.40})")
    elif spec in BUILTIN_REWARDS:
        try:
            return BUILTIN_REWARDS[spec](**options)
        except (TypeError, ValueError) as e:  # an unknown option, a bad pattern, a bad length ...
            if isinstance(e, LmrlError):
                raise type(e)(f"reward {spec!r}: {e}") from e
            raise ConfigError(f"reward {spec!r}: {' '.join(str(e).split())}") from e
    else:
        fn = load_function(spec, "reward spec", BUILTIN_REWARDS)
    if options:
        name = reward_name(fn)
        _check_options(spec if isinstance(spec, str) else name, fn, options)
        fn = functools.partial(fn, **options)
        fn.name = name  # type: ignore[attr-defined]  # partials have no __name__
    return fn


def queries_reward(fn: Callable[..., Any], label_column: str = "data_source") -> Callable[..., Any]:
    """A function in OpenRLHF's and LightRFT's convention, `reward_func(queries, prompts, labels)`, as an lmrl
    reward function (a config entry's `call: queries`).

    It is called with `queries`: each prompt's text followed by its completion's (for a chat prompt, the
    messages' contents joined by newlines, then the completion; lmrl has no chat template here), `prompts`:
    the prompts as the dataset holds them, and `labels`: the `label_column` values (None when the dataset has
    no such column). It returns N rewards (a list or a tensor), or as newer OpenRLHF versions do a dict
    {"rewards": N rewards, "extra_logs": {name: values}}, each extra log becoming a metric (its mean).
    """

    def reward(prompts: list[Any], completions: list[Any], log_metric: Callable[..., Any], **kwargs: Any) -> Any:
        queries = [_prompt_text(p) + completion_text(c) for p, c in zip(prompts, completions)]
        out = fn(queries, prompts, kwargs.get(label_column))
        if isinstance(out, Mapping):
            if "rewards" not in out:
                raise ValueError(f"returned a dict without 'rewards' (keys: {sorted(map(str, out))})")
            for key, value in (out.get("extra_logs") or {}).items():
                log_metric(key, float(torch.as_tensor(value, dtype=torch.float64).mean()))
            out = out["rewards"]
        return out

    reward.__name__ = reward.__qualname__ = reward_name(fn)
    return reward


def _prompt_text(prompt: Any) -> str:
    return "\n".join(str(m.get("content", "")) for m in prompt) + "\n" if is_chat(prompt) else str(prompt)


def _weight(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ConfigError(f"{where}.weight: expected a finite number, got {value!r:.40}")
    try:
        weight = float(value)
    except (ValueError, OverflowError):
        weight = math.nan
    if not math.isfinite(weight):
        raise ConfigError(f"{where}.weight: expected a finite number, got {value!r:.40}")
    return weight


def reward_set_from_config(
    entries: Sequence[str | Callable[..., Any] | Mapping[str, Any]], sandbox: Any = None, *,
    key: str = "reward.functions", resolved: list[tuple[Any, Callable[..., Any]]] | None = None,
    label_column: str = "data_source",
) -> RewardSet:
    """Build a RewardSet from config entries.

    Each entry is a spec string, a callable, or a mapping
    `{"fn": spec, "weight": 1.0, "name": "metric_name", **options}`, e.g. in YAML:

        rewards:
          - fn: math
            column: solution
          - {fn: format, weight: 0.2}
          - {fn: my_rewards.py:brevity, weight: 0.1}

    `sandbox` (the config's `SandboxLimits`) goes to the built-ins that run model-written code
    (`SANDBOXED_REWARDS`), unless an entry gives its own `sandbox` option. `call: queries` calls a user
    function as OpenRLHF and LightRFT do, `reward_func(queries, prompts, labels)` (`queries_reward`).

    Args:
        key: the config key the entries came from, which messages start with.
        resolved: (entry without its weight, function) pairs already built: an equal entry reuses the
            function rather than building a second one (the recipes of `reward_recipes_from_config`
            share one list); new ones are appended.

    Raises:
        ConfigError: one line starting `reward.functions[i]: ` for the first entry that does not
            resolve (ModelError and other lmrl errors keep their class, with the same prefix).
    """
    resolved = [] if resolved is None else resolved
    rewards = []
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if sandbox is not None and isinstance(entry, str) and entry in SANDBOXED_REWARDS:
            entry = {"fn": entry}
        if sandbox is not None and isinstance(entry, Mapping) and entry.get("fn") in SANDBOXED_REWARDS:
            entry = {"sandbox": sandbox, **entry}
        try:
            options = dict(entry) if isinstance(entry, Mapping) else {"fn": entry}
            if "fn" not in options:
                raise ConfigError(f"entry {dict(entry)!r} has no 'fn' (a built-in name or 'file.py:function')")
            weight = _weight(where, options.pop("weight", 1.0))
            name = options.get("name", "")
            if not isinstance(name, str):
                raise ConfigError(f"{where}.name: expected a string, got {name!r:.40}")
            fn = next((fn for same, fn in resolved if same == options), None)
            if fn is None:
                built = {k: v for k, v in options.items() if k != "name"}
                spec, call = built.pop("fn"), built.pop("call", None)
                if call is not None and call != "queries":
                    raise ConfigError(f"{where}.call: expected 'queries' (reward_func(queries, prompts, labels), as "
                                      f"OpenRLHF and LightRFT call it), got {call!r:.40}")
                if call is not None and (not isinstance(spec, str) or spec in BUILTIN_REWARDS):
                    raise ConfigError(f"{where}.call: only for a user function ('file.py:function'), not {spec!r:.40}")
                fn = resolve_reward(spec, **built)
                if name and "name" in getattr(fn, "__dict__", {}):
                    fn.name = name  # a scorer object names its own metrics and columns (the judge's <name>/text)
                if call is not None:
                    fn = queries_reward(fn, label_column)
                resolved.append((options, fn))
            rewards.append(WeightedReward(fn, weight, name))
        except LmrlError as e:
            message = str(e) if str(e).startswith(where) else f"{where}: {e}"
            raise type(e)(message) from e
    try:
        return RewardSet(rewards)
    except ValueError as e:  # duplicate names
        raise ConfigError(f"{key}: {str(e).removeprefix('rewards: ')}") from e


def reward_recipes_from_config(
    recipes: Mapping[str, Sequence[str | Callable[..., Any] | Mapping[str, Any]]], column: str = "data_source",
    sandbox: Any = None,
) -> RewardRecipes:
    """Build RewardRecipes from the config's `reward.recipes` (label -> entries as `reward_set_from_config`
    takes them) and `reward.recipe_column`. An entry written the same way in two recipes (its weight aside)
    is one function, called once over the rows of both recipes, each with its own weight.

    Raises:
        ConfigError: one line starting `reward.recipes.<label>[i]: ` for an entry that does not resolve;
            `reward.recipes: ` for two different functions under one name.
    """
    resolved: list[tuple[Any, Callable[..., Any]]] = []
    sets = {label: reward_set_from_config(entries, sandbox, key=f"reward.recipes.{label}", resolved=resolved,
                                          label_column=column)
            for label, entries in recipes.items()}
    try:
        return RewardRecipes(sets, column)
    except ValueError as e:
        raise ConfigError(f"reward.{e}") from e
