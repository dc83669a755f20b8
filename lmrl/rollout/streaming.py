"""`stream: true`: a completion's answer as OpenAI's server-sent events, as the official clients consume them.

    events = stream_events(response, chat=True, usage=True)    # the non-streaming answer, as chunks

Generation is batched (`lmrl.rollout.batcher`): a request's completions are sampled whole, then sent as events.
So a streamed request records exactly the tokens a plain one would, and its first event comes when its
completion is done, not token by token. Per choice: a first chunk (chat: the role), its text in one chunk
(with its log-probs when asked for), its tool calls (chat), and a last chunk with `finish_reason` and the
choice's `token_ids`; with `stream_options.include_usage`, a chunk of usage; then `data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import Any


class Events(list):
    """Chunks to send as `data: {json}` events, then `data: [DONE]` (what a handler answers for `stream: true`)."""

    def encode(self) -> bytes:
        return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in self) + b"data: [DONE]\n\n"


def wants_stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ValueError(f"stream: expected true or false, got {json.dumps(stream)[:40]}")
    return bool(stream)


def stream_events(response: dict[str, Any], chat: bool, body: dict[str, Any]) -> Events:
    """The chunks of a finished completions (`chat` False) or chat completions `response` (module docstring)."""
    head = {"id": response["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": response["created"], "model": response["model"]}
    events = Events()

    def chunk(choice: dict[str, Any]) -> None:
        events.append({**head, "choices": [choice]})

    for choice in response["choices"]:
        i = choice["index"]
        if chat:
            message = choice["message"]
            chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
            if message.get("content"):
                chunk({"index": i, "delta": {"content": message["content"]}, "logprobs": choice.get("logprobs"),
                       "finish_reason": None})
            if message.get("tool_calls"):
                calls = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
                chunk({"index": i, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None})
            chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"],
                   "token_ids": choice.get("token_ids")})
        else:
            chunk({"index": i, "text": choice["text"], "logprobs": choice.get("logprobs"), "finish_reason": None})
            chunk({"index": i, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"],
                   "token_ids": choice.get("token_ids")})
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        events.append({**head, "choices": [], "usage": response.get("usage")})
    return events
