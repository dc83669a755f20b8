"""Tools: plain Python functions the model calls by writing a tool call in its turn.

    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first number
            b: the second number
        \"\"\"
        return a + b

    tools = Tools([add])                      # schemas for the chat template: tools.schemas
    calls, problems = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    tools.call(calls[0])                      # ToolOutcome(text="5", error=False, ...)

A tool's JSON schema comes from its signature and Google-style docstring, as transformers' chat
templates take `tools=` (`transformers.utils.get_json_schema`). Tool calls are parsed from the
model's text in the Hermes / Qwen format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)
or with a regex of your own. Tool functions are trusted code and run in the trainer's process; only
their arguments come from the model (as data, never executed). To run model-written code, use the
built-in `python` tool, which runs it in `lmrl.sandbox`.

Whatever the model writes, `Tools.call` returns an observation instead of raising: a malformed call,
an unknown tool, arguments that do not fit the signature, or an exception in the tool each become
one line the model reads, starting with "error:".
"""

from __future__ import annotations

import inspect
import json
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HERMES_PATTERN = r"<tool_call>\s*(?P<json>.*?)\s*</tool_call>"
"""Hermes / Qwen 2.5+ tool calls: a JSON object {"name": ..., "arguments": {...}} between tags."""


@dataclass
class Tool:
    """A Python function the model may call.

    Attributes:
        fn: the function; called with the keyword arguments the model gave.
        name: the name the model calls it by (the function's name by default).
        schema: the JSON schema in the form chat templates take: {"type": "function", "function": {...}}.
    """

    fn: Callable[..., Any]
    name: str = ""
    schema: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"tool: expected a function, got {type(self.fn).__name__}")
        if not self.schema:
            self.schema = tool_schema(self.fn)
        self.name = self.name or self.schema["function"]["name"]
        self.schema = {**self.schema, "function": {**self.schema["function"], "name": self.name}}


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The function's JSON schema from its type hints and Google-style docstring (transformers' format).

    Raises:
        ValueError: one line naming the function when it lacks a docstring, a type hint or an
            `Args:` entry for a parameter (what the chat template needs to describe it).
    """
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises several kinds for the same problem
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(f"tool {name!r}: cannot build its schema: {' '.join(str(e).split())} (give it type hints "
                         "and a Google-style docstring with an Args: line per parameter)") from e


@dataclass
class ToolCall:
    """A call parsed from the model's text: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ToolOutcome:
    """What a call gave: the observation text, and whether it was an error (malformed call or tool failure)."""

    text: str
    error: bool = False
    seconds: float = 0.0


def parse_tool_calls(text: str, pattern: str = HERMES_PATTERN) -> tuple[list[ToolCall], list[str]]:
    """Tool calls in `text`, in order, and one "error: ..." line for each malformed one.

    Args:
        text: the model's turn.
        pattern: a regex finding each call. Either a group named `json` holding {"name": ..., "arguments":
            {...}} (the Hermes default), or a group named `name` with the arguments as a JSON object in a
            group `arguments` and / or one group per argument (a string), e.g.
            r"Action: (?P<name>\\w+)\\((?P<arguments>\\{.*?\\})\\)" or r"<(?P<name>calc)>(?P<expression>[^<]*)</calc>".
    """
    calls, problems = [], []
    for match in re.finditer(pattern, text, flags=re.DOTALL):
        groups = match.groupdict()
        try:
            if groups.get("json") is not None:
                payload = json.loads(groups["json"])
                if not isinstance(payload, dict):
                    raise ValueError(f"expected a JSON object, got {type(payload).__name__}")
                name, arguments = payload.get("name"), payload.get("arguments", {})
            else:
                name = groups.get("name")
                arguments = json.loads(groups["arguments"]) if groups.get("arguments") else {}
                # any other named group is one string argument: compact formats need no JSON
                extra = {k: v for k, v in groups.items() if k not in ("name", "arguments") and v is not None}
                if extra and isinstance(arguments, dict):
                    arguments = {**arguments, **extra}
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not name:
                raise ValueError("no tool name")
            if not isinstance(arguments, dict):
                raise ValueError(f"arguments must be a JSON object, got {type(arguments).__name__}")
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            snippet = " ".join(match.group(0).split())[:120]
            problems.append(f"error: malformed tool call {snippet!r}: {' '.join(str(e).split())}")
            continue
        calls.append(ToolCall(name, arguments))
    return calls, problems


