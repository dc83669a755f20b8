"""score(): weights, None handling, sync / async / slow / failing functions, wrong counts, metrics,
values that are not finite numbers, exits inside reward functions, required_columns."""

from __future__ import annotations

import asyncio
import functools
import math
import os
import re
import subprocess
import sys
import threading
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.rewards import (
    RemoteScorer,
    RewardError,
    RewardSet,
    WeightedReward,
    exact_match_reward,
    format_reward,
    math_reward,
    required_columns,
    score,
)

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


def length_fn(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def half_none(prompts, completions, **kwargs):
    return [1.0, None, 3.0]


def all_none_fn(prompts, completions, **kwargs):
    return [None] * len(completions)


def test_weighted_sum_hand_computed():
    out = score([length_fn, half_none], PROMPTS, COMPLETIONS, weights=[0.5, 2.0])
    # sample 0: 0.5*1 + 2*1 = 2.5; sample 1: 0.5*2 + (None) = 1.0; sample 2: 0.5*3 + 2*3 = 7.5
    torch.testing.assert_close(out.scores, f64([2.5, 1.0, 7.5]), rtol=0, atol=1e-6)
    assert out.scores.dtype == torch.float64 and out.scores.shape == (3,)
    assert out.per_function["length_fn"].dtype == torch.float64
    torch.testing.assert_close(out.per_function["length_fn"], f64([1.0, 2.0, 3.0]))
    pf = out.per_function["half_none"]
    assert pf[0] == 1.0 and math.isnan(pf[1]) and pf[2] == 3.0


def test_metrics_per_function():
    out = score([length_fn, half_none], PROMPTS, COMPLETIONS)
    m = out.metrics
    assert m["reward/length_fn/mean"] == pytest.approx(2.0)
    assert m["reward/length_fn/std"] == pytest.approx(math.sqrt(2 / 3))  # population std of 1, 2, 3
    assert m["reward/length_fn/none_frac"] == 0.0
    assert m["reward/half_none/mean"] == pytest.approx(2.0)  # over the non-None values 1 and 3
    assert m["reward/half_none/std"] == pytest.approx(1.0)
    assert m["reward/half_none/none_frac"] == pytest.approx(1 / 3)
    assert m["reward/half_none/errors"] == 0.0
    # totals 2, 2, 6
    assert m["reward/mean"] == pytest.approx(10 / 3)
    assert m["reward/all_none_frac"] == 0.0
    assert m["reward/length_fn/seconds"] >= 0.0


def test_all_none_sample_is_zero_by_default_and_error_on_request():
    def none_on_first(prompts, completions, **kwargs):
        return [None, 1.0, 1.0]

    def none_on_first_too(prompts, completions, **kwargs):
        return [None, 2.0, None]

    out = score([none_on_first, none_on_first_too], PROMPTS, COMPLETIONS)
    torch.testing.assert_close(out.scores, f64([0.0, 3.0, 1.0]))
    assert out.metrics["reward/all_none_frac"] == pytest.approx(1 / 3)
    with pytest.raises(RewardError, match=r"every reward function returned None for samples \[0\]"):
        score([none_on_first, none_on_first_too], PROMPTS, COMPLETIONS, all_none="error")


def test_all_none_function_metrics_are_nan():
    out = score([length_fn, all_none_fn], PROMPTS, COMPLETIONS)
    assert math.isnan(out.metrics["reward/all_none_fn/mean"])
    assert out.metrics["reward/all_none_fn/none_frac"] == 1.0
    torch.testing.assert_close(out.scores, f64([1.0, 2.0, 3.0]))


def test_columns_and_extras_are_passed_aligned():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(kwargs, prompts=prompts, completions=completions)
        return [1.0] * len(completions)

    score(
        [spy], PROMPTS, COMPLETIONS, {"answer": ["x", "y", "z"]},
        completion_ids=[[5], [6, 6], [7, 7, 7]], finished=[True, False, True],
    )
    assert seen["answer"] == ["x", "y", "z"]
    assert seen["completion_ids"] == [[5], [6, 6], [7, 7, 7]]
    assert seen["finished"] == [True, False, True]
    assert seen["prompts"] == PROMPTS and seen["completions"] == COMPLETIONS


def test_a_function_mutating_its_inputs_does_not_affect_the_next():
    def mutator(prompts, completions, **kwargs):
        completions.clear()
        kwargs["answer"][0] = "changed"
        return [0.0, 0.0, 0.0]

    def checker(prompts, completions, **kwargs):
        return [1.0 if kwargs["answer"][0] == "x" and len(completions) == 3 else -1.0] * 3

    out = score([mutator, checker], PROMPTS, COMPLETIONS, {"answer": ["x", "y", "z"]})
    assert out.per_function["checker"].tolist() == [1.0, 1.0, 1.0]


def test_wrong_count_error_names_function_and_counts():
    def two(prompts, completions, **kwargs):
        return [1.0, 1.0]

    with pytest.raises(RewardError) as e:
        score([two], PROMPTS, COMPLETIONS)
    assert str(e.value) == "reward function 'two' returned 2 rewards for 3 completions"
    out = score([two, length_fn], PROMPTS, COMPLETIONS, on_error="zero")
    assert out.metrics["reward/two/errors"] == 1.0
    torch.testing.assert_close(out.scores, f64([1.0, 2.0, 3.0]))


def test_failing_function_fail_and_zero_policies():
    def boom(prompts, completions, **kwargs):
        raise KeyError("no column\nsecond line")

    with pytest.raises(RewardError) as e:
        score([length_fn, boom], PROMPTS, COMPLETIONS)
    msg = str(e.value)
    assert "\n" not in msg and "'boom'" in msg and "KeyError" in msg and "no column" in msg

    out = score([length_fn, boom], PROMPTS, COMPLETIONS, weights=[1.0, 5.0], on_error="zero")
    torch.testing.assert_close(out.scores, f64([1.0, 2.0, 3.0]))
    torch.testing.assert_close(out.per_function["boom"], f64([0.0, 0.0, 0.0]))
    assert out.metrics["reward/boom/errors"] == 1.0 and out.metrics["reward/boom/failed_frac"] == 1.0
    assert out.metrics["reward/length_fn/errors"] == 0.0 and out.metrics["reward/length_fn/failed_frac"] == 0.0


def test_async_functions_run_concurrently():
    async def slow_a(prompts, completions, **kwargs):
        await asyncio.sleep(0.4)
        return [1.0] * len(completions)

    async def slow_b(prompts, completions, **kwargs):
        await asyncio.sleep(0.4)
        return [2.0] * len(completions)

    t0 = time.perf_counter()
    out = score([slow_a, slow_b, length_fn], PROMPTS, COMPLETIONS)
    elapsed = time.perf_counter() - t0
    torch.testing.assert_close(out.scores, f64([4.0, 5.0, 6.0]))
    assert elapsed < 0.75, f"two 0.4 s async functions took {elapsed:.2f}s: not concurrent"


def test_async_callable_object():
    class Scorer:
        name = "obj"

        async def __call__(self, prompts, completions, **kwargs):
            return [0.5] * len(completions)

    out = score([Scorer()], PROMPTS, COMPLETIONS)
    assert out.per_function["obj"].tolist() == [0.5, 0.5, 0.5]


def test_slow_sync_function_hits_timeout():
    release = threading.Event()

    def stuck(prompts, completions, **kwargs):
        release.wait(5.0)  # stands for a function that never returns
        return [1.0] * len(completions)

    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"'stuck' failed: TimeoutError: timed out after 0.2s"):
        score([stuck], PROMPTS, COMPLETIONS, timeout=0.2)
    assert time.perf_counter() - t0 < 1.5
    out = score([stuck, length_fn], PROMPTS, COMPLETIONS, timeout=0.2, on_error="zero")
    assert out.metrics["reward/stuck/errors"] == 1.0
    torch.testing.assert_close(out.scores, f64([1.0, 2.0, 3.0]))
    release.set()


