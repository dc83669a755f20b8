"""A verifiers environment with a tool, written by the tests (tests/envs/test_verifiers.py): the harness offers an
`add` function to the model as an OpenAI tool, runs the calls the model makes and sends the results back as `tool`
messages; the rubric rewards the right answer and, less, a tool call."""

import json

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


class AddData(vf.TaskData):
    answer: str = ""


class AddTask(vf.Task[AddData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace) -> float:
        return float(str(trace.last_message.content).strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def called_tool(self, trace) -> float:
        return float(any(m.role == "tool" for m in trace.messages))


class Adds(vf.Taskset[AddTask]):
    def load(self):
        yield AddTask(AddData(prompt="What is 2+3?", answer="5"))


class ToolLoop(vf.Harness):
    """Chat turns with `tools=`; each call the model makes is run here and answered with a `tool` message."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        client = AsyncOpenAI(base_url=endpoint, api_key=secret)
        _, prompt = self.resolve_prompt(data)
        messages = [{"role": "user", "content": prompt}]
        for _ in range(3):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                try:
                    result = str(add(**json.loads(call.function.arguments)))
                except (TypeError, ValueError) as e:  # the model's arguments: an error it reads
                    result = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return ProgramResult(exit_code=0, stdout="", stderr="")


def load_environment():
    config = {"taskset": {"id": __name__}, "agent": {"runtime": {"type": "subprocess"}}}
    return vf.load_environment(vf.resolve_env_config(config))


__all__ = ["Adds", "ToolLoop"]