class Tools:
    """A set of tools by name; `call` turns any ToolCall into an observation and counts what happened.

    Attributes:
        counts: "calls", "errors" (unknown tool, bad arguments, the tool raised), "seconds" (in tools).
    """

    def __init__(self, tools: Sequence[Tool | Callable[..., Any]] = ()) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            t = t if isinstance(t, Tool) else Tool(t)
            if t.name in self.tools:
                raise ValueError(f"tools: two tools are named {t.name!r}")
            self.tools[t.name] = t
        self.counts = {"calls": 0.0, "errors": 0.0, "seconds": 0.0}

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for `tokenizer.apply_chat_template(..., tools=tools.schemas)`."""
        return [t.schema for t in self.tools.values()]

    def call(self, call: ToolCall) -> ToolOutcome:
        """Run one call; never raises for anything the model wrote or the tool did."""
        self.counts["calls"] += 1
        tool = self.tools.get(call.name)
        if tool is None:
            return self._error(f"error: unknown tool {call.name!r}; available: {sorted(self.tools)}")
        try:
            inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as e:
            return self._error(f"error: bad arguments for {call.name}: {e}")
        except ValueError:  # no signature to check against: let the call itself decide
            pass
        t0 = time.perf_counter()
        try:
            value = tool.fn(**call.arguments)
        except Exception as e:  # noqa: BLE001 - the model reads what went wrong
            seconds = time.perf_counter() - t0
            return self._error(f"error: {call.name} raised {type(e).__name__}: {' '.join(str(e).split())[:300]}", seconds)
        seconds = time.perf_counter() - t0
        self.counts["seconds"] += seconds
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        return ToolOutcome(text, False, seconds)

    def _error(self, text: str, seconds: float = 0.0) -> ToolOutcome:
        self.counts["errors"] += 1
        self.counts["seconds"] += seconds
        return ToolOutcome(text, True, seconds)


def python_tool(sandbox: Any = None, name: str = "python") -> Tool:
    """The built-in `python` tool: runs the model's code in `lmrl.sandbox` and returns what it printed.

    Args:
        sandbox: a `lmrl.sandbox.Sandbox` to share, its `SandboxLimits`, or None for the default limits.
        name: the name the model calls it by.

    The observation is the program's stdout; when it fails, also the last lines of stderr; when a limit
    stopped it, which one. The Tool's `fn.stats` counts runs and kills.
    """
    from lmrl.sandbox import Sandbox

    box = sandbox if isinstance(sandbox, Sandbox) else Sandbox(sandbox)
    stats = {"runs": 0, "kills": 0}

    def python(code: str) -> str:
        """Run a Python program (standard library only, no network) and return what it printed.

        Args:
            code: the program; print the values you want to see.
        """
        result = box.run(code)
        stats["runs"] += 1
        stats["kills"] += int(result.killed)
        if result.ok:
            return result.stdout
        if result.killed:
            raise RuntimeError(f"stopped by the sandbox ({result.status}); output so far: {result.stdout[-500:]!r}")
        tail = "\n".join(result.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"the program failed: {tail}")

    python.stats = stats  # type: ignore[attr-defined]
    python.sandbox = box  # type: ignore[attr-defined]
    return Tool(python, name=name)


def tools_from(specs: Sequence[str | Callable[..., Any] | Mapping[str, Any]], sandbox: Any = None, *,
               builtins: Iterable[str] = ()) -> Tools:
    """Tools from config entries: "python" (the built-in), "file.py:function", "module:function", or a function.

    `builtins` are the names that the message of a spec in neither form lists (`lmrl.user_code.load_function`).
    """
    from lmrl.errors import ConfigError
    from lmrl.user_code import load_function

    tools = []
    for i, spec in enumerate(specs):
        try:
            if spec == "python":
                tools.append(python_tool(sandbox))
            elif isinstance(spec, str):
                tools.append(Tool(load_function(spec, "tool spec", builtins)))
            else:
                tools.append(spec if isinstance(spec, Tool) else Tool(spec))
        except ConfigError as e:
            raise ConfigError(f"env.tools[{i}]: {e}") from e
        except (TypeError, ValueError) as e:
            raise ConfigError(f"env.tools[{i}]: {e}") from e
    try:
        return Tools(tools)
    except ValueError as e:
        raise ConfigError(f"env.tools: {str(e).removeprefix('tools: ')}") from e
