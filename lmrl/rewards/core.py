"""The reward-function protocol and `score()`, the one entry point the experience maker calls.

A reward function has the signature TRL users already write:

    def my_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]

`async def` functions are accepted too. lmrl calls every function once per batch of N completions
with these keyword arguments (each a list of length N, aligned with `completions`):

    prompts          the prompt of each completion (a string, or a list of chat messages)
    completions      the generated text
    <column>         every other dataset column, one list per column (e.g. `answer`, `solution`)
    completion_ids   list[list[int]]: the generated token ids, when the caller has them
    finished         list[bool]: True when the completion ended with EOS (False = truncated)

Write functions with `**kwargs` so that new columns do not break them. Return one value per
completion: a float, or None for "not applicable to this sample" (a NaN counts as None too).

Combining several functions (as in TRL): the total is the weighted sum over the functions that
apply, sum_i w_i * r_i with None terms left out (not renormalised). When *every* function returns
None for a sample, `all_none="zero"` (default, TRL's behaviour) gives that sample 0.0 and reports
the fraction in `reward/all_none_frac`; `all_none="error"` raises instead.

Without a `timeout`, sync functions run one after another in the calling thread. With a `timeout`,
each sync function runs in its own daemon thread (all at once, each with its own deadline) so that
a stuck function cannot hang the trainer; Python cannot kill a thread, so a timed-out function
keeps running in the background until it returns. Async functions run concurrently on one event
loop in the calling thread, each under `asyncio.wait_for(timeout)`; an async function that blocks
without awaiting cannot be interrupted, so write blocking work as a sync function.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lmrl.errors import RewardError

RewardFn = Callable[..., "Sequence[float | None] | Awaitable[Sequence[float | None]]"]
"""fn(prompts, completions, **kwargs) -> list[float | None], sync or async."""

RESERVED_KWARGS = ("prompts", "completions")


def reward_name(fn: Callable[..., Any]) -> str:
    """The name a reward function is reported under: its `name` attribute, `__name__`, or class name."""
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None)
    if name is None and hasattr(fn, "func"):  # functools.partial
        name = getattr(fn.func, "__name__", None)
    return str(name or type(fn).__name__)


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
class RewardOutput:
    """What `score()` returns.

    Attributes:
        scores: [N] float32, the weighted total per completion.
        per_function: name -> [N] float32 raw (unweighted) scores, NaN where the function returned None.
        metrics: `reward/<name>/mean|std|none_frac|errors|seconds`, `reward/mean|std`,
            `reward/all_none_frac`, as Python floats. mean/std are over the non-None values
            (population std); NaN when a function returned None for every sample.
    """

    scores: torch.Tensor
    per_function: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)


def _check_values(name: str, values: Any, n: int) -> list[float]:
    """Validate one function's return value; None and NaN become NaN."""
    if values is None or isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardError(f"reward function {name!r} must return a list of floats, got {type(values).__name__}")
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} rewards for {n} completions")
    out = []
    for v in values:
        if v is None:
            out.append(math.nan)
            continue
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise RewardError(
                f"reward function {name!r} returned a {type(v).__name__} ({v!r:.40}), expected float or None"
            ) from None
    return out


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
        except BaseException as e:  # noqa: BLE001 - handed to the caller
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
    async def one(make: Callable[[], Awaitable[Any]]) -> tuple[Any, BaseException | None, float]:
        t0 = time.perf_counter()
        try:
            coro = make()
            value = await (asyncio.wait_for(coro, timeout) if timeout is not None else coro)
            return value, None, time.perf_counter() - t0
        except asyncio.TimeoutError:
            return None, TimeoutError(f"timed out after {timeout:g}s"), time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - reported per function
            return None, e, time.perf_counter() - t0

    return list(await asyncio.gather(*(one(make) for _, make in calls)))


