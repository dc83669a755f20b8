"""Resolving reward functions by name, as written in a config file.

A spec is one of:

- a built-in name from `BUILTIN_REWARDS` below ("math", "exact_match", "format", "regex", "length",
  "remote", "reward_model"); options are passed to its factory, e.g. `math` with `column: solution`;
- `"path/to/file.py:function_name"`: a function defined in a Python file (loaded as a module);
- `"package.module:function_name"`: a function importable from an installed module.

For user functions, options are bound as keyword arguments (`functools.partial`). Loading a user
file runs that file, as importing any module does: only load files you trust. Model outputs, by
contrast, are never executed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lmrl.rewards.core import RewardSet, WeightedReward, reward_name
from lmrl.rewards.verifiers import (
    exact_match_reward,
    format_reward,
    length_penalty_reward,
    math_reward,
    regex_reward,
)


def _remote(**kwargs: Any) -> Callable[..., Any]:
    from lmrl.rewards.remote import RemoteScorer

    return RemoteScorer(**kwargs)


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
    "reward_model": _reward_model,
}


def load_function(spec: str) -> Callable[..., Any]:
    """Load `"path/to/file.py:function"` or `"package.module:function"`.

    Raises:
        ValueError: a malformed spec, a missing file or module, or a missing / non-callable attribute.
    """
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(f"reward spec {spec!r}: expected a built-in name {sorted(BUILTIN_REWARDS)}, "
                         "'path/to/file.py:function' or 'module.sub:function'")
    if module_part.endswith(".py"):
        path = Path(module_part).expanduser()
        if not path.is_file():
            raise ValueError(f"reward spec {spec!r}: file {str(path)!r} not found")
        module_name = f"lmrl_user_reward_{abs(hash(str(path.resolve())))}"
        file_spec = importlib.util.spec_from_file_location(module_name, path)
        if file_spec is None or file_spec.loader is None:
            raise ValueError(f"reward spec {spec!r}: cannot load {str(path)!r} as a Python module")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[module_name] = module  # so that pickling and dataclasses inside the file work
        try:
            file_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(module_name, None)
            raise ValueError(f"reward spec {spec!r}: importing {str(path)!r} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise ValueError(f"reward spec {spec!r}: cannot import module {module_part!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"reward spec {spec!r}: no function {attr!r} in {module_part!r}; callables there: {public}")
    if not callable(fn):
        raise ValueError(f"reward spec {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def resolve_reward(spec: str | Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """Turn a spec into a reward function.

    Args:
        spec: a built-in name, "file.py:function", "module:function", or a callable (returned as is,
            with options bound).
        **options: factory options for a built-in; bound keyword arguments for a user function.
    """
    if callable(spec):
        fn = spec
    elif not isinstance(spec, str):
        raise TypeError(f"reward spec: expected a string or a callable, got {type(spec).__name__}")
    elif spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec](**options)
    else:
        fn = load_function(spec)
    if options:
        name = reward_name(fn)
        fn = functools.partial(fn, **options)
        fn.name = name  # type: ignore[attr-defined]  # partials have no __name__
    return fn


def reward_set_from_config(entries: Sequence[str | Callable[..., Any] | Mapping[str, Any]]) -> RewardSet:
    """Build a RewardSet from config entries.

    Each entry is a spec string, a callable, or a mapping
    `{"fn": spec, "weight": 1.0, "name": "metric_name", **options}`, e.g. in YAML:

        rewards:
          - fn: math
            column: solution
          - {fn: format, weight: 0.2}
          - {fn: my_rewards.py:brevity, weight: 0.1}
    """
    rewards = []
    for entry in entries:
        if isinstance(entry, Mapping):
            options = dict(entry)
            if "fn" not in options:
                raise ValueError(f"rewards: entry {dict(entry)!r} has no 'fn' (a built-in name or 'file.py:function')")
            spec = options.pop("fn")
            weight = float(options.pop("weight", 1.0))
            name = options.pop("name", "")
            fn = resolve_reward(spec, **options)
            rewards.append(WeightedReward(fn, weight, name))
        else:
            rewards.append(WeightedReward(resolve_reward(entry)))
    return RewardSet(rewards)
