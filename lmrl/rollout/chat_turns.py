"""Chat turns as OpenAI messages, both ways: the model's tool calls parsed into `tool_calls`, and a conversation
sent back rendered so that the model's own turns are exactly the text it sampled.

    content, calls = parse_tool_calls(text)           # Hermes / Qwen <tool_call>{"name", "arguments"}</tool_call>
    fmt = tool_call_format(tokenizer)                 # the family's format, read from its chat template
    content, calls = parse_tool_calls(text, fmt=fmt, raw=raw)
    text, changed = render_conversation(tokenizer, messages, tools, replies)

The formats (`FORMATS`), as the families' chat templates render a call and their models write one:

    hermes    <tool_call>{"name": "add", "arguments": {...}}</tool_call>, anywhere in the turn (Qwen, Hermes)
    llama3    {"name": "add", "parameters": {...}} as the whole turn, after an optional <|python_tag|>; several
              calls separated by ";" (Llama 3.1 - 3.3's JSON tool calling)
    mistral   [TOOL_CALLS][{"name": "add", "arguments": {...}}, ...] after the turn's content, or
              [TOOL_CALLS]add[ARGS]{...} (Mistral's newer tokenizers); [TOOL_CALLS] is a special token, so the
              turn is read with its special tokens kept (`raw`)

A chat template renders an assistant message with `tool_calls` in its own way (`<tool_call>\\n{json}\\n</tool_call>`
with its own spacing and key order), which need not be how the model wrote it. Rendering the messages and
tokenizing the result would then put tokens the model never sampled where it wrote its call. So each assistant
message that is one of the gateway's own replies, unchanged, is rendered as a placeholder and replaced by the
sampled text itself; what the agent changed is rendered as it is. A template that writes an earlier reply's content
otherwise than it was sent (reasoning models' templates cut the reasoning of earlier turns) is followed: that reply is
rendered as the template writes it, and the gateway starts a new sample there (`lmrl.agents.gateway`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HERMES = re.compile(r"<tool_call>\s*(?P<json>\{.*?\})\s*</tool_call>", re.DOTALL)
PYTHON_TAG, TOOL_CALLS, ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"
FORMATS = ("hermes", "llama3", "mistral")
_JSON = json.JSONDecoder()


def tool_call_format(tokenizer: Any, given: str = "auto") -> str:
    """`given`, or where it is "auto" the format the tokenizer's chat template writes calls in (module docstring);
    hermes when the template shows none."""
    if given != "auto":
        if given not in FORMATS:
            raise ValueError(f"tool_call_format: expected 'auto' or one of {', '.join(FORMATS)}, got {given!r}")
        return given
    template = getattr(tokenizer, "chat_template", None) or ""
    template = " ".join(template.values()) if isinstance(template, dict) else str(template)
    if "<tool_call>" in template:
        return "hermes"
    if TOOL_CALLS in template:
        return "mistral"
    if '"parameters"' in template or PYTHON_TAG in template:
        return "llama3"
    return "hermes"


def parse_tool_calls(text: str, call_id: str = "call", fmt: str = "hermes",
                     raw: str | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a model turn in OpenAI's shape: the text before the first well-formed call (None
    when empty), and each call {"id", "type": "function", "function": {"name", "arguments": a JSON string}}. A
    turn without a well-formed call is all content, calls []: a malformed call stays text the agent can read.
    `fmt`: one of FORMATS; `raw`: the turn with its special tokens kept (mistral's [TOOL_CALLS] is one)."""
    if fmt == "llama3":
        found, first = _llama3(text), 0
    elif fmt == "mistral":
        marked = raw if raw is not None and TOOL_CALLS in raw else text
        found, first = _mistral(marked), marked.find(TOOL_CALLS)
        text = marked if found else text
    else:
        found, first = _hermes(text)
    calls = []
    for call in found:
        arguments = call.get("arguments", call.get("parameters", {}))
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append({"id": f"{call_id}-{len(calls)}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


def _is_call(call: Any) -> bool:
    return isinstance(call, dict) and isinstance(call.get("name"), str)


def _hermes(text: str) -> tuple[list[dict[str, Any]], int]:
    """Each well-formed <tool_call>{json}</tool_call>, and where the first of them starts (content ends there)."""
    calls, first = [], 0
    for match in HERMES.finditer(text):
        with contextlib.suppress(json.JSONDecodeError):
            call = json.loads(match.group("json"))
            if _is_call(call):
                first = first if calls else match.start()
                calls.append(call)
    return calls, first


def _llama3(text: str) -> list[dict[str, Any]]:
    """The whole turn as JSON calls, "; "-separated, after an optional <|python_tag|>; anything else: none."""
    rest, calls = text.strip().removeprefix(PYTHON_TAG).strip(), []
    while rest:
        try:
            call, end = _JSON.raw_decode(rest)
        except json.JSONDecodeError:
            return []
        if not _is_call(call) or not ("parameters" in call or "arguments" in call):
            return []
        calls.append(call)
        rest = rest[end:].strip().removeprefix(";").strip()
    return calls


def _mistral(text: str) -> list[dict[str, Any]]:
    """[TOOL_CALLS][{...}, ...], or [TOOL_CALLS]name[ARGS]{...} (repeated); after it only special tokens."""
    at = text.find(TOOL_CALLS)
    if at < 0:
        return []
    rest = text[at + len(TOOL_CALLS):].lstrip()
    try:
        if rest.startswith("["):
            calls, _ = _JSON.raw_decode(rest)
            return calls if isinstance(calls, list) and calls and all(map(_is_call, calls)) else []
        calls = []
        for part in rest.split(TOOL_CALLS):
            name, sep, arguments = part.partition(ARGS)
            if not sep or not name.strip():
                return []
            calls.append({"name": name.strip(), "arguments": _JSON.raw_decode(arguments.strip())[0]})
        return calls
    except json.JSONDecodeError:
        return []


@dataclass
class Reply:
    """One of the gateway's replies: the message it sent and the text it sampled (special tokens kept)."""

    message: dict[str, Any]
    raw: str
    end: str = ""
    """The raw text's closing special token (an EOS the template writes after the content), or ""."""
    tail: str = ""
    """The stop string left out of the message's content: the agent may send the content back with it added."""


def turn_end(tokenizer: Any, ids: list[int]) -> str:
    """A sampled turn's closing special token (its EOS), which a chat template writes after the message; "" where its
    last token is not special (`Reply.end`)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return tokenizer.decode(ids[-1:], skip_special_tokens=False) if ids and ids[-1] in special else ""


def render_conversation(tokenizer: Any, messages: Sequence[Any], tools: Any, replies: Sequence[Reply]
                        ) -> tuple[str, list[int]]:
    """`messages` through the chat template (with `tools`, and the generation prompt), the k-th assistant message
    replaced by the k-th reply's sampled text where it is that reply unchanged and the template writes its content
    as sent (module docstring); and the indices of the replies the agent changed."""
    same, changed, k = {}, [], 0  # same: message position -> the reply it is, unchanged
    for at, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "assistant":
            if k < len(replies) and _same_message(message, replies[k].message, replies[k].tail):
                same[at] = k
            elif k < len(replies):
                changed.append(k)
            k += 1
    if same:  # a template that writes an earlier turn otherwise (a reasoning model's cuts its reasoning) is followed
        from jinja2 import TemplateError  # (loaded already: chat templates are jinja)

        try:
            plain = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                  tools=tools or None)
        except (TemplateError, TypeError):  # it cannot write our replies as sent (a strict template): they stay ours
            plain = None
        same = {at: k for at, k in same.items() if plain is None or _content(messages[at]) in plain}
    marks = {at: (f"\u27e6lmrl-turn-{k}\u27e7", replies[k]) for at, k in same.items()}
    rendered = [{"role": "assistant", "content": marks[at][0]} if at in marks else m for at, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, tools=tools or None)
    for mark, reply in marks.values():
        if reply.end and reply.raw.endswith(reply.end) and mark + reply.end in text:
            text = text.replace(mark + reply.end, reply.raw, 1)
        else:
            text = text.replace(mark, reply.raw, 1)
    return text, changed


def _content(message: dict[str, Any]) -> str:
    """A message's text content ("" for none)."""
    content = _text(message.get("content"))
    return content if isinstance(content, str) else ""


def _same_message(sent: dict[str, Any], ours: dict[str, Any], tail: str = "") -> bool:
    """The agent sent back our reply as it was: the same content (None and "" alike; with the stop string `tail` added
    or not) and the same calls."""
    content, mine = _text(sent.get("content")) or None, ours.get("content") or None
    if content != mine and not (tail and content == (mine or "") + tail):
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


def turn_choice(text: str, ids: list[int], finished: bool, chat: bool, parse: Any, call_id: str,
                shown: str | None = None) -> dict[str, Any]:
    """One choice of a completion; a chat turn's tool calls (`parse`: the gateway's, when the request offered tools)
    in `tool_calls`, parsed from the whole `text`; the content, where no call was found, is `shown` (the text without
    the stop string that ended it, as the OpenAI API returns it; default: `text`)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop" if finished else "length", "token_ids": ids}
    if not chat:
        return choice
    content, calls = parse(text, ids, call_id) if parse else (text, [])
    content = shown if shown is not None and not calls else content
    choice["message"] = {"role": "assistant", "content": content}
    if calls:
        choice["message"]["tool_calls"] = calls
        choice["finish_reason"] = "tool_calls" if finished else "length"
    return choice
