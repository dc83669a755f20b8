"""`score()`, the one entry point that collecting a step (`lmrl.collect`) calls: every reward function of a set
or recipe called on a batch (`lmrl.rewards.core` says with which arguments), their values checked and combined,
their failures contained.

Combining several functions (as in TRL): the total is the weighted sum over the functions that
apply, sum_i w_i * r_i with None terms left out (not renormalised). When *every* function returns
None for a sample, `all_none="zero"` (default, TRL's behaviour) gives that sample 0.0 and reports
the fraction in `reward/all_none_frac`; `all_none="error"` raises instead.

`RewardRecipes` gives each kind of row its own functions and weights (LightRFT's reward recipes,
chosen by a label column such as verl's `data_source`): each function is then called once, with only
the rows whose recipe names it, and a row's total sums its own recipe's terms.

Without a `timeout`, sync functions run one after another in the calling thread. With a `timeout`,
each sync function runs in its own daemon thread (all at once, each with its own deadline) so that
a stuck function cannot hang the trainer; Python cannot kill a thread, so a timed-out function
keeps running in the background until it returns. Async functions run concurrently on one event
loop in the calling thread, each under `asyncio.wait_for(timeout)`; an async function that blocks
without awaiting cannot be interrupted, so write blocking work as a sync function.

A reward function cannot end the run: `sys.exit()` in it, and `os._exit()` while `score()` runs
(os._exit is swapped for a function that raises), are failures of that function like an exception.
KeyboardInterrupt and other BaseExceptions still propagate. A function that timed out and calls
os._exit after `score()` returned does end the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import math
import numbers
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from lmrl.errors import RewardError
from lmrl.rewards.core import (
    RESERVED_KWARGS,
    Failed,
    RewardFn,
    RewardRecipes,
    RewardSet,
    TrainerState,
    WeightedReward,
    _short,
    call_reward,
    is_async_reward,
    is_chat,
)


@dataclass
class RewardOutput:
    """What `score()` returns.

    Attributes:
        scores: [N] float64, the weighted total per completion. float64 because a finite reward
            such as 1e39 overflows float32 to inf; cast where a lower precision is wanted.
        per_function: name -> [N] float64 raw (unweighted) scores, NaN where the function returned None
            (and, with RewardRecipes, at the completions outside its recipes).
        metrics: `reward/<name>/mean|std|none_frac|errors|failed_frac|seconds` (over the completions the function
            was called on; none when it was called on none; `errors` counts failures: 1 for a failed call,
            one per completion it returned `Failed` for; `failed_frac`: the fraction of its completions that
            failed, 1 for a failed call), `reward/mean|std`, `reward/all_none_frac`,
            as Python floats. mean/std are over the non-None values (population std); NaN when a
            function returned None for every sample. With RewardRecipes also, per recipe,
            `reward/recipe/<label>/frac` (its share of the batch) and `reward/recipe/<label>/mean`
            (the mean total score of its completions, when it has any).
            Also each name a function passed to `log_metric`, with the mean of its values.
        errors: name -> one-line message, for each function that failed and was zeroed
            (`on_error="zero"`); empty when none failed.
        extra_columns: column -> N values, from the functions' `log_extra` calls (for the sample table).
    """

    scores: torch.Tensor
    per_function: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)


class _Failure(RewardError):
    """A reward failure whose message already names the function (raised and caught inside score)."""


class _OsExitCalled(SystemExit):
    """Raised by the stand-in for os._exit while score() runs reward functions."""


def _check_value(name: str, i: int, v: Any) -> float:
    """One reward: None -> NaN, a finite real number -> float; anything else raises _Failure."""
    if v is None:
        return math.nan
    if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0:
        v = v.item()  # a 0-d tensor / array: judged by its Python scalar (bool and complex rejected below)
    expected = f"for completion {i} (expected a finite number or None)"
    if isinstance(v, (bool, np.bool_)):
        raise _Failure(f"reward function {name!r} returned a bool ({v!r}) {expected[:-1]}; convert with float())")
    if not isinstance(v, numbers.Real):  # rejects complex, str, dict, Decimal, lists, ...
        raise _Failure(f"reward function {name!r} returned a {type(v).__name__} ({_short(v)}) {expected}")
    try:
        x = float(v)
    except (OverflowError, TypeError, ValueError):  # an int beyond float64, say 10**400
        x = math.inf
    if math.isnan(x):
        raise _Failure(
            f"reward function {name!r} returned {_short(v)} for completion {i} "
            "(return None where the reward does not apply)"
        )
    if math.isinf(x):
        raise _Failure(f"reward function {name!r} returned {_short(v)} {expected}")
    return x


def _check_values(name: str, values: Any, rows: Sequence[int]) -> tuple[list[float], dict[int, str]]:
    """Validate one function's return value: a finite real number or None (None becomes NaN) for each of the
    completions `rows` (their indices in the batch, which messages name) it was called on, or `Failed` for a
    completion it could not score: those come back apart, completion -> one line naming it (their value NaN)."""
    n = len(rows)
    expected = f"expected a list of {n} rewards, one per completion"
    if isinstance(values, (torch.Tensor, np.ndarray)):
        if values.ndim != 1:
            raise _Failure(
                f"reward function {name!r} returned a {values.ndim}-D {type(values).__name__} "
                f"of shape {tuple(values.shape)} ({expected})"
            )
        values = values.tolist()  # Python scalars; a bool or complex array gives bools / complexes
    elif isinstance(values, (str, bytes, bytearray, Mapping)) or not isinstance(values, Sequence):
        # a Mapping would be read by its keys, a set in no defined order, a generator only once
        raise _Failure(f"reward function {name!r} returned a {type(values).__name__} ({_short(values)}) ({expected})")
    if len(values) != n:
        raise _Failure(f"reward function {name!r} returned {len(values)} rewards for {n} completions")
    failed = {i: f"reward function {name!r} failed on completion {i}: {' '.join(str(v.reason).split())[:500]}"
              for i, v in zip(rows, values) if isinstance(v, Failed)}
    return [math.nan if i in failed else _check_value(name, i, v) for i, v in zip(rows, values)], failed


def _exit_call(e: SystemExit) -> str:
    """The call that raised e, as written: "sys.exit(0)", "os._exit(1)", "sys.exit()"."""
    how = "os._exit" if isinstance(e, _OsExitCalled) else "sys.exit"
    return f"{how}({'' if e.code is None else _short(e.code)})"


def _exit_failure(name: str, e: SystemExit) -> _Failure:
    """The failure a reward function's sys.exit() / os._exit() becomes (the SystemExit as its cause)."""
    failure = _Failure(f"reward function {name!r} called {_exit_call(e)}")
    failure.__cause__ = e
    return failure


