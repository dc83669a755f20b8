"""verifiers environments (`env.name=verifiers:MODULE`, PyPI `verifiers`, `pip install lmrl[agents]`) driven
through the recording gateway.

    env.name=verifiers:my_env          # my_env.load_environment() returns a verifiers Env (verifiers.v1.Env)
    env.name=verifiers:path/to/env.py

The environment's taskset gives the prompts (one dataset row per task: its system prompt and prompt as chat
messages), its own rollout (`Env.run_episode`: the harness, verifiers' interception server, the task's tools)
runs against the gateway's per-episode endpoint (`lmrl.agents.gateway.Gateway`), so the tokens trained on are
exactly the tokens sampled, and its rubric scores the episode: the reward is the weighted sum of the task's
`@vf.reward` functions (verifiers' `Trace.reward`), each function's score logged as `verifiers/<name>`.

Episodes run in this process, in one asyncio loop per step, at most `env.max_parallel` at a time. An episode
fails as an agent's does (`lmrl.agents.programs`): when verifiers reports an error for it (the harness, the
scoring), when no reward function scored it, or past `env.timeout`.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lmrl.agents.gateway import SESSIONS, Gateway, _Episode
from lmrl.agents.programs import AgentEnvironment
from lmrl.errors import ConfigError
from lmrl.rollout.base import Generator, SamplingParams
from lmrl.rollout.multiturn import Episodes
from lmrl.user_code import load_function

PREFIX = "verifiers:"
EXTRA = "pip install 'lmrl[agents]' (verifiers==0.4.0)"


def _verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(f"env.name: verifiers environments need the verifiers package: {EXTRA} ({e})") from None
    return vf


def load_verifiers_environment(spec: str) -> Any:
    """`verifiers:MODULE` (a module name or a file.py): MODULE.load_environment(), checked to be a verifiers Env."""
    module = spec.removeprefix(PREFIX)
    if not module:
        raise ConfigError(f"env.name: {spec!r}: expected verifiers:MODULE, a module or file.py with load_environment()")
    what = f"env.name: verifiers environment {spec!r}"
    vf = _verifiers()
    try:
        load = load_function(f"{module}:load_environment", "verifiers environment")
    except ConfigError as e:
        raise ConfigError("env.name: " + str(e).replace(repr(f"{module}:load_environment"), repr(spec), 1)) from None
    try:
        env = load()
    except Exception as e:  # noqa: BLE001 - the user's code: one line
        raise ConfigError(f"{what}: load_environment() raised {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    if not isinstance(env, vf.Env):
        raise ConfigError(f"{what}: load_environment() returned a value of type {type(env).__name__!r}, expected a "
                          "verifiers Env (verifiers.v1.Env, e.g. vf.load_environment(config))")
    return env


def verifiers_environment(env: Any, timeout: float, on_error: str, max_parallel: int,
                          tool_format: str = "auto") -> VerifiersEnvironment:
    """`env`, a verifiers Env or `verifiers:MODULE` (what `env.name` says), as lmrl's environment."""
    if isinstance(env, str):
        env = load_verifiers_environment(env)
    return VerifiersEnvironment(env, timeout, on_error, max_parallel, tool_format)


