"""Chat turns as OpenAI messages, both ways: the model's tool calls parsed into `tool_calls`, and a conversation
sent back rendered so that the model's own turns are exactly the text it sampled.

    content, calls = parse_tool_calls(text)           # Hermes / Qwen <tool_call>{"name", "arguments"}</tool_call>
    text = render_conversation(tokenizer, messages, tools, replies)

A chat template renders an assistant message with `tool_calls` in its own way (`<tool_call>\\n{json}\\n</tool_call>`
with its own spacing and key order), which need not be how the model wrote it. Rendering the messages and
tokenizing the result would then put tokens the model never sampled where it wrote its call. So each assistant
message that is one of the gateway's own replies, unchanged, is rendered as a placeholder and replaced by the
sampled text itself; what the agent changed is rendered as it is (and the record is cut there).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HERMES = re.compile(r"<tool_call>\s*(?P<json>\{.*?\})\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, call_id: str = "call") -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a model turn in OpenAI's shape: the text before the first well-formed call (None
    when empty), and each call {"id", "type": "function", "function": {"name", "arguments": a JSON string}}. A
    turn without a well-formed call is all content, calls []: a malformed call stays text the agent can read."""
    calls, first = [], None
    for match in HERMES.finditer(text):
        try:
            call = json.loads(match.group("json"))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append({"id": f"{call_id}-{len(calls)}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
        first = match.start() if first is None else first
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


@dataclass
class Reply:
    """One of the gateway's replies: the message it sent and the text it sampled (special tokens kept)."""

    message: dict[str, Any]
    raw: str
    end: str = ""
    """The raw text's closing special token (an EOS the template writes after the content), or ""."""


def render_conversation(tokenizer: Any, messages: Sequence[Any], tools: Any, replies: Sequence[Reply]) -> str:
    """`messages` through the chat template (with `tools`, and the generation prompt), the k-th assistant message
    replaced by the k-th reply's sampled text where it is that reply unchanged (module docstring)."""
    rendered, marks, k = [], [], 0
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "assistant":
            if k < len(replies) and _same_message(message, replies[k].message):
                mark = f"\u27e6lmrl-turn-{k}\u27e7"
                rendered.append({"role": "assistant", "content": mark})
                marks.append((mark, replies[k]))
                k += 1
                continue
            k += 1
        rendered.append(message)
    text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, tools=tools or None)
    for mark, reply in marks:
        if reply.end and reply.raw.endswith(reply.end) and mark + reply.end in text:
            text = text.replace(mark + reply.end, reply.raw, 1)
        else:
            text = text.replace(mark, reply.raw, 1)
    return text


def _same_message(sent: dict[str, Any], ours: dict[str, Any]) -> bool:
    """The agent sent back our reply as it was: the same content (None and "" alike) and the same calls."""
    if (_text(sent.get("content")) or None) != (ours.get("content") or None):
        return False
    return _calls(sent.get("tool_calls")) == _calls(ours.get("tool_calls"))


def _text(content: Any) -> Any:
    """A message's content as one string where it is a list of text parts ([{"type": "text", "text": ...}])."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _calls(calls: Any) -> list[tuple[Any, Any]]:
    out = []
    for call in calls or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        out.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return out