def _failure_message(name: str, error: BaseException) -> str:
    """One line naming the function and what went wrong."""
    if isinstance(error, _Failure):
        return str(error)
    if isinstance(error, SystemExit):
        return str(_exit_failure(name, error))
    text = " ".join(f"{type(error).__name__}: {error}".split())
    if len(text) > 500:
        text = text[:497] + "..."
    return f"reward function {name!r} failed: {text}"


# os._exit is swapped for _os_exit_in_reward while any score() call runs reward functions; the
# depth counts nested and concurrent calls so that the last one out restores the original.
_os_exit_lock = threading.Lock()
_os_exit_depth = 0
_os_exit_original: Callable[[int], Any] = os._exit
_os_exit_pid = os.getpid()


def _os_exit_in_reward(code: int) -> None:
    # a forked child (multiprocessing ends its children with os._exit) exits for real; lmrl's own deliberate
    # exit (the trainer's second Ctrl-C) calls the os._exit it kept at import (lmrl.lifecycle), not this one
    if os.getpid() != _os_exit_pid:
        _os_exit_original(code)
    raise _OsExitCalled(code)


@contextlib.contextmanager
def _os_exit_guard() -> Iterator[None]:
    """While inside, os._exit raises a SystemExit subclass instead of ending the process."""
    global _os_exit_depth, _os_exit_original, _os_exit_pid
    with _os_exit_lock:
        if _os_exit_depth == 0:
            _os_exit_original, _os_exit_pid = os._exit, os.getpid()
            os._exit = _os_exit_in_reward
        _os_exit_depth += 1
    try:
        yield
    finally:
        with _os_exit_lock:
            _os_exit_depth -= 1
            if _os_exit_depth == 0:
                os._exit = _os_exit_original


def _start_daemon_thread(fn: Callable[[], Any], name: str) -> Future:
    """Start fn() in a fresh daemon thread; its result or exception lands in the returned Future.

    A daemon thread (not a pool) so that a function that never returns can neither block interpreter
    exit nor starve later calls of workers.
    """
    fut: Future = Future()
    fut.seconds = math.nan  # type: ignore[attr-defined]  # run time, set when fn returns

    def target() -> None:
        t0 = time.perf_counter()
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises what it must
            fut.seconds = time.perf_counter() - t0  # type: ignore[attr-defined]
            fut.set_exception(e)
        else:
            fut.seconds = time.perf_counter() - t0  # type: ignore[attr-defined]
            fut.set_result(value)

    threading.Thread(target=target, name=f"lmrl-reward-{name}", daemon=True).start()
    return fut