class VerifiersEnvironment(AgentEnvironment):
    """A verifiers Env as an lmrl environment (module docstring); its `rows()` are the run's dataset."""

    field = "env.name"

    def __init__(self, env: Any, timeout: float = 120.0, on_error: str = "fail", max_parallel: int = 32,
                 tool_format: str = "auto"):
        vf = _verifiers()
        if not isinstance(env, vf.Env):
            raise ConfigError(f"env: expected a verifiers Env (verifiers.v1.Env), got {type(env).__name__}")
        super().__init__("verifiers", timeout, on_error, max_parallel, tool_format=tool_format)
        self.env, self.vf = env, vf
        if not env.taskset.bounded:
            raise ConfigError(f"env: the verifiers environment's taskset {type(env.taskset).__name__} is endless; "
                              "bound it (taskset.take(n)) to train on it")
        self.tasks = list(env.taskset)
        if not self.tasks:
            raise ConfigError(f"env: the verifiers environment's taskset {type(env.taskset).__name__} has no tasks")
        self._scores: dict[str, dict[str, float]] = {}

    def rows(self) -> list[dict[str, Any]]:
        """One dataset row per task: `prompt` its chat messages, `vf_task` its index, `answer` where it has one."""
        from verifiers.v1.dialects.chat import message_to_wire

        out = []
        for i, task in enumerate(self.tasks):
            data = task.data
            messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
            if isinstance(data.prompt, str):
                messages.append({"role": "user", "content": data.prompt})
            else:
                messages += [message_to_wire(m) for m in data.prompt or []]
            row = {"prompt": messages, "vf_task": i}
            if getattr(data, "answer", None) is not None:
                row["answer"] = str(data.answer)
            out.append(row)
        return out

    def run_episodes(self, generator: Generator, tokenizer: Any, prompts: list[list[int]],
                     rows: Sequence[Mapping[str, Any]], n: int, params: SamplingParams, max_turns: int,
                     max_tokens: int | None) -> Episodes:
        self._scores = {}
        episodes = super().run_episodes(generator, tokenizer, prompts, rows, n, params, max_turns, max_tokens)
        names = sorted({name for scores in self._scores.values() for name in scores})
        for name in names:  # each reward function's mean over the episodes it scored
            values = [s[name] for s in self._scores.values() if name in s]
            episodes.metrics[f"verifiers/{name}"] = sum(values) / max(len(values), 1)
        return episodes

    def _run(self, gateway: Gateway, episodes: dict[str, _Episode]) -> None:
        """Every episode through the environment's own rollout, against the gateway: one client config for the
        step (verifiers builds one HTTP client per config), each request naming its episode by its trace's id
        (`X-Session-ID`, which verifiers sends), mapped as each trace is minted."""
        var = f"LMRL_VERIFIERS_KEY_{id(gateway)}"
        os.environ[var] = gateway.session_key  # verifiers reads a key by variable
        client = self.vf.EvalClientConfig(base_url=f"{gateway.url}/episodes/{SESSIONS}/v1", api_key_var=var)
        try:
            asyncio.run(self._all(gateway, episodes, client))
        finally:
            os.environ.pop(var, None)
            for session in [s for s, eid in gateway.sessions.items() if eid in episodes]:
                gateway.sessions.pop(session, None)

    async def _all(self, gateway: Gateway, episodes: dict[str, _Episode], client: Any) -> None:
        gate = asyncio.Semaphore(self.max_parallel)

        async def one(eid: str, e: _Episode) -> None:
            async with gate:
                await self._one(gateway, eid, e, client)

        async with self.env.serving():
            await asyncio.gather(*(one(eid, e) for eid, e in episodes.items()))
        gc.collect()  # clients a harness left open close now, while their loop still runs (not on a closed one)
        await asyncio.sleep(0.01)

    async def _one(self, gateway: Gateway, eid: str, e: _Episode, client: Any) -> None:
        task = self.tasks[int(e.row["vf_task"])]
        ctx = self.vf.ModelContext(model=gateway.name, client=client)

        def minted(trace: Any) -> None:  # a retried agent mints a new trace: it maps to the same episode
            gateway.sessions[trace.id] = eid

        try:
            episode = await asyncio.wait_for(self.env.run_episode(task, ctx, on_trace=minted), self.timeout)
        except TimeoutError:
            e.error = f"ran past env.timeout={self.timeout:g}s and was stopped"
            return
        errors = [err for t in episode.traces for err in t.errors] + list(episode.errors)
        scores = {name: r.score for t in episode.traces for name, r in t.rewards.items() if r is not None}
        self._scores[eid] = scores
        with e.lock:
            if errors:
                e.error = f"verifiers: {errors[0].type}: {' '.join(errors[0].message.split())[:300]}"
            elif not scores:
                e.error = "verifiers: no reward function scored the episode (the task has no @vf.reward)"
            else:
                reward = sum(t.reward for t in episode.traces)
                if not math.isfinite(reward):
                    e.error = f"verifiers: the rubric gave a reward of {reward}, not a finite number"
                else:
                    e.reward = float(reward)
