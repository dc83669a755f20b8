"""Tools: schemas from signatures and docstrings, tool-call parsing, and observations for every failure."""

from __future__ import annotations

import pytest

from lmrl.envs import (
    Step,
    ToolCall,
    ToolEnvironment,
    Tools,
    parse_tool_calls,
    python_tool,
    tool_schema,
    tools_from,
)
from lmrl.errors import ConfigError
from lmrl.sandbox import SandboxLimits, SandboxUnavailable


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def test_the_schema_comes_from_the_signature_and_docstring():
    schema = tool_schema(add)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"] == {"a": {"type": "integer", "description": "the first number"},
                                              "b": {"type": "integer", "description": "the second number"}}
    assert fn["parameters"]["required"] == ["a", "b"]
    assert Tools([add, divide]).schemas == [tool_schema(add), tool_schema(divide)]


def test_a_function_without_a_docstring_is_refused_in_one_line():
    def bare(x: int) -> int:
        return x

    with pytest.raises(ValueError, match=r"^tool 'bare': cannot build its schema: .*docstring") as info:
        tool_schema(bare)
    assert "\n" not in str(info.value)


def test_hermes_calls_are_parsed_in_order_and_malformed_ones_reported():
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 4}"}</tool_call>'
            "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
            '<tool_call>{"arguments": {}}</tool_call>')
    calls, problems = parse_tool_calls(text)
    assert calls == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("divide", {"a": 1, "b": 4})]
    assert len(problems) == 3 and all(p.startswith("error: malformed tool call") for p in problems)
    assert "expected a JSON object" in problems[1] and "no tool name" in problems[2]
    assert parse_tool_calls("no calls here") == ([], [])


def test_a_configurable_regex_finds_other_formats():
    pattern = r"Action: (?P<name>\w+)\((?P<arguments>\{.*?\})\)"
    calls, problems = parse_tool_calls('Action: add({"a": 1, "b": 1}) and Action: add({oops})', pattern)
    assert calls == [ToolCall("add", {"a": 1, "b": 1})] and len(problems) == 1


def test_every_failure_becomes_an_error_observation_and_is_counted():
    tools = Tools([add, divide])
    ok = tools.call(ToolCall("add", {"a": 2, "b": 3}))
    assert ok.text == "5" and not ok.error
    unknown = tools.call(ToolCall("mul", {"a": 1}))
    assert unknown.error and unknown.text == "error: unknown tool 'mul'; available: ['add', 'divide']"
    bad = tools.call(ToolCall("add", {"a": 1, "c": 2}))
    assert bad.error and bad.text.startswith("error: bad arguments for add:")
    raised = tools.call(ToolCall("divide", {"a": 1, "b": 0}))
    assert raised.error and raised.text == "error: divide raised ZeroDivisionError: division by zero"
    assert tools.counts["calls"] == 4 and tools.counts["errors"] == 3


def test_duplicate_names_and_bad_specs_are_config_errors():
    with pytest.raises(ConfigError, match=r"^env.tools: two tools are named 'add'"):
        tools_from([add, add])
    with pytest.raises(ConfigError, match=r"^env.tools\[0\]: tool spec 'nope.py:f': file 'nope.py' not found"):
        tools_from(["nope.py:f"])


def test_the_tool_environment_runs_calls_and_ends_on_a_turn_without_one():
    env = ToolEnvironment(Tools([add]))
    episode = env({"prompt": "2+3?"})
    step = episode.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
                        "<tool_call>{bad}</tool_call>", [1, 2])
    assert step.observation.startswith("<tool_response>\nerror: malformed tool call")
    assert step.observation.endswith("<tool_response>\n5\n</tool_response>\n") and not step.done
    assert step.info["tool_calls"] == 2 and step.info["malformed_calls"] == 1 and step.info["tool_errors"] == 0
    assert episode.step("The answer is 5.", [3]) == Step(done=True)
    chat = ToolEnvironment(Tools([add]), response_format="chat")({})
    assert chat.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>', []).observation == [
        {"role": "tool", "content": "2"}]


def test_the_python_tool_runs_model_code_in_the_sandbox():
    try:
        tool = python_tool(SandboxLimits(timeout=2, memory_mb=256, processes=8))
    except SandboxUnavailable as e:
        pytest.skip(f"no namespaces here: {e}")
    tools = Tools([tool])
    assert tools.schemas[0]["function"]["name"] == "python"
    assert tools.call(ToolCall("python", {"code": "print(2 + 3)"})).text == "5\n"
    failed = tools.call(ToolCall("python", {"code": "1 / 0"}))
    assert failed.error and "ZeroDivisionError" in failed.text
    env = ToolEnvironment(tools)
    step = env({}).step('<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>', [])
    assert "stopped by the sandbox (timeout)" in step.observation or "(cpu_limit)" in step.observation
    assert step.info["sandbox_kills"] == 1 and step.info["tool_errors"] == 1


TOOL_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_chat_prompts_list_the_tools_and_chat_observations_use_the_template():
    from lmrl.models.prompt_encoding import encode_prompts
    from lmrl.models.tiny import char_tokenizer
    from lmrl.rollout.multiturn import render_observation

    tok = char_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    tools = Tools([add, divide])
    [ids] = encode_prompts(tok, [[{"role": "user", "content": "2+3?"}]], 200, tools=tools.schemas)
    assert tok.decode(ids) == "tools: add divide\nuser: 2+3?\nassistant: "
    [plain] = encode_prompts(tok, [[{"role": "user", "content": "2+3?"}]], 200)
    assert tok.decode(plain) == "user: 2+3?\nassistant: "
    assert render_observation(tok, [{"role": "tool", "content": "5"}]) == "tool: 5\nassistant: "
    assert render_observation(tok, "as is") == "as is"


def test_named_groups_are_string_arguments_for_compact_formats():
    calls, problems = parse_tool_calls("<calc>12+30+4</calc> then <calc></calc>", r"<(?P<name>calc)>(?P<expression>[^<]*)</calc>")
    assert calls == [ToolCall("calc", {"expression": "12+30+4"}), ToolCall("calc", {"expression": ""})] and not problems