async def _run_async_all(
    calls: list[tuple[str, Callable[[], Awaitable[Any]]]], timeout: float | None
) -> list[tuple[Any, BaseException | None, float]]:
    async def one(name: str, make: Callable[[], Awaitable[Any]]) -> tuple[Any, BaseException | None, float]:
        async def guarded() -> Any:
            # a SystemExit must become an ordinary exception inside the task that raised it: asyncio
            # re-raises a task's SystemExit out of the event loop (wait_for runs coro in its own task)
            try:
                return await make()
            except SystemExit as e:
                raise _exit_failure(name, e) from e

        t0 = time.perf_counter()
        try:
            value = await (asyncio.wait_for(guarded(), timeout) if timeout is not None else guarded())
            return value, None, time.perf_counter() - t0
        except asyncio.TimeoutError:
            return None, TimeoutError(f"timed out after {timeout:g}s"), time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - reported per function
            return None, e, time.perf_counter() - t0

    return list(await asyncio.gather(*(one(name, make) for name, make in calls)))


def _run_coroutine(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    """asyncio.run, also from inside a running event loop (e.g. Jupyter): then on a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop_running = False
    else:
        loop_running = True
    if not loop_running:  # outside the except: errors must not carry "no running event loop" as context
        return asyncio.run(coro_fn())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro_fn())
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _resolve_awaitable(value: Any) -> Any:
    """A sync-looking function (a lambda around an async one) may hand back an awaitable: await it here."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return _run_coroutine(wait)


def score(
    reward_fns: RewardSet | RewardRecipes | Sequence[RewardFn | WeightedReward] | RewardFn,
    prompts: Sequence[Any],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]] | None = None,
    *,
    completion_ids: Sequence[Sequence[int]] | None = None,
    finished: Sequence[bool] | None = None,
    trainer_state: Any = None,
    weights: Sequence[float] | None = None,
    timeout: float | None = None,
    on_error: Literal["fail", "zero"] = "fail",
    all_none: Literal["zero", "error"] = "zero",
) -> RewardOutput:
    """Score N completions with their reward functions and combine them with their weights.

    Three steps: check the inputs and route them (which function scores which completion, with which
    weight), call the functions (`call_reward`: keywords, as TRL does), combine their checked values
    into one weighted score per completion. With a RewardSet every function scores every completion;
    with RewardRecipes each function is called once, on the completions whose recipe names it.

    Args:
        reward_fns: a RewardSet, RewardRecipes, or a list of functions / WeightedReward (weights from
            `weights`).
        prompts: N prompts (strings or chat-message lists), one per completion.
        completions: N completion texts. The completion of a chat prompt reaches the functions as
            `[{"role": "assistant", "content": text}]`, as in TRL.
        columns: other dataset columns, name -> list of N values, passed as keyword arguments (with
            RewardRecipes, its `column` picks each completion's recipe).
        completion_ids: N lists of generated token ids, passed as `completion_ids` when given.
        finished: N bools (True = ended with EOS), passed as `finished` when given.
        trainer_state: passed as `trainer_state`; None passes a `TrainerState()` (global_step 0).
        weights: one weight per function, when `reward_fns` is a plain list.
        timeout: seconds allowed for each function call; None waits forever.
        on_error: "fail" raises a one-line RewardError naming the function and what went wrong;
            "zero" gives the failed function's samples 0.0 (or only the completions it returned `Failed`
            for), counts the failure in
            `reward/<name>/errors` and keeps its message in `RewardOutput.errors`. A failure is an
            exception, a timeout, sys.exit() or os._exit(), a wrong count, or a value that is not a
            finite real number or None (NaN, inf, bool, str, ...).
        all_none: what a sample gets when every function of it returned None: "zero" or "error".

    Returns:
        RewardOutput with `scores` [N] float64 (weighted total), `per_function` name -> [N]
        float64 (NaN = None, or a completion outside the function's recipes), `metrics`, `errors`
        and `extra_columns`.

    Raises:
        RewardError: a failure under on_error="fail", a weighted total that overflows float64, or
            a sample no function applied to under all_none="error".
        ValueError: bad arguments, e.g. a completion whose label has no recipe.
    """
    # 1. check the inputs, and route them: which function scores which completion, with which weight
    reward_set, kwargs = _checked_inputs(reward_fns, prompts, completions, columns, completion_ids, finished,
                                         weights, timeout, on_error, all_none)
    n = len(completions)
    routing = _route(reward_set, kwargs, n)
    prompts = list(prompts)
    completions = [[{"role": "assistant", "content": c}] if is_chat(p) else c for p, c in zip(prompts, completions)]
    logged: dict[str, list[float]] = {}
    extra: dict[str, list[Any]] = {}
    kwargs |= {"trainer_state": trainer_state if trainer_state is not None else TrainerState(),
               "log_metric": functools.partial(_log_metric, logged)}

    # each call gets its own copies of its rows, so that one function mutating its inputs cannot affect another
    def make_args(rows: list[int]) -> tuple[list[Any], list[Any], dict[str, Any]]:
        def pick(values: list[Any]) -> list[Any]:
            return list(values) if len(rows) == n else [values[i] for i in rows]

        copied = {k: pick(v) if isinstance(v, list) else v for k, v in kwargs.items()}
        copied["log_extra"] = functools.partial(_log_extra, extra, n, rows)
        return pick(prompts), [list(c) if isinstance(c, list) else c for c in pick(completions)], copied

    # 2. call the functions
    with _os_exit_guard():
        results = _run_all(routing, make_args, timeout)

    # 3. combine their values
    out = _combine(routing, results, n, on_error, all_none)
    out.metrics |= {name: sum(values) / len(values) for name, values in logged.items()}
    out.extra_columns = extra
    return out


