"""A chat agent with tools, written elsewhere (tests/envs/test_gateway_tools.py): it offers an `add` tool over the
official `openai` client, runs the call the model makes, sends the result back as a `tool` message, asks for the
answer and reports the reward. AGENT_LOG gets one JSON line per episode: each turn's token ids and tool calls."""

import json
import os

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]

row = json.loads(os.environ["LMRL_ROW"])
client = OpenAI()
messages = [{"role": "user", "content": row["prompt"]}]
turns, calls, reasons = [], [], []
for _ in range(2):
    choice = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=40).choices[0]
    turns.append(choice.model_extra["token_ids"])
    reasons.append(choice.finish_reason)
    messages.append(choice.message)  # sent back as the client gives it: content None, the parsed tool_calls
    for call in choice.message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        calls.append({"id": call.id, "name": call.function.name, "arguments": arguments})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
    if not choice.message.tool_calls:
        break
with open(os.environ["AGENT_LOG"], "a") as f:
    f.write(json.dumps({"turns": turns, "calls": calls, "reasons": reasons, "answer": choice.message.content}) + "\n")
client.post("/lmrl/reward", body={"reward": float(choice.message.content == "5")}, cast_to=object)
