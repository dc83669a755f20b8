"""The reward-function protocol: how lmrl calls a reward function, and the sets and recipes that group them.

A reward function is called exactly as TRL's GRPOTrainer calls one, with keyword arguments only:

    def my_reward(completions, **kwargs) -> list[float | None]
    def my_reward(prompts, completions, answer, **kwargs) -> list[float | None]

`async def` functions are accepted too. lmrl calls every function once per batch of N completions
with these keyword arguments (each list has length N, aligned with `completions`):

    prompts          the prompt of each completion (a string, or a list of chat messages)
    completions      the generated text; for a chat prompt, [{"role": "assistant", "content": text}]
    completion_ids   list[list[int]]: the generated token ids, when the caller has them
    <column>         every other dataset column, one list per column (e.g. `answer`, `solution`)
    trainer_state    an object with `global_step` and `max_steps` (TRL passes its TrainerState)
    log_metric       log_metric(name, value): a number logged with the step's metrics (mean over calls)
    log_extra        log_extra(column, values): N values shown as a column of the sample table
    finished         list[bool]: True when the completion ended with EOS (False = truncated); lmrl's own

A function without `**kwargs` gets only the keyword arguments it names. A function written for
lmrl's older positional form, `fn(p, c, **kwargs)` (first two parameters named other than the
keywords above), still gets prompts and completions as its first two positional arguments.

Write functions with `**kwargs` so that new columns do not break them; `required_columns()` lists
the columns a function names without a default, so that a dataset can be checked before training.
Return one value per completion (a list, tuple, or 1-D numpy array / torch tensor of length N):
a finite real number, or None for "not applicable to this sample". Anything else is an error of
that function: NaN (return None instead), +-inf, a bool (convert with float()), a string, a dict,
a set, a generator, a 2-D array. Scores are float64, so large finite rewards (1e39) are kept.
A function that can tell one completion failed while the others scored (an LLM judge answering no score
for it) returns `Failed("why")` in that completion's place: `reward.on_error` decides for that completion
alone (stop with the line naming it, or score it 0 and count it), never a silent 0.

How `score()` (`lmrl.rewards.runner`) calls them, combines their values and contains their failures is
described there.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

RewardFn = Callable[..., "Sequence[float | None] | Awaitable[Sequence[float | None]]"]
"""fn(*, prompts, completions, **kwargs) -> list[float | None], sync or async."""

RESERVED_KWARGS = ("prompts", "completions", "trainer_state", "log_metric", "log_extra")
NON_COLUMN_KWARGS = ("prompts", "completions", "completion_ids", "finished", "trainer_state", "log_metric", "log_extra")
"""Keyword arguments score() passes that are not dataset columns."""


@dataclass(frozen=True)
class TrainerState:
    """What a reward function's `trainer_state` argument holds (the fields of TRL's TrainerState it reads most).

    Attributes:
        global_step: optimizer steps taken so far (0 before the first update; the step being scored is
            global_step + 1 during training).
        max_steps: the run's train.steps.
    """

    global_step: int = 0
    max_steps: int = 0


@dataclass(frozen=True)
class Failed:
    """A reward function's value for one completion it could not score: `reason` is one line saying why.

    `score()` treats it as a failure of that function on that completion only: under on_error="fail" the run
    stops with `reward function 'judge' failed on completion 3: <reason>`; under "zero" the completion scores
    0 and counts one in `reward/<name>/errors`. Not an exception: the other completions keep their values.
    """

    reason: str


def completion_text(completion: Any) -> str:
    """The text of a completion as a reward function receives it: a string, or for a chat prompt a list of
    messages whose last one is the assistant's answer."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"completions: expected a string or a list of chat messages, got {_short(completion)}")


def is_chat(prompt: Any) -> bool:
    """True for a chat prompt: a list of {"role", "content"} messages."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and all(isinstance(m, Mapping) for m in prompt)


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """fn's parameters (functools.partial's bound ones left out), or None when Python cannot tell."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature
        return None


def _positional_style(params: list[inspect.Parameter] | None, keywords: Sequence[str]) -> bool:
    """True for lmrl's older form `fn(p, c, **kwargs)`: a first parameter that no keyword fills (TRL's keyword
    call would leave it empty), and a second one to take the completions."""
    if params is None:
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 and positional[0].name not in keywords


def call_reward(fn: Callable[..., Any], prompts: list[Any], completions: list[Any], kwargs: dict[str, Any]) -> Any:
    """Call one reward function as TRL does: `fn(prompts=..., completions=..., **kwargs)`.

    A function without `**kwargs` gets only the keywords it names; one in lmrl's older positional form
    (see `_positional_style`) gets prompts and completions positionally.
    """
    params = _parameters(fn)
    everything = {"prompts": prompts, "completions": completions, **kwargs}
    positional = _positional_style(params, list(everything))
    if positional:
        everything = {k: v for k, v in everything.items() if k not in ("prompts", "completions")}
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        everything = {k: v for k, v in everything.items() if k in named}
    return fn(prompts, completions, **everything) if positional else fn(**everything)


