"""Reward functions written as TRL's documentation writes them run unchanged: keywords only, every dataset column,
completion_ids, trainer_state, log_metric and log_extra, chat completions as message lists, sync and async, None
for "not applicable". lmrl's older positional form and its `finished` keep working."""

from __future__ import annotations

import asyncio
import json

import pytest

from lmrl import Config, Trainer
from lmrl.errors import RewardError
from lmrl.rewards import format_reward, math_reward, required_columns, score
from lmrl.rewards.core import TrainerState, call_reward


# the signatures of TRL's documented examples (written here)
def reward_len(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]


def answer_match(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def prompt_echo(prompts, completions, **kwargs):
    return [1.0 if c.startswith(p) else 0.0 for p, c in zip(prompts, completions)]


def chat_len(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


async def async_len(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def only_for_math(completions, task, **kwargs):  # None: not applicable to this sample
    return [1.0 if t == "math" else None for t in task]


def test_trl_signatures_get_keywords_and_columns():
    out = score([reward_len, answer_match, prompt_echo, async_len, only_for_math],
                ["1+1=", "2+2="], ["2", "2+2=5"], {"answer": ["2", "4"], "task": ["math", "code"]})
    assert out.per_function["reward_len"].tolist() == [-19.0, -15.0]
    assert out.per_function["answer_match"].tolist() == [1.0, 0.0]
    assert out.per_function["prompt_echo"].tolist() == [0.0, 1.0]
    assert out.per_function["async_len"].tolist() == [1.0, 5.0]
    assert out.per_function["only_for_math"][0].item() == 1.0 and out.per_function["only_for_math"][1].isnan()
    assert out.scores.tolist() == [-19 + 1 + 0 + 1 + 1, -15 + 0 + 1 + 5]  # None terms left out


def test_every_argument_trl_passes_arrives_by_keyword():
    seen = {}

    def spy(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return [0.0] * len(kwargs["completions"])

    score([spy], ["p1", "p2"], ["c1", "c2"], {"answer": ["a", "b"]}, completion_ids=[[1], [2, 3]],
          finished=[True, False], trainer_state=TrainerState(global_step=7, max_steps=9))
    assert seen["args"] == ()
    kw = seen["kwargs"]
    assert kw["prompts"] == ["p1", "p2"] and kw["completions"] == ["c1", "c2"] and kw["answer"] == ["a", "b"]
    assert kw["completion_ids"] == [[1], [2, 3]] and kw["finished"] == [True, False]
    assert kw["trainer_state"].global_step == 7 and kw["trainer_state"].max_steps == 9
    assert callable(kw["log_metric"]) and callable(kw["log_extra"])


def test_chat_prompts_give_message_list_completions_and_the_verifiers_read_them():
    prompts = [[{"role": "user", "content": "What is 6*7?"}]] * 2
    completions = ["<think>6*7</think><answer>\\boxed{42}</answer>", "42"]
    out = score([chat_len, format_reward(), math_reward(isolate=False)], prompts, completions, {"answer": ["42", "41"]})
    assert out.per_function["chat_len"].tolist() == [float(len(completions[0])), 2.0]
    assert out.per_function["format"].tolist() == [1.0, 0.0]
    assert out.per_function["math"].tolist() == [1.0, 0.0]


def test_log_metric_and_log_extra_reach_the_output():
    def logs(completions, log_metric, log_extra, **kwargs):
        log_metric("my/len", sum(map(len, completions)) / len(completions))
        log_metric("my/len", 10.0)  # logged twice in a step: the mean
        log_extra("golden", ["yes", "no"])
        return [1.0, 0.0]

    out = score([logs], ["p", "q"], ["ab", "abcd"])
    assert out.metrics["my/len"] == pytest.approx((3.0 + 10.0) / 2)
    assert out.extra_columns == {"golden": ["yes", "no"]}


def test_bad_log_calls_are_that_functions_failure():
    def bad(completions, log_extra, **kwargs):
        log_extra("col", ["only one"])
        return [0.0, 0.0]

    with pytest.raises(RewardError, match=r"^reward function 'bad' failed: ValueError: log_extra\('col', \.\.\.\): "
                                          r"expected 2 values, one per completion"):
        score([bad], ["p", "q"], ["a", "b"])


def test_a_function_without_kwargs_gets_only_what_it_names():
    def narrow(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    out = score([narrow], ["p"], ["4"], {"answer": ["4"], "other": ["x"]}, completion_ids=[[1]])
    assert out.scores.tolist() == [1.0]


def test_lmrl_positional_functions_still_work():
    def older(p, c, **kw):
        return [float(len(p[0]) + len(c[0]) + kw["finished"][0])]

    def named(prompts, completions, answer):
        return [float(completions[0] == answer[0])]

    out = score([older, named], ["ab"], ["c"], {"answer": ["c"]}, finished=[True])
    assert out.scores.tolist() == [4.0 + 1.0]
    assert call_reward(lambda a, b: [a, b], ["p"], ["c"], {}) == [["p"], ["c"]]


def test_required_columns_of_trl_signatures():
    assert required_columns([answer_match, reward_len, only_for_math, prompt_echo]) == {
        "answer": ["answer_match"], "task": ["only_for_math"]}


ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(10, 40)]


def test_trl_functions_train_and_their_logs_reach_metrics_and_samples(tmp_path):
    steps_seen = []

    def exact(completions, answer, trainer_state, log_metric, log_extra, **kwargs):
        steps_seen.append(trainer_state.global_step)
        log_metric("exact/answers_seen", float(len(answer)))
        log_extra("gold", list(answer))
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    cfg = Config(train={"steps": 3, "output_dir": str(tmp_path)}, log={"console": False, "samples_every": 1, "num_samples": 2},
                 rollout={"prompts_per_step": 2, "group_size": 4}, data={"num_eval_prompts": 2})
    trainer = Trainer(cfg, reward_funcs=[reward_len, exact], train_dataset=ROWS, eval_dataset=ROWS[:2])
    trainer.train()
    assert sorted(set(steps_seen)) == [0, 1, 2, 3]  # evaluations at 0 and 3, training steps 1-3 see 0, 1, 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "exact/answers_seen" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3] and all(r["exact/answers_seen"] == 8.0 for r in train_rows)
    assert all("reward/reward_len/mean" in r for r in train_rows)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2, 3, 3]
    assert all(s["gold"] == str(2 * int(s["prompt"].split("+")[0])) for s in samples)  # the row's own answer