def _run_coroutine(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    """asyncio.run, also from inside a running event loop (e.g. Jupyter): then on a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
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
    reward_fns: RewardSet | Sequence[RewardFn | WeightedReward] | RewardFn,
    prompts: Sequence[Any],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]] | None = None,
    *,
    completion_ids: Sequence[Sequence[int]] | None = None,
    finished: Sequence[bool] | None = None,
    weights: Sequence[float] | None = None,
    timeout: float | None = None,
    on_error: Literal["fail", "zero"] = "fail",
    all_none: Literal["zero", "error"] = "zero",
) -> RewardOutput:
    """Score N completions with every reward function and combine them with their weights.

    Args:
        reward_fns: a RewardSet, or a list of functions / WeightedReward (weights from `weights`).
        prompts: N prompts (strings or chat-message lists), one per completion.
        completions: N completion texts.
        columns: other dataset columns, name -> list of N values, passed as keyword arguments.
        completion_ids: N lists of generated token ids, passed as `completion_ids` when given.
        finished: N bools (True = ended with EOS), passed as `finished` when given.
        weights: one weight per function, when `reward_fns` is a plain list.
        timeout: seconds allowed for each function call; None waits forever.
        on_error: "fail" raises RewardError naming the function and the exception; "zero" gives
            the failed function's samples 0.0 and counts the failure in `reward/<name>/errors`.
            A wrong count or a non-numeric value counts as a failure too.
        all_none: what a sample gets when every function returned None: "zero" or "error".

    Returns:
        RewardOutput with `scores` [N] (weighted total), `per_function` name -> [N] (NaN = None)
        and `metrics`.
    """
    if on_error not in ("fail", "zero"):
        raise ValueError(f"on_error: expected 'fail' or 'zero', got {on_error!r}")
    if all_none not in ("zero", "error"):
        raise ValueError(f"all_none: expected 'zero' or 'error', got {all_none!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout: must be a positive number of seconds or None, got {timeout!r}")
    reward_set = reward_fns if isinstance(reward_fns, RewardSet) else RewardSet.of(reward_fns, weights)
    if isinstance(reward_fns, RewardSet) and weights is not None:
        raise ValueError("weights: give weights inside the RewardSet, not both")

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
    prompts, completions = list(prompts), list(completions)

    # each function gets its own copies so that one function mutating its inputs cannot affect another
    def make_args() -> tuple[list[Any], list[str], dict[str, list[Any]]]:
        return list(prompts), list(completions), {k: list(v) for k, v in kwargs.items()}

    results: dict[str, tuple[Any, BaseException | None, float]] = {}
    async_calls, threaded = [], []
    for r in reward_set.rewards:
        p, c, kw = make_args()
        if is_async_reward(r.fn):
            async_calls.append((r.name, lambda fn=r.fn, p=p, c=c, kw=kw: fn(p, c, **kw)))
            continue
        call = lambda fn=r.fn, p=p, c=c, kw=kw: _resolve_awaitable(fn(p, c, **kw))  # noqa: E731
        if timeout is not None:
            # all threaded sync functions run at once, each with its own deadline
            threaded.append((r.name, _start_daemon_thread(call, r.name), time.perf_counter()))
        else:
            t0 = time.perf_counter()
            try:
                results[r.name] = (call(), None, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - reported per function below
                results[r.name] = (None, e, time.perf_counter() - t0)
    if async_calls:
        outs = _run_coroutine(lambda: _run_async_all(async_calls, timeout))
        results.update({name: out for (name, _), out in zip(async_calls, outs, strict=True)})
    for name, fut, t0 in threaded:
        wait([fut], timeout=max(0.0, t0 + timeout - time.perf_counter()))
        if not fut.done():
            results[name] = (None, TimeoutError(f"timed out after {timeout:g}s"), time.perf_counter() - t0)
        elif fut.exception() is not None:
            results[name] = (None, fut.exception(), fut.seconds)
        else:
            results[name] = (fut.result(), None, fut.seconds)

    per_function: dict[str, torch.Tensor] = {}
    metrics: dict[str, float] = {}
    total = torch.zeros(n, dtype=torch.float64)
    applicable = torch.zeros(n, dtype=torch.bool)
    for r in reward_set.rewards:
        value, error, seconds = results[r.name]
        if error is None:
            try:
                values = torch.tensor(_check_values(r.name, value, n), dtype=torch.float64)
            except RewardError as e:
                error = e
        if error is not None:
            if on_error == "fail":
                msg = str(error) if isinstance(error, RewardError) else f"{type(error).__name__}: {error}"
                msg = " ".join(msg.split())  # one line
                if isinstance(error, RewardError):
                    raise RewardError(msg) from None
                raise RewardError(f"reward function {r.name!r} failed: {msg}") from error
            values = torch.zeros(n, dtype=torch.float64)
        present = ~torch.isnan(values)
        total = total + torch.where(present, r.weight * values, torch.zeros_like(values))
        applicable |= present
        per_function[r.name] = values.float()
        metrics.update(_function_metrics(r.name, values, present, error is not None, seconds))

    if not applicable.all() and all_none == "error":
        idx = (~applicable).nonzero().flatten().tolist()
        raise RewardError(f"every reward function returned None for samples {idx[:10]} (all_none='error')")
    scores = total.float()  # samples no function applied to keep the 0.0 they started with
    metrics["reward/all_none_frac"] = float((~applicable).double().mean()) if n else 0.0
    metrics["reward/mean"] = float(scores.double().mean()) if n else math.nan
    metrics["reward/std"] = float(scores.double().std(correction=0)) if n else math.nan
    return RewardOutput(scores=scores, per_function=per_function, metrics=metrics)


def _function_metrics(
    name: str, values: torch.Tensor, present: torch.Tensor, failed: bool, seconds: float
) -> dict[str, float]:
    kept = values[present]
    n = values.numel()
    return {
        f"reward/{name}/mean": float(kept.mean()) if kept.numel() else math.nan,
        f"reward/{name}/std": float(kept.std(correction=0)) if kept.numel() else math.nan,
        f"reward/{name}/none_frac": float((~present).double().mean()) if n else 0.0,
        f"reward/{name}/errors": float(failed),
        f"reward/{name}/seconds": seconds,
    }
