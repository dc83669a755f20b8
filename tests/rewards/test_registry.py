"""Resolving rewards by name: built-ins, functions in .py files, importable modules, config entries."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from lmrl.errors import ConfigError
from lmrl.rewards import (
    BUILTIN_REWARDS,
    RemoteScorer,
    load_function,
    required_columns,
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

    def strict(prompts, completions, answer, level):
        return [float(c == a) for c, a in zip(completions, answer)]

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
    with pytest.raises(ValueError, match=r"no function 'nope' in .*callables there: \['brevity', 'scaled', 'strict'\]"):
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


def one_line_config_error(excinfo) -> str:
    assert isinstance(excinfo.value, ConfigError) and isinstance(excinfo.value, ValueError)
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("import sys\nsys.exit(0)\n", "it called sys.exit(0)"),
        ("import sys\nsys.exit('no GPU here')\n", "it called sys.exit('no GPU here')"),
        ("import sys\nsys.exit()\n", "it called sys.exit()"),
        ("import os\nraise OSError('line one\\nline two')\n", "OSError: line one line two"),
        ("def f(:\n", "SyntaxError: "),
    ],
)
def test_a_reward_file_that_exits_or_fails_at_import_is_a_config_error(tmp_path, source, problem):
    path = tmp_path / "exits.py"
    path.write_text(source)
    before = set(sys.modules)
    with pytest.raises(ConfigError) as e:
        load_function(f"{path}:f")
    msg = one_line_config_error(e)
    assert msg.startswith(f"reward spec '{path}:f': importing '{path}' failed: {problem}"), msg
    assert set(sys.modules) == before  # the half-imported module is not left behind

    with pytest.raises(ConfigError) as e:
        reward_set_from_config(["format", {"fn": f"{path}:f", "weight": 2}])
    assert one_line_config_error(e).startswith(f"reward.functions[1]: reward spec '{path}:f': importing")


def test_a_module_that_exits_at_import_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "lmrl_test_exiting_module.py").write_text("import sys\nsys.exit(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        load_function("lmrl_test_exiting_module:f")
    assert one_line_config_error(e) == (
        "reward spec 'lmrl_test_exiting_module:f': importing module 'lmrl_test_exiting_module' failed: "
        "it called sys.exit(4)"
    )


def test_keyboard_interrupt_at_import_propagates(tmp_path):
    path = tmp_path / "interrupted.py"
    path.write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        load_function(f"{path}:f")


def test_config_errors_name_the_entry_and_the_spec(user_file, tmp_path):
    cases = [
        (["maht"], r"reward.functions[0]: reward spec 'maht': expected a built-in name ["),
        (["format", f"{tmp_path}/missing.py:f"],
         f"reward.functions[1]: reward spec '{tmp_path}/missing.py:f': file '{tmp_path}/missing.py' not found"),
        ([{"fn": f"{user_file}:nope"}], f"reward.functions[0]: reward spec '{user_file}:nope': no function 'nope'"),
        ([{"fn": "lmrl.no_such_module:f"}], "reward.functions[0]: reward spec 'lmrl.no_such_module:f': cannot import"),
        ([{"fn": "math", "colum": "x"}], "reward.functions[0]: reward 'math': math_reward() got an unexpected keyword"),
        ([{"fn": "regex", "pattern": "("}], "reward.functions[0]: reward 'regex': pattern: invalid regular expression"),
        ([{"fn": f"{user_file}:strict", "levle": 1}],
         f"reward.functions[0]: reward '{user_file}:strict': option(s) ['levle'] are not parameters of the function"),
        (["format", {"weight": 1.0}], "reward.functions[1]: entry {'weight': 1.0} has no 'fn'"),
        ([3], "reward.functions[0]: reward spec: expected a string or a callable, got int (3)"),
        ([{"fn": "format", "name": 5}], "reward.functions[0].name: expected a string, got 5"),
        (["format", {"fn": "regex", "pattern": "x", "name": "format"}], "reward.functions: duplicate reward name 'format'"),
    ]
    for entries, start in cases:
        with pytest.raises(ConfigError) as e:
            reward_set_from_config(entries)
        msg = one_line_config_error(e)
        assert msg.startswith(start), (entries, msg)


@pytest.mark.parametrize("weight", ["heavy", float("nan"), float("inf"), "-inf", True, None, [1.0], 10**400])
def test_a_weight_that_is_not_a_finite_number_is_a_config_error(weight):
    with pytest.raises(ConfigError) as e:
        reward_set_from_config(["format", {"fn": "format", "name": "f2", "weight": weight}])
    assert re.fullmatch(r"reward\.functions\[1\]\.weight: expected a finite number, got .{1,40}", one_line_config_error(e))


def test_numeric_weights_are_accepted():
    rs = reward_set_from_config([{"fn": "format", "weight": "0.5"}, {"fn": "regex", "pattern": "x", "weight": 3}])
    assert [r.weight for r in rs.rewards] == [0.5, 3.0]


def test_required_columns_of_a_config(user_file):
    rs = reward_set_from_config(
        [
            {"fn": "math", "column": "solution", "isolate": False},
            {"fn": f"{user_file}:strict", "name": "strict_any"},
            {"fn": f"{user_file}:strict", "level": 2, "name": "strict_level_bound"},
            {"fn": f"{user_file}:brevity"},
            "format",
        ]
    )
    assert required_columns(rs) == {
        "solution": ["math"],
        "answer": ["strict_any", "strict_level_bound"],
        "level": ["strict_any"],
    }