def test_slow_async_function_hits_timeout():
    async def slow(prompts, completions, **kwargs):
        await asyncio.sleep(5.0)
        return [1.0] * len(completions)

    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"'slow' failed: TimeoutError"):
        score([slow], PROMPTS, COMPLETIONS, timeout=0.2)
    assert time.perf_counter() - t0 < 1.5


def test_threaded_sync_functions_share_one_deadline_window():
    def sleepy(prompts, completions, **kwargs):
        time.sleep(0.4)
        return [1.0] * len(completions)

    def sleepy2(prompts, completions, **kwargs):
        time.sleep(0.4)
        return [1.0] * len(completions)

    t0 = time.perf_counter()
    out = score([sleepy, sleepy2], PROMPTS, COMPLETIONS, timeout=2.0)
    assert time.perf_counter() - t0 < 0.75  # run side by side, not one after the other
    assert out.scores.tolist() == [2.0, 2.0, 2.0]
    assert 0.35 < out.metrics["reward/sleepy/seconds"] < 1.0


def test_score_inside_a_running_event_loop():
    async def a(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    async def main():
        return score([a], PROMPTS, COMPLETIONS)

    assert asyncio.run(main()).scores.tolist() == [1.0, 1.0, 1.0]


def test_reward_set_weights_and_names():
    rs = RewardSet.of([length_fn, WeightedReward(half_none, 3.0, "half")])
    assert rs.names == ["length_fn", "half"]
    assert [r.weight for r in rs.rewards] == [1.0, 3.0]
    out = score(rs, PROMPTS, COMPLETIONS)
    torch.testing.assert_close(out.scores, f64([4.0, 2.0, 12.0]))
    with pytest.raises(ValueError, match="duplicate reward name 'length_fn'"):
        RewardSet.of([length_fn, length_fn])
    with pytest.raises(ValueError, match="got 1 weights for 2 reward functions"):
        RewardSet.of([length_fn, half_none], weights=[1.0])
    with pytest.raises(ValueError, match="weight: must be a finite number"):
        WeightedReward(length_fn, float("nan"))


def test_input_validation_errors():
    with pytest.raises(ValueError, match="prompts: got 2 prompts for 3 completions"):
        score([length_fn], PROMPTS[:2], COMPLETIONS)
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 3 completions"):
        score([length_fn], PROMPTS, COMPLETIONS, {"answer": ["x"]})
    with pytest.raises(ValueError, match="may not be named 'prompts'"):
        score([length_fn], PROMPTS, COMPLETIONS, {"prompts": PROMPTS})
    with pytest.raises(ValueError, match="on_error: expected 'fail' or 'zero'"):
        score([length_fn], PROMPTS, COMPLETIONS, on_error="ignore")
    with pytest.raises(ValueError, match="timeout: must be a positive"):
        score([length_fn], PROMPTS, COMPLETIONS, timeout=0)


def test_sync_wrapper_returning_a_coroutine_is_awaited():
    async def inner(prompts, completions, **kwargs):
        return [7.0] * len(completions)

    def wrapper(prompts, completions, **kwargs):  # looks sync, returns a coroutine
        return inner(prompts, completions, **kwargs)

    assert score([wrapper], PROMPTS, COMPLETIONS).scores.tolist() == [7.0, 7.0, 7.0]
    assert score([wrapper], PROMPTS, COMPLETIONS, timeout=5.0).scores.tolist() == [7.0, 7.0, 7.0]


@settings(max_examples=50, deadline=None)
@given(
    table=st.lists(
        st.lists(st.one_of(st.none(), st.floats(-10, 10)), min_size=4, max_size=4), min_size=1, max_size=4
    ),
    data=st.data(),
)
def test_total_is_the_weighted_sum_over_applicable_functions(table, data):
    weights = data.draw(st.lists(st.floats(-3, 3), min_size=len(table), max_size=len(table)))
    fns = []
    for k, column in enumerate(table):
        def fn(prompts, completions, _column=column, **kwargs):
            return list(_column)

        fns.append(WeightedReward(fn, weights[k], f"f{k}"))
    out = score(fns, ["p"] * 4, ["c"] * 4)
    for i in range(4):
        expected = sum(w * col[i] for w, col in zip(weights, table, strict=True) if col[i] is not None)
        assert out.scores[i].item() == pytest.approx(expected, abs=1e-4)
    all_none = sum(all(col[i] is None for col in table) for i in range(4)) / 4
    assert out.metrics["reward/all_none_frac"] == pytest.approx(all_none)


# ---------------------------------------------------------------- what a reward function may return

MODES = ["sync", "threaded", "async"]  # in the calling thread, in a thread (timeout=), on an event loop


def make_fn(mode, body, name="f"):
    """A reward function called `name` returning body(completions), run the way `mode` says."""
    if mode == "async":
        async def fn(prompts, completions, **kwargs):
            await asyncio.sleep(0)
            return body(completions)
    else:
        def fn(prompts, completions, **kwargs):
            return body(completions)
    return WeightedReward(fn, 1.0, name)


def run(mode, fns, **kwargs):
    return score(fns, PROMPTS, COMPLETIONS, timeout=5.0 if mode == "threaded" else None, **kwargs)


BAD_RETURNS = {
    "inf": ([1.0, math.inf, 1.0], r"returned inf for completion 1 \(expected a finite number or None\)"),
    "-inf": ([1.0, 1.0, -math.inf], r"returned -inf for completion 2 \(expected a finite number or None\)"),
    "nan": ([math.nan, 1.0, 1.0], r"returned nan for completion 0 \(return None where the reward does not apply\)"),
    "numpy nan": ([1.0, np.float32("nan"), 1.0], r"returned np.float32\(nan\) for completion 1 \(return None where"),
    "tensor nan": (torch.tensor([1.0, 2.0, math.nan]), r"returned nan for completion 2 \(return None where"),
    "0-d tensor inf": ([torch.tensor(math.inf), 1.0, 1.0], r"returned inf for completion 0 \(expected a finite"),
    "int beyond float64": ([10**400, 1, 1], r"returned 1000000000000000000000000000000000000\.\.\. for completion 0 "
                           r"\(expected a finite number or None\)"),
    "dict": ({0: 1.0, 1: 1.0, 2: 1.0}, r"returned a dict \(\{0: 1.0, 1: 1.0, 2: 1.0\}\) \(expected a list of 3 rewards, "
             r"one per completion\)"),
    "set": ({1.0, 2.0, 3.0}, r"returned a set \(\{1.0, 2.0, 3.0\}\) \(expected a list of 3 rewards"),
    "str": ("abc", r"returned a str \('abc'\) \(expected a list of 3 rewards"),
    "generator": (lambda: (x for x in [1.0, 2.0, 3.0]), r"returned a generator \(<generator object .*\) \(expected a list"),
    "None": (None, r"returned a NoneType \(None\) \(expected a list of 3 rewards"),
    "2-D array": (np.ones((3, 1)), r"returned a 2-D ndarray of shape \(3, 1\) \(expected a list of 3 rewards"),
    "2-D tensor": (torch.ones(3, 1), r"returned a 2-D Tensor of shape \(3, 1\)"),
    "0-d tensor": (torch.tensor(1.0), r"returned a 0-D Tensor of shape \(\)"),
    "str element": ([1.0, "2", 3.0], r"returned a str \('2'\) for completion 1 \(expected a finite number or None\)"),
    "bool": ([True, False, True], r"returned a bool \(True\) for completion 0 \(expected a finite number or None; "
             r"convert with float\(\)\)"),
    "numpy bool": ([1.0, np.bool_(False), 1.0], r"returned a bool \(np.False_\) for completion 1 .*convert with float\(\)\)"),
    "bool tensor": (torch.tensor([True, False, True]), r"returned a bool \(True\) for completion 0 .*convert with float\(\)"),
    "complex": ([1.0, 1.0, 1 + 2j], r"returned a complex \(\(1\+2j\)\) for completion 2 \(expected a finite number or None\)"),
    "complex array": (np.array([1j, 1, 1]), r"returned a complex \(1j\) for completion 0"),
    "Decimal": ([Decimal("0.5"), 1.0, 1.0], r"returned a Decimal \(Decimal\('0.5'\)\) for completion 0"),
    "nested list": ([[1.0], [2.0], [3.0]], r"returned a list \(\[1.0\]\) for completion 0"),
    "long str element": ([1.0, 1.0, "x" * 100], r"returned a str \('x{36}\.\.\.\) for completion 2"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(BAD_RETURNS))
def test_a_value_that_is_not_a_finite_real_number_is_that_functions_failure(case, mode):
    value, message = BAD_RETURNS[case]
    fn = make_fn(mode, lambda c: value() if callable(value) else value)
    with pytest.raises(RewardError) as e:
        run(mode, [fn, length_fn])
    msg = str(e.value)
    assert re.fullmatch(r"reward function 'f' " + message + r"[^\n]*", msg), msg
    assert "\n" not in msg and len(msg) < 200

    out = run(mode, [fn, length_fn], on_error="zero")  # the function is zeroed, counted, and its message kept
    assert out.metrics["reward/f/errors"] == 1.0 and out.metrics["reward/length_fn/errors"] == 0.0
    assert out.scores.tolist() == [1.0, 2.0, 3.0]
    assert out.per_function["f"].tolist() == [0.0, 0.0, 0.0]
    assert out.errors == {"f": msg}


def test_large_finite_and_numeric_values_are_kept_exactly():
    def big(prompts, completions, **kwargs):
        return [1e39, -1e300, None]

    def numeric_types(prompts, completions, **kwargs):
        return (np.float32(0.5), np.int64(2), torch.tensor(1.25))

    def fraction(prompts, completions, **kwargs):
        return np.array([Fraction(1, 4), 7, 10**20], dtype=object)

    out = score([big, numeric_types, fraction], PROMPTS, COMPLETIONS)
    assert out.per_function["big"][:2].tolist() == [1e39, -1e300]  # 1e39 is inf in float32
    assert math.isnan(out.per_function["big"][2])
    assert out.per_function["numeric_types"].tolist() == [0.5, 2.0, 1.25]
    assert out.per_function["fraction"].tolist() == [0.25, 7.0, 1e20]
    assert out.scores.tolist() == [1e39, -1e300, 1.25 + 1e20]
    assert all(isinstance(v, float) for v in out.metrics.values())
    assert out.metrics["reward/big/mean"] == pytest.approx((1e39 - 1e300) / 2)


@pytest.mark.parametrize("returned", [torch.tensor([1.0, 0.0, 2.0], dtype=torch.bfloat16), np.array([1, 0, 2])])
def test_one_dimensional_tensors_and_arrays_are_accepted(returned):
    out = score([lambda prompts, completions, **kw: returned], PROMPTS, COMPLETIONS)
    assert out.scores.tolist() == [1.0, 0.0, 2.0]


def test_a_weighted_total_beyond_float64_is_an_error():
    def huge(prompts, completions, **kwargs):
        return [1.0, 1e308, 1.0]

    with pytest.raises(RewardError, match=r"^the weighted total reward of completion 1 overflows float64 .*'huge': 1e\+308"):
        score([huge], PROMPTS, COMPLETIONS, weights=[10.0])
    assert score([huge], PROMPTS, COMPLETIONS).scores[1].item() == 1e308


# ---------------------------------------------------------------- a reward function cannot end the run


class _RealExit(BaseException):
    """What the stand-in for the real os._exit raises: a test seeing it means the guard let os._exit through."""


@pytest.fixture
def fake_os_exit(monkeypatch):
    """Replace the real os._exit first, so that a broken guard fails the test instead of ending pytest."""
    def real_exit(code):
        raise _RealExit(code)

    monkeypatch.setattr(os, "_exit", real_exit)
    return real_exit


EXITS = {
    "sys.exit(0)": lambda: sys.exit(0),
    "sys.exit(3)": lambda: sys.exit(3),
    "sys.exit()": lambda: sys.exit(),
    "sys.exit('bye')": lambda: sys.exit("bye"),
    "os._exit(0)": lambda: os._exit(0),
    "os._exit(1)": lambda: os._exit(1),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", list(EXITS))
def test_sys_exit_and_os_exit_in_a_reward_are_its_failure(call, mode, fake_os_exit):
    fn = make_fn(mode, lambda c: EXITS[call]())
    with pytest.raises(RewardError) as e:
        run(mode, [fn, length_fn])
    assert str(e.value) == f"reward function 'f' called {call}"
    assert isinstance(e.value.__cause__, SystemExit)  # the traceback still shows where it was called
    assert os._exit is fake_os_exit

    out = run(mode, [fn, length_fn], on_error="zero")
    assert out.metrics["reward/f/errors"] == 1.0 and out.errors == {"f": f"reward function 'f' called {call}"}
    assert out.scores.tolist() == [1.0, 2.0, 3.0]
    assert os._exit is fake_os_exit  # restored


def test_sys_exit_in_a_task_an_async_reward_started():
    async def spawner(prompts, completions, **kwargs):
        async def bye():
            sys.exit(2)

        await asyncio.get_running_loop().create_task(bye())  # asyncio re-raises it out of the event loop
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"async reward function of \['spawner'\] called sys.exit\(2\) in a task"):
        score([spawner, length_fn], PROMPTS, COMPLETIONS)
    out = score([spawner, length_fn], PROMPTS, COMPLETIONS, on_error="zero")
    assert out.metrics["reward/spawner/errors"] == 1.0 and out.scores.tolist() == [1.0, 2.0, 3.0]


class _AbandonStep(BaseException):
    """Stands for the trainer's private BaseException, raised by its signal handler to abandon a step."""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, _AbandonStep])
