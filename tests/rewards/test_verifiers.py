"""Built-in verifiers on real-looking completions: math, exact match, format / regex, length."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from lmrl.rewards import (
    MathVerifyWorker,
    exact_match_reward,
    extract_final_answer,
    format_reward,
    length_penalty_reward,
    math_reward,
    regex_reward,
    score,
)


@pytest.fixture(scope="module")
def math_fn():
    """One isolated math reward (one worker process) shared by the tests of this module."""
    fn = math_reward()
    yield fn
    fn.worker.close()


GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so x = \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{\\sqrt{2}}", "\\sqrt{2}"),  # the last one
        ("steps...\n#### 1,000", "1,000"),
        ("Thus the answer is 42.", "42"),
        ("Final Answer: $7$", "$7$"),
        ("<think>hmm</think><answer> 5 </answer>", "5"),
        ("I need to find the answer to this question", None),
        ("unfinished \\boxed{3", None),
        ("no answer here 17", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize("isolate", [True, False])
def test_math_reward_on_real_looking_completions(isolate, math_fn):
    fn = math_fn if isolate else math_reward(isolate=False)
    completions = [
        "Half of 48 is 24, so she sold 48 + 24 = 72 clips.\n#### 72",  # GSM8K style, right
        "She sold 48 + 24 clips in total, so the answer is $\\boxed{72}$.",  # boxed, right
        "48 + 24 = 73, so the answer is 73.",  # wrong answer
        "72 72 72 I think maybe",  # a number but no answer anchor
        "}}{{\\boxed{\\frac{}}} #### ????",  # garbage
        "The answer is 72.0",  # numerically equal
    ]
    answers = [GSM8K_GOLD] * 5 + ["72"]
    out = fn(["q"] * 6, completions, answer=answers)
    assert out == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_math_reward_latex_equivalence_and_columns():
    fn = math_reward(column="solution", isolate=False)
    out = fn(
        ["q"] * 3,
        ["\\boxed{0.5}", "The answer is \\frac{2}{4}", "\\boxed{\\frac{1}{3}}"],
        solution=["$\\frac{1}{2}$", "\\frac{1}{2}", "The result is \\boxed{\\frac{1}{2}}"],
    )
    assert out == [1.0, 1.0, 0.0]


def test_math_reward_falls_back_to_solution_column_and_none_for_missing_gold(math_fn):
    fn = math_fn  # looks for "answer", then "solution"
    assert fn(["q", "q"], ["\\boxed{3}", "\\boxed{3}"], solution=["3", None]) == [1.0, None]
    with pytest.raises(ValueError, match=r"no ground-truth column \(looked for \['answer', 'solution'\]\); available: \['question'\]"):
        fn(["q"], ["\\boxed{3}"], question=["?"])
    with pytest.raises(ValueError, match="column 'target' not found"):
        math_reward(column="target")(["q"], ["1"], answer=["1"])


def test_math_reward_without_anchor_requirement():
    fn = math_reward(require_anchor=False, isolate=False)
    assert fn(["q"], ["so we get 72"], answer=["72"]) == [1.0]


@pytest.mark.parametrize("isolate", [True, False])
def test_math_reward_off_the_main_thread(isolate, math_fn):
    # math-verify's signal timeouts only work in the main thread; the verifier must still work elsewhere
    fn = math_fn if isolate else math_reward(isolate=False)
    result = {}

    def run():
        try:
            result["value"] = fn(["q"], ["\\boxed{72}"], answer=[GSM8K_GOLD])
        except Exception as e:  # noqa: BLE001
            result["value"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert result["value"] == [1.0]
    # and through score() with a timeout, which runs sync functions in worker threads
    out = score([fn], ["q", "q"], ["\\boxed{72}", "\\boxed{7}"], {"answer": ["72", "72"]}, timeout=60)
    assert out.scores.tolist() == [1.0, 0.0]


def test_adversarial_answer_does_not_freeze_the_trainer():
    # 9^9^9^9 makes sympy compute for ever; in the worker, math-verify's signal timeout (in the
    # worker's main thread) or the kill deadline ends it and the answer scores 0
    fn = math_reward(timeout_seconds=1)
    t0 = time.perf_counter()
    assert fn(["q", "q"], ["\\boxed{9^{9^{9^9}}}", "\\boxed{72}"], answer=["72", "72"]) == [0.0, 1.0]
    assert time.perf_counter() - t0 < fn.worker.deadline + 30  # 30 s: worker start-up on a busy machine
    fn.worker.close()


def test_worker_is_killed_and_restarted_past_its_deadline():
    worker = MathVerifyWorker(timeout_seconds=1)
    assert worker("72", "\\boxed{72}") == 1.0  # starts the worker
    worker.deadline = 0.5
    os.kill(worker._proc.pid, signal.SIGSTOP)  # a stuck worker: it cannot answer (a deadline of 0 raced a fast one)
    assert worker("72", "\\boxed{72}") == 0.0
    assert worker.restarts == 1
    worker.deadline = 30.0
    assert worker("72", "\\boxed{72}") == 1.0  # a fresh worker
    assert worker("72", "\\boxed{71}") == 0.0
    assert worker(None, "\\boxed{71}") is None
    worker.close()


def test_exact_match_normalises_whitespace():
    fn = exact_match_reward()
    out = fn(["q"] * 4, ["  Paris\n", "Pa ris", "paris", "New   York"], answer=["Paris", "Paris", "Paris", "New York"])
    assert out == [1.0, 0.0, 0.0, 1.0]
    assert exact_match_reward(case_sensitive=False)(["q"], ["PARIS"], answer=["paris"]) == [1.0]
    assert exact_match_reward(column="label")(["q", "q"], ["a", "b"], label=["a", None]) == [1.0, None]


def test_exact_match_with_extraction():
    fn = exact_match_reward(extract=r"<answer>(.*?)</answer>")
    out = fn(["q"] * 3, ["<answer> 4 </answer>", "4", "<answer>5</answer>"], answer=["4"] * 3)
    assert out == [1.0, 0.0, 0.0]


def test_format_reward_think_answer():
    fn = format_reward()
    completions = [
        "<think>2+2 is 4</think><answer>4</answer>",
        "<think>\nmulti\nline\n</think>\n<answer>4</answer>\n",
        "<answer>4</answer>",  # no think block
        "<think>x</think><answer>4</answer> trailing text",
        "<think>x<answer>4</answer>",  # unclosed think
    ]
    assert fn(["q"] * 5, completions) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert fn.__name__ == "format"


def test_regex_reward_modes_and_errors():
    assert regex_reward(r"\d+")(["q", "q"], ["abc 12", "abc"]) == [1.0, 0.0]
    assert regex_reward(r"\d+", mode="fullmatch")(["q", "q"], ["12", "a12"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="pattern: invalid regular expression"):
        regex_reward("(")
    with pytest.raises(ValueError, match="mode: expected"):
        regex_reward("a", mode="findall")


def test_length_penalty_reward_tokens_and_chars():
    fn = length_penalty_reward(max_length=8, cache_length=4)
    ids = [[1] * 3, [1] * 6, [1] * 8, [1] * 9]
    assert fn(["q"] * 4, ["", "", "", ""], completion_ids=ids) == [0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="needs the completion_ids argument"):
        fn(["q"], ["abc"])
    chars = length_penalty_reward(max_length=4, cache_length=2, unit="chars", name="len")
    assert chars(["q"] * 3, ["ab", "abc", "abcdef"]) == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="cache_length"):
        length_penalty_reward(max_length=4, cache_length=5)
