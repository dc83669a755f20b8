"""The `code` reward: run each completion's program against its row's tests in the sandbox.

    reward:
      functions:
        - {fn: code, column: tests}          # a row: {"prompt": ..., "tests": ["assert f(1) == 2", ...]}

The score is the fraction of the row's tests that passed (0.0 to 1.0). The program is the last
fenced code block of the completion (```python ... ``` or ``` ... ```), or the whole completion when
it has none. Each completion runs once, in its own sandboxed process (`lmrl.sandbox`): the program
first, then each test in the same namespace, in order; a test passes when it runs without raising.
A program that fails to run, times out or hits a limit scores the tests that passed before that
(none, when the program itself failed).

Not protected against: the program and the tests share one process, so a program written to fool
the harness (replacing `print` or `sys.stdout`, finding the per-run marker in memory) could report
tests it did not pass. The sandbox keeps such a program from harming the machine, not from lying
about its own tests; watch `reward/code/mean` against held-out checks.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmrl.sandbox import Sandbox, SandboxLimits, SandboxResult

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

_HARNESS = """\
import sys as _sys
_marker = {marker!r}
_scope = {{"__name__": "__main__"}}
exec(compile({program!r}, "solution.py", "exec"), _scope)
for _i, _test in enumerate({tests!r}):
    try:
        exec(compile(_test, "test_%d.py" % _i, "exec"), _scope)
    except BaseException as _e:
        print(_marker, "fail", _i, type(_e).__name__, flush=True)
    else:
        print(_marker, "pass", _i, flush=True)
"""


def extract_code(completion: str) -> str:
    """The last fenced code block of `completion` (python, py or no language), else the whole text."""
    blocks = [body for lang, body in _FENCE.findall(completion) if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else completion


def _tests_of(value: Any, i: int) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(t, str) for t in value):
        return list(value)
    raise ValueError(f"code reward: row {i}: tests must be a string or a list of strings, got {type(value).__name__}")


def harness(program: str, tests: Sequence[str], marker: str) -> str:
    """The Python program the sandbox runs for one completion: the program, then each test."""
    return _HARNESS.format(marker=marker, program=program, tests=list(tests))


def passed_fraction(result: SandboxResult, num_tests: int, marker: str) -> float:
    """Tests reported as passed by the harness (lines starting with the run's marker) / num_tests."""
    if num_tests == 0:
        return 0.0
    passed = set()
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == marker and parts[1] == "pass" and parts[2].isdigit():
            passed.add(int(parts[2]))
    return len({i for i in passed if i < num_tests}) / num_tests


def code_reward(
    column: str = "tests",
    *,
    sandbox: Sandbox | SandboxLimits | Mapping[str, Any] | None = None,
    name: str = "code",
) -> Callable[..., list[float]]:
    """Fraction of the row's tests each completion's program passes, run in the sandbox.

    Args:
        column: the dataset column holding each row's tests: a list of Python snippets (each one
            test, e.g. "assert add(2, 2) == 4") or one string (a single test).
        sandbox: a Sandbox to share, or its limits (a SandboxLimits or a mapping of its fields, as the
            config's `sandbox` section gives); None uses the default limits. The sandbox starts here,
            so a machine that cannot isolate code fails now, with one line, not mid-run.
        name: the name its metrics are logged under.

    The returned function also counts, in its `stats` attribute, the programs the sandbox stopped
    (`kills`) and ran (`runs`) since it was made.
    """
    if not isinstance(column, str) or not column:
        raise ValueError(f"column: expected a column name, got {column!r}")
    if isinstance(sandbox, Mapping):
        sandbox = SandboxLimits(**sandbox)
    box = sandbox if isinstance(sandbox, Sandbox) else Sandbox(sandbox)
    stats = {"runs": 0, "kills": 0}

    def code(prompts: list[Any], completions: list[str], **kwargs: Any) -> list[float]:
        if column not in kwargs:
            raise ValueError(f"code reward: column {column!r} not found; available: {sorted(kwargs)}")
        tests = [_tests_of(value, i) for i, value in enumerate(kwargs[column])]
        marker = secrets.token_hex(16)  # per call: a program cannot know it in advance
        programs = [harness(extract_code(c), t, marker) for c, t in zip(completions, tests, strict=True)]
        results = box.run_many(programs)
        stats["runs"] += len(results)
        stats["kills"] += sum(r.killed for r in results)
        return [passed_fraction(r, len(t), marker) for r, t in zip(results, tests, strict=True)]

    code.__name__ = code.__qualname__ = name
    code.columns = [column]  # type: ignore[attr-defined]  # checked against the dataset before training
    code.stats = stats  # type: ignore[attr-defined]
    code.sandbox = box  # type: ignore[attr-defined]
    return code
