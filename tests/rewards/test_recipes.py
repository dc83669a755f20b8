"""Reward recipes (LightRFT's reward_recipe, verl's data_source routing): each row's label picks its reward
functions and weights; each function is called once per batch, with only the rows whose recipe names it."""

from __future__ import annotations

import math

import pytest
import torch

from lmrl.errors import ConfigError
from lmrl.rewards import (
    RewardError,
    RewardRecipes,
    WeightedReward,
    exact_match_reward,
    required_columns,
    reward_recipes_from_config,
    score,
)

NAN = math.nan


class Recorder:
    """A reward function that records each call's arguments and returns the given value per completion."""

    def __init__(self, name, value=lambda c: 1.0):
        self.__name__, self.value, self.calls = name, value, []

    def __call__(self, prompts, completions, **kw):
        self.calls.append({"prompts": prompts, "completions": completions, **kw})
        return [self.value(c) for c in completions]


def assert_nan_equal(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), equal_nan=True, rtol=0, atol=1e-12)


def test_totals_worked_out_by_hand():
    # correct: shared by both recipes, weight 1 in math and 0.5 in code; fmt returns None for "none";
    # length only in code; the default recipe (correct, weight 2) scores a row labelled "physics"
    correct = Recorder("correct", lambda c: float(c.startswith("ok")))
    fmt = Recorder("fmt", lambda c: None if c == "none" else 0.25)
    length = Recorder("length", lambda c: -len(c) / 10)
    recipes = RewardRecipes({
        "math": [correct, WeightedReward(fmt, 0.4)],
        "code": [WeightedReward(correct, 0.5), length],
        "default": [WeightedReward(correct, 2.0)],
    })
    completions = ["ok1", "bad", "none", "ok22", "ok"]
    labels = ["math", "math", "math", "code", "physics"]
    out = score(recipes, ["p"] * 5, completions, {"data_source": labels})
    # row 0: 1*1 + 0.4*0.25 = 1.1; row 1: 0 + 0.1 = 0.1; row 2: 0 + (None left out) = 0
    # row 3: 0.5*1 + 1*(-0.4) = 0.1; row 4 (default): 2*1 = 2
    assert_nan_equal(out.scores, [1.1, 0.1, 0.0, 0.1, 2.0])
    assert_nan_equal(out.per_function["correct"], [1.0, 0.0, 0.0, 1.0, 1.0])
    assert_nan_equal(out.per_function["fmt"], [0.25, 0.25, NAN, NAN, NAN])
    assert_nan_equal(out.per_function["length"], [NAN, NAN, NAN, -0.4, NAN])
    m = out.metrics
    assert m["reward/recipe/math/frac"] == pytest.approx(0.6) and m["reward/recipe/math/mean"] == pytest.approx(0.4)
    assert m["reward/recipe/code/frac"] == pytest.approx(0.2) and m["reward/recipe/code/mean"] == pytest.approx(0.1)
    assert m["reward/recipe/default/frac"] == pytest.approx(0.2) and m["reward/recipe/default/mean"] == pytest.approx(2.0)
    # per-function metrics are over the rows the function scored
    assert m["reward/fmt/mean"] == pytest.approx(0.25) and m["reward/fmt/none_frac"] == pytest.approx(1 / 3)
    assert m["reward/length/mean"] == pytest.approx(-0.4) and m["reward/length/none_frac"] == 0.0
    assert m["reward/correct/mean"] == pytest.approx(0.6)
    assert m["reward/mean"] == pytest.approx(sum([1.1, 0.1, 0.0, 0.1, 2.0]) / 5)
    assert m["reward/all_none_frac"] == 0.0  # row 2: correct applied (0.0), fmt did not
    assert recipes.names == ["correct", "fmt", "length"]


def test_each_function_is_called_once_with_exactly_its_rows():
    a, b = Recorder("a"), Recorder("b")
    recipes = RewardRecipes({"x": [a], "y": [a, b]}, column="label")
    completions = ["c0", "c1", "c2", "c3"]
    score(recipes, ["p0", "p1", "p2", "p3"], completions, {"label": ["y", "x", "x", "y"], "answer": ["0", "1", "2", "3"]},
          completion_ids=[[0], [1], [2], [3]], finished=[True, False, True, False])
    assert len(a.calls) == 1 and len(b.calls) == 1
    assert a.calls[0]["completions"] == completions and a.calls[0]["answer"] == ["0", "1", "2", "3"]
    got = b.calls[0]
    assert got["prompts"] == ["p0", "p3"] and got["completions"] == ["c0", "c3"]
    assert got["answer"] == ["0", "3"] and got["label"] == ["y", "y"]
    assert got["completion_ids"] == [[0], [3]] and got["finished"] == [True, False]