@dataclass
class _Routing:
    """Which function scores which completion, and its weight there (F distinct functions, N completions)."""

    functions: list[WeightedReward]  # the distinct functions; their weights are in `weights`
    weights: torch.Tensor  # [F, N] float64: function f's weight in completion i's total
    applies: torch.Tensor  # [F, N] bool: the completions function f is called on
    recipes: dict[str, list[int]] | None = None  # recipe -> its completions (RewardRecipes only)

    def rows(self, f: int) -> list[int]:
        return self.applies[f].nonzero().flatten().tolist()


def _route(reward_set: RewardSet | RewardRecipes, kwargs: Mapping[str, list[Any]], n: int) -> _Routing:
    """A RewardSet: every function on every completion. RewardRecipes: each completion's label (its `column`)
    picks its recipe, and the recipe's functions and weights apply to it."""
    if isinstance(reward_set, RewardSet):
        w = torch.tensor([r.weight for r in reward_set.rewards], dtype=torch.float64)
        return _Routing(reward_set.rewards, w[:, None].expand(-1, n), torch.ones(len(w), n, dtype=torch.bool))
    functions = reward_set.rewards
    index = {r.name: f for f, r in enumerate(functions)}
    weights = torch.zeros(len(functions), n, dtype=torch.float64)
    applies = torch.zeros(len(functions), n, dtype=torch.bool)
    recipes: dict[str, list[int]] = {label: [] for label in reward_set.recipes}
    for i, label in enumerate(kwargs[reward_set.column]):
        recipe = reward_set.recipe_for(label)
        if recipe is None:
            raise ValueError(f"columns: completion {i}: {reward_set._no_recipe(label)}")
        recipes[recipe].append(i)
    for label, rows in recipes.items():
        for r in reward_set.recipes[label].rewards:
            weights[index[r.name], rows] = r.weight
            applies[index[r.name], rows] = True
    return _Routing(functions, weights, applies, recipes)


def _checked_inputs(reward_fns, prompts, completions, columns, completion_ids, finished, weights, timeout,
                    on_error, all_none) -> tuple[RewardSet | RewardRecipes, dict[str, list[Any]]]:
    """score()'s arguments checked: the reward set (or recipes) and the keyword arguments every function gets."""
    if on_error not in ("fail", "zero"):
        raise ValueError(f"on_error: expected 'fail' or 'zero', got {on_error!r}")
    if all_none not in ("zero", "error"):
        raise ValueError(f"all_none: expected 'zero' or 'error', got {all_none!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout: must be a positive number of seconds or None, got {timeout!r}")
    given = isinstance(reward_fns, (RewardSet, RewardRecipes))
    reward_set = reward_fns if given else RewardSet.of(reward_fns, weights)
    if given and weights is not None:
        raise ValueError(f"weights: give weights inside the {type(reward_fns).__name__}, not both")
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"prompts: got {len(prompts)} prompts for {n} completions")
    kwargs: dict[str, list[Any]] = {}
    extras = {"completion_ids": completion_ids, "finished": finished}
    for key, values in [*(columns or {}).items(), *((k, v) for k, v in extras.items() if v is not None)]:
        if key in RESERVED_KWARGS:
            raise ValueError(f"columns: a column may not be named {key!r} (reserved for the reward-function arguments)")
        if len(values) != n:
            raise ValueError(f"columns: column {key!r} has {len(values)} values for {n} completions")
        kwargs[key] = list(values)
    if isinstance(reward_set, RewardRecipes) and reward_set.column not in kwargs:
        raise ValueError(f"columns: no column {reward_set.column!r}, which picks each completion's reward recipe")
    return reward_set, kwargs