def reward_name(fn: Callable[..., Any]) -> str:
    """The name a reward function is reported under: its `name` attribute, `__name__`, or class name."""
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None)
    if name is None and hasattr(fn, "func"):  # functools.partial
        name = getattr(fn.func, "__name__", None)
    return str(name or type(fn).__name__)


def is_learned(fn: Callable[..., Any]) -> bool:
    """True for a reward another model computes (`RewardModelScorer`, `JudgeScorer`, or any function with
    `learned = True`): a score the policy can raise without being right, so held-out evaluation verifies beside it."""
    return bool(getattr(fn, "learned", False))


def learned_scores(rewards: Any, out: Any) -> Any:
    """[N] float64: the weighted sum of the learned functions' scores in `out` (a `RewardOutput` of `rewards`), None
    counting 0; the whole weighted score when no function is learned (a verifier set beside a plain reward)."""
    learned = [r for r in rewards.rewards if is_learned(r.fn)]
    if not learned:
        return out.scores.double().cpu()
    return sum(r.weight * out.per_function[r.name].double().cpu().nan_to_num(0.0) for r in learned)


def is_async_reward(fn: Callable[..., Any]) -> bool:
    """True for `async def` functions and objects whose `__call__` is `async def`."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - we want the bound __call__ of callable objects
    return call is not None and inspect.iscoroutinefunction(call)


@dataclass
class WeightedReward:
    """One reward function with its weight and the name its metrics are logged under.

    Attributes:
        fn: `fn(prompts, completions, **kwargs) -> list[float | None]`, sync or async.
        weight: multiplies this function's scores in the total.
        name: metric name; defaults to `reward_name(fn)`.
    """

    fn: RewardFn
    weight: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"fn: expected a callable reward function, got {type(self.fn).__name__}")
        if not math.isfinite(float(self.weight)):
            raise ValueError(f"weight: must be a finite number, got {self.weight!r}")
        self.weight = float(self.weight)
        self.name = self.name or reward_name(self.fn)


NO_REWARD = "none"


def no_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """The reward of a distillation run that names none (`Config.trains_on_rewards`): 0 for every completion."""
    return [0.0] * len(completions)


@dataclass
class RewardSet:
    """Several reward functions with weights; names must be unique (they key the metrics)."""

    rewards: list[WeightedReward]

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ValueError("rewards: need at least one reward function")
        seen: set[str] = set()
        for r in self.rewards:
            if r.name in seen:
                raise ValueError(f"rewards: duplicate reward name {r.name!r}; give each a distinct name=")
            seen.add(r.name)

    @classmethod
    def of(
        cls,
        fns: Sequence[RewardFn | WeightedReward] | RewardFn,
        weights: Sequence[float] | None = None,
    ) -> RewardSet:
        """Build a set from functions (and optional weights, default 1.0 each)."""
        if callable(fns) and not isinstance(fns, Sequence):
            fns = [fns]
        fns = list(fns)
        if weights is not None and len(weights) != len(fns):
            raise ValueError(f"weights: got {len(weights)} weights for {len(fns)} reward functions")
        rewards = []
        for i, fn in enumerate(fns):
            if isinstance(fn, WeightedReward):
                w = fn.weight if weights is None else weights[i]
                rewards.append(WeightedReward(fn.fn, w, fn.name))
            else:
                rewards.append(WeightedReward(fn, 1.0 if weights is None else weights[i]))
        return cls(rewards)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]


@dataclass
class RewardRecipes:
    """Reward functions per kind of data: each row's label (a dataset column) picks the recipe that scores it.

    LightRFT calls these reward recipes, verl routes by the `data_source` column: the rows of a mixed
    dataset (math, code, chat) each get their own functions and weights. A function is called once per
    batch, with only the rows whose recipe names it; a row whose label has no recipe uses the one named
    `default` when there is one. The same function in two recipes (the same object, or the same config
    entry) is one function, called once over the rows of both, each recipe with its own weight.

        RewardRecipes({"math": [math_fn, WeightedReward(format_fn, 0.2)], "code": [code_fn]}, column="data_source")

    Attributes:
        recipes: label -> the functions of that label's rows: a RewardSet, or a list of functions /
            WeightedReward (weights default to 1.0), as `RewardSet.of` takes them.
        column: the dataset column holding each row's label.
    """

    recipes: Mapping[str, RewardSet | Sequence[RewardFn | WeightedReward] | RewardFn]
    column: str = "data_source"

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"column: expected the name of the column holding each row's label, got {self.column!r}")
        if not isinstance(self.recipes, Mapping) or not self.recipes:
            raise ValueError("recipes: need at least one recipe, label -> reward functions")
        sets: dict[str, RewardSet] = {}
        seen: dict[str, tuple[RewardFn, str]] = {}  # name -> (function, the first recipe naming it)
        for label, fns in self.recipes.items():
            if not isinstance(label, str) or not label:
                raise ValueError(f"recipes: a label must be a non-empty string, got {label!r}")
            try:
                sets[label] = fns if isinstance(fns, RewardSet) else RewardSet.of(fns)
            except ValueError as e:
                raise ValueError(f"recipes[{label!r}]: {str(e).removeprefix('rewards: ')}") from e
            for r in sets[label].rewards:
                fn, first = seen.setdefault(r.name, (r.fn, label))
                if fn is not r.fn:
                    raise ValueError(f"recipes: recipes {first!r} and {label!r} hold two different reward functions "
                                     f"named {r.name!r}; give them distinct names (name: in a config entry, name= in Python)")
        self.recipes = sets
        self._functions = [WeightedReward(fn, 1.0, name) for name, (fn, _) in seen.items()]
        self._columns = {label: required_columns(s) for label, s in sets.items()}

    @property
    def rewards(self) -> list[WeightedReward]:
        """Each distinct function once (weight 1.0: each recipe holds its own weights)."""
        return list(self._functions)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self._functions]

    def recipe_for(self, label: Any) -> str | None:
        """The recipe of a row labelled `label`: its own, else `default` when there is one, else None."""
        if isinstance(label, str) and label in self.recipes:
            return label
        return "default" if "default" in self.recipes else None

    def row_columns(self, row: Mapping[str, Any]) -> Mapping[str, list[str]] | str:
        """The columns one dataset row needs (column -> names of its recipe's functions reading it), or one
        line saying why no recipe can score the row."""
        if row.get(self.column) is None:
            return f"column {self.column!r} (reward.recipe_column: it picks the row's reward recipe) is " + (
                "missing" if self.column not in row else "None")
        recipe = self.recipe_for(row[self.column])
        return self._no_recipe(row[self.column]) if recipe is None else self._columns[recipe]

    def _no_recipe(self, label: Any) -> str:
        return f"{self.column} {_short(label)} has no reward.recipes entry (recipes: {', '.join(self.recipes)})"


def _columns_of(fn: Callable[..., Any]) -> list[str]:
    """The dataset columns one reward function cannot run without (see `required_columns`)."""
    declared = list(getattr(fn, "columns", None) or [])
    target = fn
    while isinstance(target, functools.partial):
        declared += list(getattr(target.func, "columns", None) or [])
        target = target.func
    params = _parameters(fn) or []  # a partial's signature already leaves out what it binds
    skip = set(NON_COLUMN_KWARGS)
    if _positional_style(params, NON_COLUMN_KWARGS):  # lmrl's older fn(p, c, ...): the first two take prompts, completions
        skip |= {p.name for p in [q for q in params if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)][:2]}
    needed = [
        p.name for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in skip
    ]
    return list(dict.fromkeys(declared + needed))


def required_columns(
    reward_set: RewardSet | RewardRecipes | Sequence[RewardFn | WeightedReward] | RewardFn,
) -> dict[str, list[str]]:
    """The dataset columns each reward function needs: column -> names of the functions needing it.

    A function needs the parameters of its signature that have no default and can be passed by
    keyword, other than the arguments that are not columns (`NON_COLUMN_KWARGS`: prompts,
    completions, completion_ids, finished, trainer_state, log_metric, log_extra), the first two of
    a function in lmrl's older positional form `fn(p, c, ...)`, and the keywords a functools.partial
    binds; plus the names in its `columns` attribute (the built-in verifiers given an explicit
    `column=` set it). A function taking only `**kwargs` needs nothing that can be known in advance.

    Example: `def f(completions, answer, *, level, hint=None, **kw)` needs "answer" and "level", so
    `required_columns([f])` is `{"answer": ["f"], "level": ["f"]}`. For RewardRecipes: the columns of
    any recipe (`RewardRecipes.row_columns(row)` gives those of one row's recipe).
    """
    rewards = reward_set if isinstance(reward_set, (RewardSet, RewardRecipes)) else RewardSet.of(reward_set)
    needed: dict[str, list[str]] = {}
    for r in rewards.rewards:
        for column in _columns_of(r.fn):
            needed.setdefault(column, []).append(r.name)
    return needed

def _short(value: Any, limit: int = 40) -> str:
    """repr(value) on one line, cut to about `limit` characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
