"""Resolving rewards by name: built-ins, functions in .py files, importable modules, config entries."""

from __future__ import annotations

import textwrap

import pytest

from lmrl.rewards import (
    BUILTIN_REWARDS,
    RemoteScorer,
    load_function,
    resolve_reward,
    reward_set_from_config,
    score,
)

USER_FILE = textwrap.dedent(
    """
    def brevity(prompts, completions, **kwargs):
        return [1.0 / (1 + len(c)) for c in completions]

    def scaled(prompts, completions, scale=1.0, **kwargs):
        return [scale * len(c) for c in completions]

    NOT_A_FUNCTION = 3
    """
)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def test_builtins_are_listed():
    assert {"math", "exact_match", "format", "regex", "length", "remote", "reward_model"} <= set(BUILTIN_REWARDS)


def test_resolve_builtin_with_options():
    fn = resolve_reward("exact_match", column="label")
    assert fn.__name__ == "exact_match"
    assert fn(["q"], ["x"], label=["x"]) == [1.0]
    remote = resolve_reward("remote", url="http://127.0.0.1:1/score", timeout=1.0)
    assert isinstance(remote, RemoteScorer) and remote.timeout == 1.0


def test_load_function_from_file(user_file):
    fn = load_function(f"{user_file}:brevity")
    assert fn(["q", "q"], ["", "abc"]) == [1.0, 0.25]


def test_load_function_errors(user_file, tmp_path):
    with pytest.raises(ValueError, match=r"file '.*missing\.py' not found"):
        load_function(f"{tmp_path}/missing.py:brevity")
    with pytest.raises(ValueError, match=r"no function 'nope' in .*callables there: \['brevity', 'scaled'\]"):
        load_function(f"{user_file}:nope")
    with pytest.raises(ValueError, match="'NOT_A_FUNCTION' is a int, not a function"):
        load_function(f"{user_file}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="expected a built-in name"):
        resolve_reward("no_such_builtin")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('bad file')\n")
    with pytest.raises(ValueError, match="importing .*broken.py' failed: RuntimeError: bad file"):
        load_function(f"{broken}:f")


def test_load_function_from_module():
    fn = load_function("lmrl.rewards.math_verifier:extract_final_answer")
    assert fn("#### 5") == "5"
    with pytest.raises(ValueError, match="cannot import module 'lmrl.no_such_module'"):
        load_function("lmrl.no_such_module:f")


def test_user_function_options_are_bound(user_file):
    fn = resolve_reward(f"{user_file}:scaled", scale=2.0)
    assert fn(["q"], ["abc"]) == [6.0]
    out = score([fn], ["q"], ["ab"])
    assert "reward/scaled/mean" in out.metrics  # the partial keeps the function's name


def test_reward_set_from_config(user_file):
    rs = reward_set_from_config(
        [
            "format",
            {"fn": "exact_match", "weight": 0.5, "column": "label"},
            {"fn": f"{user_file}:brevity", "weight": 2.0, "name": "short"},
        ]
    )
    assert rs.names == ["format", "exact_match", "short"]
    out = score(rs, ["q", "q"], ["<think>a</think><answer>b</answer>", "b"], {"label": ["x", "b"]})
    brev = [1.0 / (1 + len("<think>a</think><answer>b</answer>")), 0.5]
    assert out.scores.tolist() == pytest.approx([1.0 + 0 + 2 * brev[0], 0.0 + 0.5 + 2 * brev[1]], abs=1e-6)
    with pytest.raises(ValueError, match="has no 'fn'"):
        reward_set_from_config([{"weight": 1.0}])