def test_keyboard_interrupt_and_other_base_exceptions_propagate(exc, mode, fake_os_exit):
    def body(completions):
        raise exc()

    with pytest.raises(exc):
        run(mode, [make_fn(mode, body), length_fn], on_error="zero")
    assert os._exit is fake_os_exit


def test_os_exit_is_restored_after_nested_and_concurrent_calls(fake_os_exit):
    guarded = []

    def outer(prompts, completions, **kwargs):
        score([length_fn], prompts, completions)
        guarded.append(os._exit is not fake_os_exit)  # the inner call's exit does not unguard the outer
        return [1.0] * len(completions)

    assert score([outer], PROMPTS, COMPLETIONS).scores.tolist() == [1.0, 1.0, 1.0]
    assert guarded == [True] and os._exit is fake_os_exit

    b_running, a_done = threading.Event(), threading.Event()

    def first(prompts, completions, **kwargs):
        assert b_running.wait(5)
        return [1.0] * len(completions)

    def second(prompts, completions, **kwargs):
        b_running.set()
        assert a_done.wait(5)
        guarded.append(os._exit is not fake_os_exit)  # A finished first: B is still guarded
        return [1.0] * len(completions)

    def call_a():
        score([first], PROMPTS, COMPLETIONS)
        a_done.set()

    threads = [threading.Thread(target=call_a), threading.Thread(target=score, args=([second], PROMPTS, COMPLETIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert guarded == [True, True] and os._exit is fake_os_exit


EXIT_SCRIPT = """
import multiprocessing, os
from lmrl.rewards import score

def bye(prompts, completions, **kwargs):
    os._exit(0)

def ok(prompts, completions, **kwargs):
    return [1.0] * len(completions)

out = score([bye, ok], ["p"], ["c"], on_error="zero")
print("survived", out.metrics["reward/bye/errors"], out.scores.tolist(), flush=True)

def forks(prompts, completions, **kwargs):  # multiprocessing ends a forked child with os._exit
    child = multiprocessing.get_context("fork").Process(target=print, args=("child",))
    child.start()
    child.join(10)
    return [float(child.exitcode)]

print("fork exit code", score([forks], ["p"], ["c"]).scores.tolist(), flush=True)

# the trainer's deliberate exit (a second Ctrl-C) uses the os._exit it kept at import: it ends the process,
# even inside score()
from lmrl.lifecycle import _EXIT_NOW
score([lambda prompts, completions, **kwargs: _EXIT_NOW(7)], ["p"], ["c"])
print("not reached")
"""


def test_os_exit_in_a_real_process_is_survived_and_lmrl_exits_still_exit():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.stdout.splitlines() == ["survived 1.0 [1.0]", "child", "fork exit code [0.0]"], proc.stderr
    assert proc.returncode == 7, proc.stderr


def test_async_failure_has_no_unrelated_event_loop_context():
    async def broken(prompts, completions, **kwargs):
        raise ValueError("bad column")

    with pytest.raises(RewardError, match=r"^reward function 'broken' failed: ValueError: bad column$") as e:
        score([broken], PROMPTS, COMPLETIONS)
    chain, stack = [], [e.value]
    while stack:
        err = stack.pop()
        if err is not None and all(err is not c for c in chain):
            chain.append(err)
            stack += [err.__cause__, err.__context__]
    assert any(isinstance(err, ValueError) and str(err) == "bad column" for err in chain)
    assert not any("no running event loop" in str(err) for err in chain), [repr(err) for err in chain]


# ---------------------------------------------------------------- required_columns


def test_required_columns_reads_signatures():
    def needs(prompts, completions, answer, *, level, hint=None, completion_ids, finished, **kwargs):
        return [1.0] * len(completions)

    def other_names(p, c, answer, prompts=None):  # the first two positional parameters take prompts, completions
        return [1.0] * len(c)

    def prefix(scale, prompts, completions, answer, style):
        return [scale] * len(completions)

    class Judge:
        def __call__(self, prompts, completions, reference):
            return [1.0] * len(completions)

    fns = [
        needs,
        other_names,
        WeightedReward(functools.partial(prefix, 2.0, style="short"), 1.0, "prefix"),  # bound: scale, style
        WeightedReward(functools.partial(needs, level=3), 1.0, "needs_level_bound"),
        WeightedReward(Judge(), 1.0, "judge"),
        length_fn,
    ]
    assert required_columns(fns) == {
        "answer": ["needs", "other_names", "prefix", "needs_level_bound"],
        "level": ["needs"],
        "reference": ["judge"],
    }
    assert required_columns(RewardSet.of([length_fn])) == {}
    assert required_columns(length_fn) == {}


def test_required_columns_of_builtin_verifiers():
    fns = [
        math_reward("solution", isolate=False),
        math_reward(isolate=False, name="math_default"),  # tries answer, then solution: neither is required
        exact_match_reward(column="label"),
        format_reward(),
        WeightedReward(RemoteScorer("http://127.0.0.1:1/score"), 1.0, "remote"),
    ]
    assert required_columns(fns) == {"solution": ["math"], "label": ["exact_match"]}


def test_a_function_can_fail_one_completion_and_keep_the_others():
    from lmrl.rewards import Failed, RewardRecipes

    def picky(completions, **kw):  # a judge that could not read completion "?"
        return [Failed(f"cannot read {c!r}") if c == "?" else float(len(c)) for c in completions]

    out = score([picky], ["p"] * 4, ["ab", "?", "abc", "?"], on_error="zero")
    assert out.scores.tolist() == [2.0, 0.0, 3.0, 0.0] and out.metrics["reward/picky/errors"] == 2.0
    assert out.metrics["reward/picky/failed_frac"] == 0.5  # what guard.max_failed_steps watches
    assert out.errors == {"picky": "reward function 'picky' failed on completion 1: cannot read '?' (and 1 more)"}
    assert out.metrics["reward/picky/mean"] == pytest.approx(5 / 4)  # the failed ones count as the 0 they score
    with pytest.raises(RewardError, match=r"^reward function 'picky' failed on completion 1: cannot read '\?'$"):
        score([picky], ["p"] * 2, ["ab", "?"])
    # with recipes the completion named is the batch's, not the function's own row
    recipes = RewardRecipes({"a": [picky], "b": [lambda completions, **kw: [1.0] * len(completions)]}, column="kind")
    with pytest.raises(RewardError, match=r"failed on completion 2: cannot read"):
        score(recipes, ["p"] * 3, ["ab", "x", "?"], {"kind": ["a", "b", "a"]})
    out = score(recipes, ["p"] * 3, ["ab", "x", "?"], {"kind": ["a", "b", "a"]}, on_error="zero")
    assert out.scores.tolist() == [2.0, 1.0, 0.0] and out.metrics["reward/picky/errors"] == 1.0
    assert out.metrics["reward/picky/failed_frac"] == 0.5  # of the completions it was called on