def test_a_recipe_without_rows_in_the_batch_calls_nothing():
    a, b = Recorder("a"), Recorder("b")
    out = score(RewardRecipes({"x": [a], "y": [b]}), ["p", "p"], ["c", "c"], {"data_source": ["x", "x"]})
    assert b.calls == [] and len(a.calls) == 1
    assert_nan_equal(out.per_function["b"], [NAN, NAN])
    assert out.metrics["reward/recipe/y/frac"] == 0.0 and "reward/recipe/y/mean" not in out.metrics
    assert "reward/b/mean" not in out.metrics  # no rows scored: no metrics of it


def test_a_label_without_a_recipe_and_a_missing_column_are_one_line_errors():
    recipes = RewardRecipes({"math": [Recorder("a")], "code": [Recorder("b")]})
    with pytest.raises(ValueError, match=r"^columns: completion 1: data_source 'physics' has no reward.recipes entry "
                                         r"\(recipes: math, code\)$"):
        score(recipes, ["p", "p"], ["c", "c"], {"data_source": ["math", "physics"]})
    with pytest.raises(ValueError, match=r"^columns: no column 'data_source', which picks each completion's reward recipe$"):
        score(recipes, ["p"], ["c"], {"label": ["math"]})
    with pytest.raises(ValueError, match="weights: give weights inside the RewardRecipes"):
        score(recipes, ["p"], ["c"], {"data_source": ["math"]}, weights=[1.0])


def test_the_same_function_in_two_recipes_is_one_and_two_under_one_name_are_an_error():
    shared = Recorder("shared")
    recipes = RewardRecipes({"x": [shared], "y": [WeightedReward(shared, 3.0)]})
    assert recipes.names == ["shared"]
    with pytest.raises(ValueError, match=r"^recipes: recipes 'x' and 'y' hold two different reward functions named "
                                         r"'f'; give them distinct names \(name: in a config entry, name= in Python\)$"):
        RewardRecipes({"x": [Recorder("f")], "y": [Recorder("f")]})
    ok = RewardRecipes({"x": [Recorder("f")], "y": [WeightedReward(Recorder("f"), name="f2")]})
    assert ok.names == ["f", "f2"]


def test_log_extra_of_a_subset_is_scattered_back():
    def gold(completions, answer, log_extra, **kw):
        log_extra("gold", answer)
        return [1.0] * len(completions)

    def other(completions, log_extra, **kw):
        log_extra("gold", ["o"] * len(completions))  # the same column from the other recipe's rows
        log_extra("only_b", ["b"] * len(completions))
        return [0.0] * len(completions)

    out = score(RewardRecipes({"a": [gold], "b": [other]}), ["p"] * 4, ["c"] * 4,
                {"data_source": ["a", "b", "a", "b"], "answer": ["0", "1", "2", "3"]})
    assert out.extra_columns == {"gold": ["0", "o", "2", "o"], "only_b": [None, "b", None, "b"]}

    def wrong(completions, log_extra, **kw):
        log_extra("n", [1, 2, 3])  # 3 values for the function's 2 rows
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"log_extra\('n', \.\.\.\): expected 2 values, one per completion"):
        score(RewardRecipes({"a": [wrong], "b": [gold]}), ["p"] * 3, ["c"] * 3,
              {"data_source": ["a", "b", "a"], "answer": ["0", "1", "2"]})