def _log_metric(logged: dict[str, list[float]], name: str, value: float) -> None:
    """A reward function's `log_metric(name, value)`: the step's metric `name` is the mean of its values."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"log_metric: the name must be a non-empty string, got {_short(name)}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"log_metric({name!r}, ...): expected a finite number, got {_short(value)}")
    logged.setdefault(name, []).append(float(value))


def _log_extra(extra: dict[str, list[Any]], n: int, rows: list[int], column: str, values: Sequence[Any]) -> None:
    """A reward function's `log_extra(column, values)`: one value per completion it was called on, shown in the
    sample table; the column holds N values (None at the completions no call gave a value for)."""
    if not isinstance(column, str) or not column:
        raise ValueError(f"log_extra: the column must be a non-empty string, got {_short(column)}")
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != len(rows):
        raise ValueError(f"log_extra({column!r}, ...): expected {len(rows)} values, one per completion, "
                         f"got {_short(values)}")
    out = extra.setdefault(column, [None] * n)
    for i, v in zip(rows, values):
        out[i] = v


def _combine(routing: _Routing, results: dict[str, tuple[Any, BaseException | None, float]], n: int,
             on_error: str, all_none: str) -> RewardOutput:
    """Each function's values checked (a failure raised or zeroed) and put at its completions (NaN elsewhere),
    then summed with each completion's weights."""
    per_function: dict[str, torch.Tensor] = {}
    metrics: dict[str, float] = {}
    errors: dict[str, str] = {}
    total = torch.zeros(n, dtype=torch.float64)
    applicable = torch.zeros(n, dtype=torch.bool)
    for f, r in enumerate(routing.functions):
        rows = routing.rows(f)
        values = torch.full((n,), math.nan, dtype=torch.float64)  # [N] NaN = None or not this function's completion
        per_function[r.name] = values
        if not rows:  # no completion of this batch has a recipe naming it: not called
            continue
        value, error, seconds = results[r.name]
        index = torch.tensor(rows, dtype=torch.long)  # [n_f] the completions it scored
        failed: dict[int, str] = {}  # completion -> why, for the completions it returned Failed for
        if error is None:
            try:
                checked, failed = _check_values(r.name, value, rows)
                values[index] = torch.tensor(checked, dtype=torch.float64)
            except _Failure as e:
                error = e
        if error is not None:
            msg = _failure_message(r.name, error)
            if on_error == "fail":
                cause = error.__cause__ if isinstance(error, _Failure) else error
                raise RewardError(msg) from cause
            errors[r.name] = msg
            values[index] = 0.0
        elif failed:
            first = next(iter(failed.values()))
            if on_error == "fail":
                raise RewardError(first)
            errors[r.name] = first + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
            values[list(failed)] = 0.0
        present = ~torch.isnan(values)
        total = total + torch.where(present, routing.weights[f] * values, torch.zeros_like(values))
        applicable |= present
        count = 1 if error is not None else len(failed)
        metrics.update(_function_metrics(r.name, values[index], present[index], count, seconds))
        metrics[f"reward/{r.name}/failed_frac"] = 1.0 if error is not None else len(failed) / len(rows)

    overflow = ~torch.isfinite(total)
    if overflow.any():  # each reward is finite, but weights times rewards summed can still overflow
        i = int(overflow.nonzero()[0])
        terms = {name: v[i].item() for name, v in per_function.items() if not math.isnan(v[i])}
        raise RewardError(
            f"the weighted total reward of completion {i} overflows float64 ({_short(terms, 120)}, "
            f"weights {routing.weights[routing.applies[:, i], i].tolist()}); scale the rewards or weights down"
        )
    if not applicable.all() and all_none == "error":
        idx = (~applicable).nonzero().flatten().tolist()
        raise RewardError(f"every reward function returned None for samples {idx[:10]} (all_none='error')")
    scores = total  # samples no function applied to keep the 0.0 they started with
    metrics["reward/all_none_frac"] = float((~applicable).double().mean()) if n else 0.0
    metrics["reward/mean"] = float(scores.mean()) if n else math.nan
    metrics["reward/std"] = float(scores.std(correction=0)) if n else math.nan
    for label, rows in (routing.recipes or {}).items():  # every recipe's share, 0 when it has no completion here
        metrics[f"reward/recipe/{label}/frac"] = len(rows) / n if n else 0.0
        if rows:
            metrics[f"reward/recipe/{label}/mean"] = float(scores[rows].mean())
    return RewardOutput(scores=scores, per_function=per_function, metrics=metrics, errors=errors)


