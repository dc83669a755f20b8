"""Tests for the built-in tasks: splits, reward, lookup, and the evaluation helper."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.data.tasks import TASKS, AdditionTask, evaluate, exact_match_reward, get_task
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm


def _pairs(items):
    return {tuple(int(x) for x in it["prompt"].rstrip("=").split("+")) for it in items}


def test_splits_are_disjoint_sized_and_correct():
    task = AdditionTask(num_train=3000, num_eval=400, seed=3)
    train, held_out = task.train_prompts(), task.eval_prompts()
    assert len(train) == 3000 and len(held_out) == 400
    assert len(_pairs(train)) == 3000 and len(_pairs(held_out)) == 400  # no duplicate within a split
    assert not _pairs(train) & _pairs(held_out)
    for it in train[:50] + held_out[:50]:
        a, b = (int(x) for x in it["prompt"][:-1].split("+"))
        assert it["prompt"] == f"{a}+{b}=" and it["answer"] == str(a + b)
        assert 0 <= a <= 99 and 0 <= b <= 99


def test_splits_are_deterministic_and_seeded():
    assert AdditionTask(seed=1).train_prompts() == AdditionTask(seed=1).train_prompts()
    assert AdditionTask(seed=1).eval_prompts() == AdditionTask(seed=1).eval_prompts()
    assert AdditionTask(seed=1).eval_prompts() != AdditionTask(seed=2).eval_prompts()


def test_held_out_split_does_not_depend_on_train_size():
    assert AdditionTask(num_train=100).eval_prompts() == AdditionTask(num_train=2000).eval_prompts()


def test_digit_range_is_respected():
    task = AdditionTask(min_digits=3, max_digits=3, num_train=200, num_eval=50)
    for a, b in _pairs(task.train_prompts() + task.eval_prompts()):
        assert 100 <= a <= 999 and 100 <= b <= 999
    assert task.max_new_tokens == 5  # 4 answer digits + EOS


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [({"min_digits": 0}, "min_digits"), ({"min_digits": 3, "max_digits": 2}, "max_digits"),
     ({"num_eval": 0}, "num_eval"), ({"max_digits": 1, "num_train": 100}, "exceeds")],
)
def test_bad_arguments_raise_one_line(kwargs, word):
    with pytest.raises(ValueError, match=word) as info:
        AdditionTask(**kwargs)
    assert "\n" not in str(info.value)


def test_reward_hand_cases():
    completions = ["46", " 46\n", "47", "", "460", "4 6", [{"role": "assistant", "content": "46 "}]]
    rewards = exact_match_reward(["12+34="] * 7, completions, answer=["46"] * 7)
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_reward_accepts_extra_columns_and_checks_lengths():
    assert exact_match_reward(["1+1="], ["2"], answer=["2"], completion_ids=[[5]], trainer_state=None) == [1.0]
    with pytest.raises(ValueError, match="answer"):
        exact_match_reward(["1+1=", "1+2="], ["2", "3"], answer=["2"])


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_reward_is_one_exactly_for_the_true_sum(a, b):
    answer = str(a + b)
    assert exact_match_reward([""], [answer], [answer]) == [1.0]
    assert exact_match_reward([""], [str(a + b + 1)], [answer]) == [0.0]


def test_get_task_and_unknown_name():
    assert set(TASKS) == {"addition", "calculator", "calculator-notool", "digits", "digits-blank"}
    task = get_task("addition", seed=5, num_eval=10)
    assert isinstance(task, AdditionTask) and task.seed == 5 and len(task.eval_prompts()) == 10
    assert task.reward_funcs == [exact_match_reward]
    with pytest.raises(ValueError, match=r"unknown task 'subtraction'; known tasks: addition") as info:
        get_task("subtraction")
    assert "\n" not in str(info.value)


class _Oracle(torch.nn.Module):
    """Stands in for a model: `generate` appends fixed completions, to check `evaluate`'s bookkeeping."""

    def __init__(self, tokenizer, answers):
        super().__init__()
        self.tokenizer, self.answers, self.calls = tokenizer, answers, 0

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kw):
        rows = []
        for i in range(len(input_ids)):
            text = self.answers(i, kw["do_sample"])
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_token_id, 7]
            rows.append((ids + [pad_token_id] * max_new_tokens)[:max_new_tokens])
        self.calls += 1
        return torch.cat([input_ids, torch.tensor(rows)], 1)


def test_evaluate_counts_exact_matches_and_pass_at_k():
    tok = char_tokenizer()
    task = AdditionTask(num_eval=4)
    truth = [it["answer"] for it in task.eval_prompts()]
    # greedy: right on prompts 0 and 2; sampling (k=3 per prompt): only prompt 1's third sample is right
    def answers(i, sampling):
        if not sampling:
            return truth[i] if i in (0, 2) else "x"
        return truth[1] if i == 5 else "y"

    result = evaluate(_Oracle(tok, answers), tok, task, n_prompts=4, k=3)
    assert result == {"accuracy": 0.5, "pass_at_k": 0.25}


def test_evaluate_runs_a_real_tiny_model():
    tok = char_tokenizer()
    model = tiny_causal_lm(tok, hidden_size=32, num_layers=1)
    result = evaluate(model, tok, AdditionTask(num_eval=8), n_prompts=8, k=2)
    assert set(result) == {"accuracy", "pass_at_k"}
    assert 0.0 <= result["accuracy"] <= 1.0 and result["accuracy"] <= 1.0
    assert not model.training


def test_the_calculator_task_its_tool_and_its_reward():
    from lmrl.data.tasks import CalculatorTask, calc, final_answer_reward, get_task

    task = get_task("calculator")
    train, held_out = task.train_prompts(), task.eval_prompts()
    assert len(train) == 4000 and len(held_out) == 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    row = held_out[0]
    terms = [int(t) for t in row["prompt"][:-1].split("+")]
    assert len(terms) == 3 and all(10 <= t <= 99 for t in terms) and row["answer"] == str(sum(terms))
    assert calc("47+85+36") == "168"
    for bad in ("__import__('os')", "1+", "2*3", ""):
        with pytest.raises(ValueError, match="not a sum of whole numbers"):
            calc(bad)
    episode = task.environment()(row)
    step = episode.step(f"<calc>{row['prompt'][:-1]}</calc>", [])
    assert step.observation == f"={row['answer']}\n" and not step.done and step.info["tool_calls"] == 1
    assert episode.step(row["answer"], []).done
    texts = ["<calc>47+85+36</calc>=168\n168", "168", "<calc>47+85+36</calc>", "=168\n167"]
    assert final_answer_reward(None, texts, ["168"] * 4) == [1.0, 1.0, 0.0, 0.0]
    no_tool = get_task("calculator-notool")
    assert no_tool.environment() is None and no_tool.eval_prompts() == held_out
    assert CalculatorTask(tool=False).environment() is None


def test_the_shipped_calculator_model_answers_better_with_its_tool():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from make_tiny_model import evaluate_calculator

    from lmrl.data.tasks import CalculatorTask
    from lmrl.models.shipped import SHIPPED_MODELS, load_shipped

    model, tokenizer = load_shipped(SHIPPED_MODELS["tiny-calculator"])
    task = CalculatorTask()
    with_tool = evaluate_calculator(model, tokenizer, task, n_prompts=100)
    without = evaluate_calculator(model, tokenizer, task, n_prompts=100, tool=False)
    # it calls the tool for some sums (and then copies its answer); alone it can hardly add three numbers
    assert 0.1 < with_tool["tool_rate"] < 0.9
    assert with_tool["accuracy"] >= without["accuracy"] + 0.15 and without["accuracy"] < 0.1
