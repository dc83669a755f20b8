"""score(): weights, None handling, sync / async / slow / failing functions, wrong counts, metrics."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.rewards import RewardError, RewardSet, WeightedReward, score

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]


def length_fn(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def half_none(prompts, completions, **kwargs):
    return [1.0, None, 3.0]


def all_none_fn(prompts, completions, **kwargs):
    return [None] * len(completions)


def test_weighted_sum_hand_computed():
    out = score([length_fn, half_none], PROMPTS, COMPLETIONS, weights=[0.5, 2.0])
    # sample 0: 0.5*1 + 2*1 = 2.5; sample 1: 0.5*2 + (None) = 1.0; sample 2: 0.5*3 + 2*3 = 7.5
    torch.testing.assert_close(out.scores, torch.tensor([2.5, 1.0, 7.5]), rtol=0, atol=1e-6)
    assert out.scores.dtype == torch.float32 and out.scores.shape == (3,)
    torch.testing.assert_close(out.per_function["length_fn"], torch.tensor([1.0, 2.0, 3.0]))
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
    torch.testing.assert_close(out.scores, torch.tensor([0.0, 3.0, 1.0]))
    assert out.metrics["reward/all_none_frac"] == pytest.approx(1 / 3)
    with pytest.raises(RewardError, match=r"every reward function returned None for samples \[0\]"):
        score([none_on_first, none_on_first_too], PROMPTS, COMPLETIONS, all_none="error")


def test_all_none_function_metrics_are_nan():
    out = score([length_fn, all_none_fn], PROMPTS, COMPLETIONS)
    assert math.isnan(out.metrics["reward/all_none_fn/mean"])
    assert out.metrics["reward/all_none_fn/none_frac"] == 1.0
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 2.0, 3.0]))


def test_nan_counts_as_none():
    def nan_fn(prompts, completions, **kwargs):
        return [float("nan"), 1.0, 1.0]

    out = score([nan_fn, length_fn], PROMPTS, COMPLETIONS)
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 3.0, 4.0]))
    assert out.metrics["reward/nan_fn/none_frac"] == pytest.approx(1 / 3)


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
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 2.0, 3.0]))


def test_non_numeric_value_is_an_error():
    def strings(prompts, completions, **kwargs):
        return ["good"] * len(completions)

    with pytest.raises(RewardError, match=r"'strings' returned a str .*expected float or None"):
        score([strings], PROMPTS, COMPLETIONS)


def test_failing_function_fail_and_zero_policies():
    def boom(prompts, completions, **kwargs):
        raise KeyError("no column\nsecond line")

    with pytest.raises(RewardError) as e:
        score([length_fn, boom], PROMPTS, COMPLETIONS)
    msg = str(e.value)
    assert "\n" not in msg and "'boom'" in msg and "KeyError" in msg and "no column" in msg

    out = score([length_fn, boom], PROMPTS, COMPLETIONS, weights=[1.0, 5.0], on_error="zero")
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(out.per_function["boom"], torch.zeros(3))
    assert out.metrics["reward/boom/errors"] == 1.0
    assert out.metrics["reward/length_fn/errors"] == 0.0


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
    torch.testing.assert_close(out.scores, torch.tensor([4.0, 5.0, 6.0]))
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
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 2.0, 3.0]))
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
    torch.testing.assert_close(out.scores, torch.tensor([4.0, 2.0, 12.0]))
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


def test_tensor_and_bool_returns_are_accepted():
    def tensor_fn(prompts, completions, **kwargs):
        return torch.tensor([1.0, 0.0, 1.0])

    def bool_fn(prompts, completions, **kwargs):
        return [True, False, True]

    out = score([tensor_fn, bool_fn], PROMPTS, COMPLETIONS)
    assert out.scores.tolist() == [2.0, 0.0, 2.0]


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