def test_failures_inside_a_subset_name_the_batch_index_and_on_error_zero_zeroes_only_those_rows():
    def boom(completions, **kw):
        raise RuntimeError("no")

    ok = Recorder("ok", lambda c: 0.5)
    recipes = RewardRecipes({"a": [WeightedReward(boom, 2.0)], "b": [ok]})
    columns = {"data_source": ["b", "a", "b", "a"]}
    out = score(recipes, ["p"] * 4, ["c"] * 4, columns, on_error="zero")
    assert_nan_equal(out.per_function["boom"], [NAN, 0.0, NAN, 0.0])
    assert_nan_equal(out.scores, [0.5, 0.0, 0.5, 0.0])
    assert out.metrics["reward/boom/errors"] == 1.0 and out.metrics["reward/ok/errors"] == 0.0
    assert out.errors == {"boom": "reward function 'boom' failed: RuntimeError: no"}
    with pytest.raises(RewardError, match="^reward function 'boom' failed: RuntimeError: no$"):
        score(recipes, ["p"] * 4, ["c"] * 4, columns)

    def inf_on_second(completions, **kw):
        return [1.0, math.inf][: len(completions)]

    with pytest.raises(RewardError, match=r"^reward function 'inf_on_second' returned inf for completion 3 "):
        score(RewardRecipes({"a": [inf_on_second], "b": [ok]}), ["p"] * 4, ["c"] * 4, columns)

    def too_many(completions, **kw):
        return [1.0] * 4

    with pytest.raises(RewardError, match=r"^reward function 'too_many' returned 4 rewards for 2 completions$"):
        score(RewardRecipes({"a": [too_many], "b": [ok]}), ["p"] * 4, ["c"] * 4, columns)


def test_all_none_is_per_row_over_its_own_recipe():
    none = Recorder("none", lambda c: None)
    recipes = RewardRecipes({"a": [none], "b": [Recorder("one")]})
    out = score(recipes, ["p"] * 3, ["c"] * 3, {"data_source": ["a", "b", "a"]})
    assert_nan_equal(out.scores, [0.0, 1.0, 0.0])
    assert out.metrics["reward/all_none_frac"] == pytest.approx(2 / 3)
    with pytest.raises(RewardError, match=r"every reward function returned None for samples \[0, 2\]"):
        score(recipes, ["p"] * 3, ["c"] * 3, {"data_source": ["a", "b", "a"]}, all_none="error")


def test_async_and_threaded_functions_get_their_own_rows():
    async def slow_async(completions, **kw):
        return [float(len(c)) for c in completions]

    sync = Recorder("sync", lambda c: 10.0)
    recipes = RewardRecipes({"a": [slow_async], "b": [sync]})
    out = score(recipes, ["p"] * 3, ["x", "yy", "zzz"], {"data_source": ["a", "b", "a"]}, timeout=30)
    assert_nan_equal(out.scores, [1.0, 10.0, 3.0])
    assert sync.calls[0]["completions"] == ["yy"]


def test_row_columns_ask_only_for_the_columns_of_the_rows_recipe():
    recipes = RewardRecipes({"math": [exact_match_reward(column="answer")],
                             "code": [WeightedReward(exact_match_reward(column="tests"), name="tests_pass")]},
                            column="label")
    assert recipes.row_columns({"prompt": "q", "label": "math"}) == {"answer": ["exact_match"]}
    assert recipes.row_columns({"prompt": "q", "label": "code"}) == {"tests": ["tests_pass"]}
    assert recipes.row_columns({"prompt": "q", "label": "chat"}) == (
        "label 'chat' has no reward.recipes entry (recipes: math, code)")
    assert recipes.row_columns({"prompt": "q"}) == (
        "column 'label' (reward.recipe_column: it picks the row's reward recipe) is missing")
    assert recipes.row_columns({"prompt": "q", "label": None}).endswith(" is None")
    assert required_columns(recipes) == {"answer": ["exact_match"], "tests": ["tests_pass"]}


def test_recipes_from_config_share_equal_entries_and_name_the_bad_one():
    recipes = reward_recipes_from_config({
        "math": ["exact_match", {"fn": "regex", "pattern": "^ok", "weight": 0.2}],
        "code": [{"fn": "exact_match", "weight": 0.5}],
    }, column="label")
    assert recipes.column == "label" and recipes.names == ["exact_match", "regex"]
    assert recipes.recipes["math"].rewards[0].fn is recipes.recipes["code"].rewards[0].fn  # one function
    assert [r.weight for r in recipes.recipes["code"].rewards] == [0.5]
    with pytest.raises(ConfigError, match=r"^reward.recipes: recipes 'math' and 'code' hold two different reward "
                                          r"functions named 'exact_match'; give them distinct names \(name: in a config entry, name= in Python\)$"):
        reward_recipes_from_config({"math": ["exact_match"], "code": [{"fn": "exact_match", "column": "tests"}]})
    with pytest.raises(ConfigError, match=r"^reward.recipes.code\[1\]: reward spec 'exact': expected a built-in name"):
        reward_recipes_from_config({"math": ["exact_match"], "code": ["exact_match", "exact"]})
    with pytest.raises(ConfigError, match=r"^reward.recipes.math\[0\].weight: expected a finite number"):
        reward_recipes_from_config({"math": [{"fn": "exact_match", "weight": "x"}]})


