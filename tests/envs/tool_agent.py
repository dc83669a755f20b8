"""A chat agent with tools, written elsewhere (tests/envs/test_gateway_tools.py): it offers an `add` tool over the
official `openai` client, runs the call the model makes, sends the result back as a `tool` message, asks for the
answer and reports the reward. AGENT_LOG gets one JSON line per episode: each turn's token ids and tool calls.
AGENT_STREAM=1 asks for every turn with `stream=True` and puts the message together from the chunks."""

import json
import os

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]



def streamed(**request):
    """The turn as server-sent chunks, put together: (message as a dict, finish_reason, token ids)."""
    content, calls, reason, ids = "", [], None, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += [c.model_dump(exclude={"index"}) for c in choice.delta.tool_calls or []]
            reason = choice.finish_reason or reason
            ids = (choice.model_extra or {}).get("token_ids") or ids
    message = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
    return message, reason, ids


def turn(**request):
    if os.environ.get("AGENT_STREAM") == "1":
        return streamed(**request)
    choice = client.chat.completions.create(**request).choices[0]
    return choice.message.model_dump(exclude_none=True), choice.finish_reason, choice.model_extra["token_ids"]


row = json.loads(os.environ["LMRL_ROW"])
client = OpenAI()
messages = [{"role": "user", "content": row["prompt"]}]
turns, calls, reasons = [], [], []
for _ in range(2):
    message, reason, ids = turn(model="policy", messages=messages, tools=TOOLS, max_tokens=40)
    turns.append(ids)
    reasons.append(reason)
    messages.append(message)  # sent back as the client gave it: content None, the parsed tool_calls
    for call in message.get("tool_calls") or []:
        arguments = json.loads(call["function"]["arguments"])
        calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": arguments})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(arguments["a"] + arguments["b"])})
    if not message.get("tool_calls"):
        break
with open(os.environ["AGENT_LOG"], "a") as f:
    f.write(json.dumps({"turns": turns, "calls": calls, "reasons": reasons, "answer": message["content"]}) + "\n")
client.post("/lmrl/reward", body={"reward": float(message["content"] == "5")}, cast_to=object)