def _run_all(
    routing: _Routing,
    make_args: Callable[[list[int]], tuple[list[Any], list[Any], dict[str, Any]]],
    timeout: float | None,
) -> dict[str, tuple[Any, BaseException | None, float]]:
    """Call every function once, on its completions: name -> (returned value, exception or None, seconds).
    A function with no completion in the batch is not called.

    Only Exception and SystemExit count as a function's failure: KeyboardInterrupt and other
    BaseExceptions (the trainer abandons a step with one) propagate.
    """
    results: dict[str, tuple[Any, BaseException | None, float]] = {}
    async_calls, threaded = [], []
    for f, r in enumerate(routing.functions):
        rows = routing.rows(f)
        if not rows:
            continue
        p, c, kw = make_args(rows)
        if is_async_reward(r.fn):
            async_calls.append((r.name, lambda fn=r.fn, p=p, c=c, kw=kw: call_reward(fn, p, c, kw)))
            continue
        call = lambda fn=r.fn, p=p, c=c, kw=kw: _resolve_awaitable(call_reward(fn, p, c, kw))  # noqa: E731
        if timeout is not None:
            # all threaded sync functions run at once, each with its own deadline
            threaded.append((r.name, _start_daemon_thread(call, r.name), time.perf_counter()))
        else:
            t0 = time.perf_counter()
            try:
                results[r.name] = (call(), None, time.perf_counter() - t0)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - reported per function
                results[r.name] = (None, e, time.perf_counter() - t0)
    if async_calls:
        t0 = time.perf_counter()
        try:
            outs = _run_coroutine(lambda: _run_async_all(async_calls, timeout))
        except SystemExit as e:
            # raised in a task or callback a function started itself, so not traceable to one function
            names = [name for name, _ in async_calls]
            failure = _Failure(f"an async reward function of {names} called {_exit_call(e)} in a task it started")
            failure.__cause__ = e
            outs = [(None, failure, time.perf_counter() - t0)] * len(async_calls)
        results.update({name: out for (name, _), out in zip(async_calls, outs, strict=True)})
    for name, fut, t0 in threaded:
        wait([fut], timeout=max(0.0, t0 + timeout - time.perf_counter()))
        if not fut.done():
            results[name] = (None, TimeoutError(f"timed out after {timeout:g}s"), time.perf_counter() - t0)
        elif fut.exception() is not None:
            if not isinstance(fut.exception(), (Exception, SystemExit)):
                raise fut.exception()
            results[name] = (None, fut.exception(), fut.seconds)
        else:
            results[name] = (fut.result(), None, fut.seconds)
    for r in routing.functions:  # a scorer behind a URL (remote, judge) that ran out of time: say which URL
        value, error, seconds = results.get(r.name, (None, None, 0.0))
        url = getattr(r.fn, "url", None)
        if isinstance(error, TimeoutError) and str(error) == f"timed out after {timeout:g}s" and isinstance(url, str):
            results[r.name] = (value, TimeoutError(f"timed out after {timeout:g}s waiting for {url}"), seconds)
    return results


def _function_metrics(
    name: str, values: torch.Tensor, present: torch.Tensor, failures: int, seconds: float
) -> dict[str, float]:
    kept = values[present]
    n = values.numel()
    return {
        f"reward/{name}/mean": float(kept.mean()) if kept.numel() else math.nan,
        f"reward/{name}/std": float(kept.std(correction=0)) if kept.numel() else math.nan,
        f"reward/{name}/none_frac": float((~present).double().mean()) if n else 0.0,
        f"reward/{name}/errors": float(failures),
        f"reward/{name}/seconds": seconds,
    }