# ----------------------------------------------------------------------------------------- in training

def _mixed_rows(n: int = 16) -> list[dict]:
    """The shipped task's prompts, half labelled "sum" (scored by exact match), half "style" (by a regex)."""
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "data_source": "sum" if i % 2 else "style"} for i in range(n)]


def test_the_cli_trains_with_a_recipe_per_data_source(tmp_path):
    import json

    from tests.forked import lmrl

    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _mixed_rows()))
    run = lmrl("train", "data.path=mixed.jsonl", "train.output_dir=out",
               "reward.recipes={sum: [exact_match], style: [{fn: regex, pattern: '^[0-9]+', weight: 0.5}]}",
               "reward.clip=[-1, 1]", "train.steps=2", "rollout.prompts_per_step=8", "rollout.group_size=2",
               "data.num_eval_prompts=0", "log.console=false", cwd=tmp_path, timeout=300)  # a process of its own
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward/recipe/sum/frac" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["reward/recipe/sum/frac"] + m["reward/recipe/style/frac"] == pytest.approx(1.0)
        assert "reward/exact_match/mean" in m and "reward/regex/mean" in m
    assert any("reward/recipe/sum/mean" in m for m in steps) and any("reward/recipe/style/mean" in m for m in steps)
    saved = (tmp_path / "out" / "lmrl_config.yaml").read_text()
    assert "recipes:" in saved and "recipe_column: data_source" in saved


def test_a_row_without_a_recipe_stops_the_trainer_before_the_model_loads(tmp_path):
    from lmrl import Config, Trainer
    from lmrl.errors import DataError

    rows = _mixed_rows()
    rows[12]["data_source"] = "physics"
    del rows[13]["data_source"]
    cfg = Config(train={"steps": 1, "output_dir": str(tmp_path / "run")}, log={"console": False},
                 data={"num_eval_prompts": 0}, rollout={"prompts_per_step": 4, "group_size": 2})
    recipes = RewardRecipes({"sum": [exact_match_reward()], "style": [Recorder("style")]})
    with pytest.raises(DataError) as raised:
        Trainer(cfg, reward_funcs=recipes, train_dataset=rows)
    assert str(raised.value) == (
        "train_dataset index 12: data_source 'physics' has no reward.recipes entry (recipes: sum, style) "
        "(1 other bad row: index 13); fix them, or set data.on_bad_row=skip to leave them out")
    assert not (tmp_path / "run").exists()


def test_a_streamed_row_is_checked_against_the_recipes_as_it_is_read():
    from lmrl.data.prompts import PromptStream
    from lmrl.errors import DataError

    rows = _mixed_rows(8) + [{"prompt": "9+9=", "data_source": "chat"}]
    recipes = RewardRecipes({"sum": [exact_match_reward(column="answer")], "style": [Recorder("style")]})
    stream = PromptStream(iter(rows), required_columns=recipes.row_columns, name="train_dataset")
    assert len(stream.peek(4)) == 4  # the first rows are fine
    with pytest.raises(DataError, match=r"^train_dataset row 8: data_source 'chat' has no reward.recipes entry"):
        stream.rows_at(0, 9)
    # a column the recipe needs is asked only of that recipe's rows: "style" rows have no use for answer
    no_answer = [{**r, "answer": None} if r["data_source"] == "style" else r for r in _mixed_rows(8)]
    assert len(PromptStream(iter(no_answer), required_columns=recipes.row_columns).peek(8)) == 8
    bad = [{**r, "answer": None} for r in _mixed_rows(4)]
    with pytest.raises(DataError, match=r"row 1: column 'answer' \(needed by reward 'exact_match'\) is None"):
        PromptStream(iter(bad), required_columns=recipes.row_columns).peek(4)


