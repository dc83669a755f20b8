"""A verifiers environment the tests write themselves (tests/envs/test_verifiers.py): sums, one chat turn, an
exact-match rubric. Its harness runs in-process and calls the model through verifiers' interception endpoint with
the official `openai` client; VF_SUMS_LOG, when set, gets one JSON line per model call: the token ids it got.
VF_SUMS_BROKEN=1 makes the harness raise; VF_SUMS_STREAM=1 asks with `stream=True`."""

import asyncio
import json
import os
import weakref

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

SUMS = [("80+76=", "156"), ("28+2=", "30"), ("12+30=", "42"), ("47+5=", "52")]


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace) -> float:
        return float(str(trace.last_message.content).strip() == self.data.answer)

    @vf.reward(weight=0.25)
    async def digits(self, trace) -> float:
        return float(str(trace.last_message.content).strip().isdigit())


class Sums(vf.Taskset[SumTask]):
    def load(self):
        for prompt, answer in SUMS:
            yield SumTask(SumData(prompt=prompt, answer=answer))


_http = weakref.WeakKeyDictionary()  # one HTTP client per event loop (a step's), as a harness of many rollouts keeps


def http_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    if loop not in _http:
        _http[loop] = httpx.AsyncClient(timeout=120)
    return _http[loop]


class OneTurn(vf.Harness):
    """One chat completion: the task's prompt as a user message."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        if os.environ.get("VF_SUMS_BROKEN"):
            raise RuntimeError("the harness broke")
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, http_client=http_client())
        _, prompt = self.resolve_prompt(data)
        messages = [{"role": "user", "content": prompt}]
        if os.environ.get("VF_SUMS_STREAM"):  # through verifiers' relay of server-sent events
            ids = None
            async for chunk in await client.chat.completions.create(model=ctx.model, messages=messages, stream=True):
                ids = (chunk.choices[0].model_extra or {}).get("token_ids") or ids if chunk.choices else ids
        else:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            ids = reply.choices[0].model_extra["token_ids"]
        if os.environ.get("VF_SUMS_LOG"):
            with open(os.environ["VF_SUMS_LOG"], "a") as f:
                f.write(json.dumps({"prompt": prompt, "ids": ids}) + "\n")
        return ProgramResult(exit_code=0, stdout="", stderr="")


def load_environment():
    config = {"taskset": {"id": __name__}, "agent": {"runtime": {"type": "subprocess"}}}
    return vf.load_environment(vf.resolve_env_config(config))


__all__ = ["OneTurn", "Sums"]

