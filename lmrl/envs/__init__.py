"""Multi-turn environments and tools: episodes of model turns and observations.

An environment is anything that starts an episode from a dataset row; an episode takes the model's
turns one at a time:

    class Guess:                                   # an Environment: Guess(row) starts an episode
        def __init__(self, row):
            self.target, self.tries = int(row["answer"]), 0

        def step(self, text, token_ids):           # the model's turn -> Step
            self.tries += 1
            if str(self.target) in text:
                return Step(reward=1.0, done=True)
            return Step(observation="\\nNo, try again: ", done=self.tries == 3)

The rollout (`lmrl.rollout.multiturn.generate_episodes`) appends each observation's tokens to the
sequence (trained on: no) and samples the next turn, for every live episode of the batch at once,
until the episode is done, `env.max_turns` turns were taken or the token budget is spent. A
single-turn reward is the one-step case: an episode whose first step says done. The episode's
reward is the sum of its steps' rewards (None when no step gave one); it reaches the reward
functions as the `env_reward` column and the built-in `env` reward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lmrl.envs.tools import (
    HERMES_PATTERN,
    Tool,
    ToolCall,
    ToolOutcome,
    Tools,
    parse_tool_calls,
    python_tool,
    tool_schema,
    tools_from,
)


@dataclass
class Step:
    """What the environment answers to one model turn.

    Attributes:
        observation: text appended after the model's turn (ignored when done), or a list of chat messages
            (e.g. [{"role": "tool", "content": "5"}]) rendered with the tokenizer's chat template.
        reward: added to the episode's reward; None adds nothing.
        done: the episode ends after this turn.
        info: counts summed into the step's metrics (`env/<key>`), e.g. tool_calls, tool_errors.
        images: what the observation shows, in order (PIL images, encoded bytes or paths), for a vision-language
            policy: the observation holds the processor's image token once per image (a string) or an
            `{"type": "image"}` part per image (chat messages); the images are the episode's from there on.
    """

    observation: str | list[dict[str, Any]] | None = None
    reward: float | None = None
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)
    images: list[Any] | None = None


@runtime_checkable
class Episode(Protocol):
    """One episode: takes the model's turn (its text and token ids) and answers with a Step."""

    def step(self, text: str, token_ids: list[int]) -> Step: ...


Environment = Callable[[Mapping[str, Any]], Episode]
"""Starts an episode from a dataset row: a class whose constructor takes the row is one."""


class ToolEnvironment:
    """The built-in tool-use environment: each turn's tool calls are run and their outputs are the observation;
    a turn without a tool call ends the episode (its text is the answer the reward functions score).

    Args:
        tools: the Tools the model may call.
        pattern: the tool-call regex (`parse_tool_calls`); Hermes / Qwen by default.
        response_format: how the outputs of one turn's calls are shown to the model: a string with `{output}`
            (plain-text models), or "chat": a `tool` message per call, rendered with the chat template.
        stop: strings that end a model turn (the end of a tool call), added to the rollout's own stop strings;
            None: "</tool_call>" with the Hermes pattern, none with another.
    """

    def __init__(self, tools: Tools, pattern: str = HERMES_PATTERN,
                 response_format: str = "<tool_response>\n{output}\n</tool_response>\n",
                 stop: list[str] | None = None) -> None:
        if response_format != "chat" and "{output}" not in response_format:
            raise ValueError(f"env.response_format: expected 'chat' or a string with {{output}}, got {response_format!r}")
        self.tools, self.pattern, self.response_format = tools, pattern, response_format
        self.stop = list(stop) if stop is not None else (["</tool_call>"] if pattern == HERMES_PATTERN else [])

    def __call__(self, row: Mapping[str, Any]) -> _ToolEpisode:
        return _ToolEpisode(self)


class _ToolEpisode:
    def __init__(self, env: ToolEnvironment) -> None:
        self.env = env

    def step(self, text: str, token_ids: list[int]) -> Step:
        env = self.env
        calls, problems = parse_tool_calls(text, env.pattern)
        if not calls and not problems:
            return Step(done=True)
        kills_before = _sandbox_kills(env.tools)
        outcomes = [env.tools.call(c) for c in calls]
        outputs = problems + [o.text for o in outcomes]
        info = {"tool_calls": float(len(calls) + len(problems)), "malformed_calls": float(len(problems)),
                "tool_errors": float(sum(o.error for o in outcomes)), "tool_seconds": sum(o.seconds for o in outcomes),
                "sandbox_kills": float(_sandbox_kills(env.tools) - kills_before)}
        if env.response_format == "chat":
            return Step(observation=[{"role": "tool", "content": out} for out in outputs], info=info)
        return Step(observation="".join(env.response_format.format(output=out) for out in outputs), info=info)


def _sandbox_kills(tools: Tools) -> int:
    return sum(int(getattr(t.fn, "stats", {}).get("kills", 0)) for t in tools.tools.values())


def env_reward(prompts: list[Any], completions: list[str], **kwargs: Any) -> list[float | None]:
    """The built-in `env` reward: the episode's own reward (the sum of its steps' rewards; None if none gave one),
    which the multi-turn rollout passes as the `env_reward` keyword."""
    if "env_reward" not in kwargs:
        raise ValueError("env reward: no env_reward given; it scores multi-turn episodes (set env.name)")
    return list(kwargs["env_reward"])


__all__ = [
    "HERMES_PATTERN",
    "Environment",
    "Episode",
    "Step",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolOutcome",
    "Tools",
    "env_reward",
    "parse_tool_calls",
    "python_tool",
    "tool_schema",
    "tools_from",
]