def test_the_trainer_takes_reward_recipes_and_records_them(tmp_path):
    from lmrl import Config, Trainer

    cfg = Config(train={"steps": 1, "output_dir": str(tmp_path / "run")}, log={"console": False},
                 data={"num_eval_prompts": 0}, rollout={"prompts_per_step": 8, "group_size": 2})
    style = Recorder("style", lambda c: 0.5)
    recipes = RewardRecipes({"sum": [exact_match_reward()], "style": [WeightedReward(style, 2.0)]})
    trainer = Trainer(cfg, reward_funcs=recipes, train_dataset=_mixed_rows())
    assert trainer.cfg.reward.functions == [] and trainer.cfg.reward.recipe_column == "data_source"
    assert trainer.cfg.reward.recipes["style"] == [{"fn": "tests.rewards.test_recipes:Recorder", "weight": 2.0}]
    m = trainer.train().history[0]
    styled = [c["data_source"] for c in style.calls]
    assert len(style.calls) == 1 and set(styled[0]) == {"style"}  # called once per step, on "style" rows only
    assert m["reward/recipe/style/mean"] == pytest.approx(1.0)  # 2.0 x 0.5 on every style row
    assert m["reward/recipe/sum/frac"] + m["reward/recipe/style/frac"] == pytest.approx(1.0)


# ------------------------------------------------------------------ OpenRLHF / LightRFT reward_func(queries, ...)

LIGHTRFT_RM = '''
import json

import torch

def reward_func(queries, prompts, labels):
    with open("calls.jsonl", "a") as f:
        f.write(json.dumps([queries, prompts, labels]) + "\\n")
    return torch.tensor([float(len(q)) for q in queries])

def with_logs(queries, prompts, labels, bonus=0.0):
    return {"rewards": [1.0 + bonus] * len(queries), "scores": [0.0] * len(queries),
            "extra_logs": {"rm/len": torch.tensor([float(len(q)) for q in queries])}}

def no_rewards(queries, prompts, labels):
    return {"scores": [0.0] * len(queries)}
'''


def test_call_queries_calls_a_user_function_as_lightrft_does(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rm.py").write_text(LIGHTRFT_RM)
    recipes = reward_recipes_from_config({
        "a": [{"fn": "my_rm.py:reward_func", "call": "queries"}],
        "b": [{"fn": "my_rm.py:with_logs", "call": "queries", "bonus": 1.0, "weight": 0.5}],
    }, column="label")
    assert recipes.names == ["reward_func", "with_logs"]
    prompts = ["1+1=", [{"role": "user", "content": "hi"}], "2+2="]
    out = score(recipes, prompts, ["2", "hello", "4"], {"label": ["a", "a", "b"]})
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1
    queries, got_prompts, labels = calls[0]
    assert queries == ["1+1=2", "hi\nhello"] and got_prompts == prompts[:2] and labels == ["a", "a"]
    assert_nan_equal(out.scores, [5.0, 8.0, 1.0])  # len("1+1=2"), len("hi\nhello"), 0.5 x (1 + bonus 1)
    assert out.metrics["rm/len"] == 5.0  # extra_logs: len("2+2=4")
    with pytest.raises(RewardError, match=r"^reward function 'no_rewards' failed: ValueError: returned a dict "
                                          r"without 'rewards' \(keys: \['scores'\]\)$"):
        score(reward_recipes_from_config({"a": [{"fn": "my_rm.py:no_rewards", "call": "queries"}]}), ["p"], ["c"],
              {"data_source": ["a"]})
    # in reward.functions, without recipes: labels from the label column when the rows have it, else None
    from lmrl.rewards import reward_set_from_config

    plain = reward_set_from_config([{"fn": "my_rm.py:reward_func", "call": "queries"}], label_column="label")
    score(plain, ["3+3="], ["6"], {"label": ["math"]})
    score(plain, ["3+3="], ["6"], {"answer": ["6"]})
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls[1] == [["3+3=6"], ["3+3="], ["math"]] and calls[2] == [["3+3=6"], ["3+3="], None]
    with pytest.raises(ConfigError, match=r"^reward.recipes.a\[0\].call: expected 'queries' "):
        reward_recipes_from_config({"a": [{"fn": "my_rm.py:reward_func", "call": "kwargs"}]})
    with pytest.raises(ConfigError, match=r"^reward.recipes.a\[0\].call: only for a user function"):
        reward_recipes_from_config({"a": [{"fn": "exact_match", "call": "queries"}]})
