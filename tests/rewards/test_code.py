"""The `code` reward: fraction of a row's tests passed, every program run in the sandbox."""

from __future__ import annotations

import pytest

from lmrl.rewards import code_reward, extract_code, required_columns, reward_set_from_config, score
from lmrl.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

LIMITS = SandboxLimits(timeout=2, cpu_seconds=2, memory_mb=256, processes=16, output_bytes=4096, max_parallel=2)
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    try:
        return Sandbox(LIMITS)
    except SandboxUnavailable as e:
        pytest.skip(f"no namespaces here: {e}")


def test_extract_code_takes_the_last_python_block_else_the_whole_text():
    text = "First:\n```python\nx = 1\n```\nthen\n```py\ndef f():\n    return 2\n```\n```text\nnot code\n```"
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("def f(): return 1") == "def f(): return 1"


def test_the_score_is_the_fraction_of_tests_passed(sandbox):
    reward = code_reward(sandbox=sandbox)
    completions = [
        "```python\ndef add(a, b):\n    return a + b\n```",  # passes 2 of 3 (the third test is wrong)
        "def add(a, b):\n    return a - b\n",  # subtracts: passes none
        "def add(a, b):\n    raise RuntimeError\n",
        "this is not python",
    ]
    scores = reward(["p"] * 4, completions, tests=[TESTS] * 4)
    assert scores == pytest.approx([2 / 3, 0.0, 0.0, 0.0])
    assert reward(["p"], ["def add(a, b): return a + b"], tests=["assert add(1, 1) == 2"]) == [1.0]
    assert reward.stats["runs"] == 5 and reward.stats["kills"] == 0


def test_tests_that_passed_before_a_timeout_count(sandbox):
    reward = code_reward(sandbox=sandbox)
    tests = ["assert f() == 1", "while True:\n    pass", "assert f() == 1"]
    assert reward(["p"], ["def f():\n    return 1"], tests=[tests]) == pytest.approx([1 / 3])
    assert reward.stats["kills"] == 1


def test_hostile_programs_score_zero_and_the_honest_one_in_the_same_batch_keeps_its_score(sandbox):
    reward = code_reward(sandbox=sandbox)
    hostile = [
        "while True:\n    pass\n",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "x = bytearray(20 * 2**30)\n",
        "open('/tmp/lmrl-code-escaped', 'w').write('x')\n",
        "import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)\n",
        "import sys\nfor _ in range(2**20):\n    sys.stdout.write('x' * 1024)\n",
    ]
    honest = "def add(a, b):\n    return a + b\n"
    completions = [c + honest for c in hostile] + [honest]
    out = score([reward], ["p"] * len(completions), completions, {"tests": [TESTS[:2]] * len(completions)})
    assert out.scores.tolist() == [0.0] * len(hostile) + [1.0]
    assert reward.stats["kills"] >= 3  # the loop, the fork bomb and the flood at least


def test_a_forged_pass_line_without_the_runs_marker_counts_for_nothing(sandbox):
    reward = code_reward(sandbox=sandbox)
    forged = "print('pass 0')\nprint('deadbeef pass 0')\nraise SystemExit(0)\n"
    assert reward(["p"], [forged], tests=[["assert False"]]) == [0.0]


def test_it_declares_its_column_and_rejects_bad_tests(sandbox):
    reward = code_reward(column="checks", sandbox=sandbox)
    assert required_columns([reward]) == {"checks": ["code"]}
    with pytest.raises(ValueError, match="row 0: tests must be a string or a list of strings"):
        reward(["p"], ["x = 1"], checks=[3])


def test_the_registry_builds_it_with_the_configs_sandbox_limits(sandbox):
    rewards = reward_set_from_config([{"fn": "code", "column": "tests"}], sandbox=LIMITS)
    assert rewards.names == ["code"]
    assert rewards.rewards[0].fn.sandbox.limits == LIMITS
    own = reward_set_from_config([{"fn": "code", "sandbox": {"timeout": 3}}], sandbox=LIMITS)
    assert own.rewards[0].fn.sandbox.limits.timeout == 3
