"""An environment whose episodes are driven by a program written elsewhere (`env.name=agent`): the recording gateway.

    env.name=agent env.command="python my_agent.py" env.timeout=60

For each episode lmrl starts the command with, in its environment:

    OPENAI_BASE_URL   the episode's own endpoint, http://127.0.0.1:PORT/episodes/ID/v1
    OPENAI_API_KEY    the episode's key (the official `openai` client reads both variables)
    LMRL_ROW          the dataset row, as JSON

The agent calls `/v1/completions` (the prompt so far, as text) or `/v1/chat/completions` (the messages so
far) and ends by reporting the episode's reward: `POST {OPENAI_BASE_URL}/lmrl/reward {"reward": 1.0}` with its
key (`client.post("/lmrl/reward", body={"reward": 1.0}, cast_to=object)`), then exits 0.

The gateway (`Gateway`) serves the live policy, requests of all episodes batched together (`lmrl.rollout.batcher`:
with lmrl's decode a request joins the running decode at its next step), and records per episode exactly the token ids it sampled and their log-probs. When
the agent sends the conversation so far, the gateway matches it against the episode's own record (the prompt,
the sampled tokens, the observations it already tokenized) and tokenizes only what is new: tool results, user
turns, a chat template's markup. The model's output is never tokenized again. Where the agent changed the
model's earlier text, the record is cut at the first token that no longer matches; the dropped sampled tokens
are counted (`agent/retokenized_tokens`) and the agent's version of that text is attended but never trained on.

An episode fails (counted in `agent/failures`, logged, nothing of it trained on, reward 0; with
`reward.on_error=fail` the run stops with one line) when its program exits non-zero, exits without a reward,
reports a non-finite one, or outlives `env.timeout` (it and its children are killed).

`env.agent_mode=batch` starts the command once for all the episodes of a call (a step's batch, an evaluation)
instead, which saves a program's start-up per episode (a Python interpreter, importing `openai`). Its environment has LMRL_EPISODES, the path of a JSONL file (readable by the trainer's user only) with a
line per episode: {"index", "base_url", "api_key", "row"}; it runs them as it likes (threads, asyncio), each against
its own base URL with its own key, reports each reward at that episode's /lmrl/reward, and exits 0, within
`env.timeout` for the whole batch. The per-episode keys stay: one episode's key reaches only its own episode.
`env.agent_mode=persistent` starts it once per run (the start-up once, not per step): each batch's file path comes
as a line on its stdin, the batch is over once every episode has reported its reward, and at the end of its stdin
(the run is over) the program ends. `env.agent_mode=serve` starts no program: programs that run on their own ask
the gateway for episodes with the run key (`lmrl.rollout.agent_work`).

Each chat turn's tool calls are parsed in the model family's format (`lmrl.rollout.chat_turns`: Hermes, Llama 3's
JSON, Mistral's [TOOL_CALLS]; `model.tool_call_format`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmrl.errors import ConfigError, RunError
from lmrl.rollout.agent_work import (
    WORK,
    WorkQueue,
    authorize_run,
    end_work,
    episodes_file,
    hand_out,
    run_served,
    write_work_file,
)
from lmrl.rollout.base import Generator, Rollout, SamplingParams
from lmrl.rollout.batcher import Batcher, thread_precision
from lmrl.rollout.chat_turns import Reply, render_conversation, turn_choice
from lmrl.rollout.multiturn import Episodes, _metrics
from lmrl.rollout.server import (
    GenerationServer,
    Refused,
    _given,
    _Handler,
    _integer,
    _list,
    _same,
    is_loopback,
)
from lmrl.rollout.streaming import stream_events, wants_stream


@dataclass
class _Segment:
    """A run of the episode's tokens: the prompt, a sampled turn (trained on) or an observation (attended only)."""

    ids: list[int]
    logps: list[float]
    trained: bool
    text: str
    """As the agent sees it in a completion (special tokens skipped)."""
    raw: str
    """As a chat template renders it (special tokens kept)."""
    message: dict[str, Any] | None = None
    """A sampled turn's reply as the gateway sent it (chat): recognized when the agent sends it back."""


@dataclass
class _Episode:
    index: int
    key: str
    row: Mapping[str, Any]
    segments: list[_Segment]
    params: SamplingParams
    max_turns: int
    budget: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    turns: int = 0
    finished: bool = False
    reward: float | None = None
    retokenized: int = 0
    error: str | None = None
    handed: bool = False
    """env.agent_mode=serve: a program took it."""

    def known(self, chat: bool) -> str:
        return "".join(s.raw if chat else s.text for s in self.segments)

    def response_length(self) -> int:
        return sum(len(s.ids) for s in self.segments[1:])


class Gateway(GenerationServer):
    """The live policy at one OpenAI-compatible endpoint per episode (module docstring); on loopback, unless
    env.agent_mode=serve listens elsewhere with a run key of the user's (`lmrl.rollout.agent_work`)."""

    def __init__(self, generator: Generator, tokenizer: Any, name: str = "lmrl-policy", host: str = "127.0.0.1",
                 port: int = 0, run_key: str | None = None, tool_format: str = "auto"):
        super().__init__(generator, tokenizer, name, host=host, port=port, api_key=run_key, tool_format=tool_format)
        self.RequestHandlerClass = _GatewayHandler
        # env.agent_mode=serve: programs that run on their own ask for episodes with the run key (`agent_work`)
        self.run_key, self.work = run_key, WorkQueue()
        self.public_url: str | None = None  # where programs reach it, when not where it listens (env.agent_url)
        self.episodes: dict[str, _Episode] = {}
        # an in-process client of many episodes (verifiers': one per step) names each in its X-Session-ID header
        self.sessions: dict[str, str] = {}  # session id -> episode id, kept by whoever runs the episodes
        self.session_key = "lmrl-sessions-" + secrets.token_urlsafe(24)  # never handed to an agent program
        threading.Thread(target=self.serve_forever, name="lmrl-gateway", daemon=True).start()

    def episode_url(self, episode_id: str) -> str:
        return f"{self.public_url or self.url}/episodes/{episode_id}/v1"

    def retarget(self, generator: Generator) -> None:
        """Serve another generator at the same address (env.agent_mode=serve: programs keep their work URL)."""
        with self.lock:
            self.generator = generator
            self.batcher = Batcher(generator, self.lock, max_sequences=self.limits.max_sequences)

    def spec(self, episode_id: str) -> dict[str, Any]:
        """What a program needs to run an episode: {"index", "base_url", "api_key", "row"}."""
        e = self.episodes[episode_id]
        return {"index": e.index, "base_url": self.episode_url(episode_id), "api_key": e.key, "row": dict(e.row)}

    def complete(self, episode: _Episode, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        """One model turn of `episode`: the agent's conversation matched to the record, the new part tokenized."""
        if _given(body, "n", 1) != 1:
            raise ValueError("n: an episode is one sequence; the gateway samples n=1")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else _list(stop, "stop")
        with episode.lock:
            if episode.reward is not None:
                raise Refused(409, "episode: its reward was reported; it takes no more requests", "episode_over")
            if episode.turns >= episode.max_turns:
                raise Refused(400, f"episode: {episode.turns} model turns taken, env.max_turns={episode.max_turns}",
                              "episode_budget")
            self._extend(episode, self._conversation(body, chat, episode), chat)
            room = int(min(episode.budget - episode.response_length(), episode.params.max_new_tokens))
            if room < 1:
                raise Refused(400, f"episode: its {episode.budget:g} response tokens are spent (env.max_tokens)",
                              "episode_budget")
            asked = _integer(_given(body, "max_tokens", _given(body, "max_completion_tokens", room)), "max_tokens", 0, "")
            # the run's own sampling (the log-probs the trainer assumes); unseeded, so episodes share calls
            params = dataclasses.replace(episode.params, max_new_tokens=min(asked, room), seed=None,
                                         stop=[*episode.params.stop, *[s for s in stop if s not in episode.params.stop]])
            context = [t for s in episode.segments for t in s.ids]
            rows = self.batcher.generate([context], 1, params)
            ids, logps = rows.tokens[0], rows.logprobs[0]
            raw = self.tokenizer.decode(ids, skip_special_tokens=False)
            choice = turn_choice(rows.texts[0], ids, rows.finished[0], chat, body.get("tools") and self.tool_calls,
                             f"call-{episode.index}-{episode.turns}")
            episode.segments.append(_Segment(ids, logps, True, rows.texts[0], raw, choice.get("message")))
            episode.turns += 1
            episode.finished = rows.finished[0]
        text = rows.texts[0]
        if not chat:
            choice["text"] = text
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{episode.index}-{episode.turns}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.name, "choices": [choice],
                "usage": {"prompt_tokens": len(context), "completion_tokens": len(ids), "total_tokens": len(context) + len(ids)}}

    def _conversation(self, body: dict[str, Any], chat: bool, episode: _Episode) -> str:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages: expected a non-empty list of {role, content}")
            replies = [Reply(s.message, s.raw, self._end(s.ids)) for s in episode.segments if s.message is not None]
            return render_conversation(self.tokenizer, messages, body.get("tools"), replies)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("prompt: the gateway takes the conversation so far as one string")
        return prompt

    def _extend(self, episode: _Episode, text: str, chat: bool) -> None:
        """Match `text` to the episode's record; cut the record where they part; tokenize only the rest."""
        known = episode.known(chat)
        if not text.startswith(known) and chat and not any(s.trained for s in episode.segments):
            self._rebase(episode, text)  # before the first turn: the agent's own rendering (its tools, its system)
            known = episode.known(chat)
        if not text.startswith(known):
            prompt = episode.segments[0].raw if chat else episode.segments[0].text
            if not text.startswith(prompt):
                raise Refused(400, "episode: the conversation does not start with the row's prompt "
                              f"({prompt[:60]!r}); the agent must send its prompt as given", "prompt_changed")
            kept, at = [episode.segments[0]], len(prompt)
            for seg in episode.segments[1:]:
                whole = seg.raw if chat else seg.text
                if text.startswith(whole, at):
                    kept.append(seg)
                    at += len(whole)
                    continue
                k = 0  # the longest run of this segment's tokens the agent kept as they were
                while k < len(seg.ids) and text.startswith(self._decode(seg.ids[:k + 1], chat), at):
                    k += 1
                if k and seg.trained:
                    part = self._decode(seg.ids[:k], chat)
                    kept.append(_Segment(seg.ids[:k], seg.logps[:k], True, part, part))
                    at += len(part)
                break
            dropped = sum(len(s.ids) for s in episode.segments if s.trained) - sum(len(s.ids) for s in kept if s.trained)
            episode.retokenized += dropped
            episode.segments, known = kept, text[:at]
        new = text[len(known):]
        if new:
            ids = self.tokenizer(new, add_special_tokens=False)["input_ids"]
            episode.segments.append(_Segment(ids, [0.0] * len(ids), False, new, new))

    def _rebase(self, episode: _Episode, text: str) -> None:
        """The episode's prompt becomes the agent's first chat request as rendered (the row's messages with the
        tools it offers, a system prompt of its own): prompts are attended, never trained on."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        episode.segments = [_Segment(ids, [0.0] * len(ids), False, self._decode(ids, False), text)]

    def _end(self, ids: list[int]) -> str:
        """The closing special token of a sampled turn (its EOS), which a chat template writes after a message."""
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        return self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ids and ids[-1] in special else ""

    def _decode(self, ids: list[int], chat: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not chat)

    def report(self, episode: _Episode, body: dict[str, Any]) -> dict[str, Any]:
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            with episode.lock:
                episode.error = f"reported a reward of {json.dumps(reward)[:40]}, not a finite number"
            raise ValueError(f"reward: expected a finite number, got {json.dumps(reward)[:40]}")
        with episode.lock:
            episode.reward = float(reward)
        return {"ok": True}


SESSIONS = "by-session"  # /episodes/by-session/v1/...: the episode named by the X-Session-ID header


class _GatewayHandler(_Handler):
    """Requests under /episodes/ID/v1/..., each with that episode's key (another episode's: 403)."""

    server: Gateway
    episode: _Episode
    route: str

    def _authorize(self) -> None:
        if self.path == WORK:  # env.agent_mode=serve's programs, with the run key
            self.route = authorize_run(self.server, self.headers)
            return None
        parts = self.path.split("/", 3)  # "", "episodes", ID, "v1/..."
        if len(parts) == 4 and parts[1] == "episodes" and parts[2] == SESSIONS:
            return self._authorize_session(parts[3])
        if len(parts) < 4 or parts[1] != "episodes" or parts[2] not in self.server.episodes:
            raise Refused(404, f"no such episode: {self.path[:80]} (the gateway serves /episodes/ID/v1/...)")
        episode = self.server.episodes[parts[2]]
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if not _same(token, episode.key):
            if any(_same(token, e.key) for e in self.server.episodes.values()):
                raise Refused(403, "authorization: this key belongs to another episode", "wrong_episode")
            raise Refused(401, "authorization: a missing or wrong key: send the episode's OPENAI_API_KEY", "invalid_api_key")
        self.episode, self.route = episode, "/" + parts[3]

    def _authorize_session(self, route: str) -> None:
        """/episodes/by-session/v1/...: the gateway's session key, and an X-Session-ID its `sessions` map to a live
        episode (`lmrl.rollout.verifiers_env`: one HTTP client per step instead of one per episode)."""
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if not _same(token.strip() if scheme.lower() == "bearer" else "", self.server.session_key):
            raise Refused(401, "authorization: a missing or wrong key: send the episode's OPENAI_API_KEY", "invalid_api_key")
        eid = self.server.sessions.get(self.headers.get("X-Session-ID", ""))
        if eid is None or eid not in self.server.episodes:
            raise Refused(404, f"no such session: {self.headers.get('X-Session-ID', '')[:40]!r} (X-Session-ID names "
                          "a live episode's session)")
        self.episode, self.route = self.server.episodes[eid], "/" + route

    def _get(self) -> dict[str, Any]:
        if self.route == "/v1/models":
            return {"object": "list", "data": [{"id": self.server.name, "object": "model", "created": 0, "owned_by": "lmrl"}]}
        raise Refused(404, f"no such endpoint: GET {self.route}")

    def _post(self) -> dict[str, Any]:
        if self.route == WORK:  # a long poll: not a request that generates (the batcher does not wait for it)
            request = json.loads(self._body(self.server.limits.max_body_bytes).read(1 << 62) or b"{}")
            if not isinstance(request, dict):
                raise ValueError(f"body: expected a JSON object, got {type(request).__name__}")
            return hand_out(self.server, request)
        if self.route not in ("/v1/completions", "/v1/chat/completions", "/v1/lmrl/reward"):
            raise Refused(404, f"no such endpoint: POST {self.route}")
        with self.server.batcher.incoming():
            request = json.loads(self._body(self.server.limits.max_body_bytes).read(1 << 62) or b"{}")
            if not isinstance(request, dict):
                raise ValueError(f"body: expected a JSON object, got {type(request).__name__}")
            if self.route == "/v1/lmrl/reward":
                return self.server.report(self.episode, request)
            chat, stream = self.route.endswith("chat/completions"), wants_stream(request)
            answer = self.server.complete(self.episode, request, chat=chat)
            return stream_events(answer, chat, request) if stream else answer


class AgentEnvironment:
    """`env.name=agent`: each episode is one run of `command` against the gateway (module docstring).

    Args:
        command: the agent's command line (split as a shell would; run without a shell).
        timeout: seconds one episode's program may run before it is killed and the episode fails.
        on_error: "fail": a failed episode stops the run with one line; "zero": it is counted and scores 0.
        max_parallel: the most programs running at once (an evaluation of 500 prompts starts them in turn).
        cwd: where the program runs (the current directory by default).
        mode: "episode": a run of the command per episode; "batch": one run for all the episodes of a call, each
            episode's URL, key and row in the file LMRL_EPISODES names (module docstring); "persistent": one run
            for the whole run, each call's episodes file named by a line on its stdin. `timeout` is then the call's.
            "serve": no command; programs of yours ask for episodes (`lmrl.rollout.agent_work`).
        host, port: where the gateway listens (mode "serve"; otherwise loopback, a free port). Beyond loopback
            the run key must be yours, in the LMRL_AGENT_KEY environment variable.
        tool_format: how the model writes tool calls (`lmrl.rollout.chat_turns.FORMATS`, "auto": its template's).
        work_file: mode "serve": where the work URL and the run key are written (`<output_dir>/agent.json`).
        url: mode "serve": the gateway as programs reach it (a proxy, a tunnel, the machine's name), for agent.json
            and the episodes' base URLs; None: where it listens.
    """

    field = "env.command"  # what a failed episode's line names

    def __init__(self, command: str | None, timeout: float = 120.0, on_error: str = "fail", max_parallel: int = 32,
                 cwd: str | None = None, mode: str = "episode", host: str = "127.0.0.1", port: int = 0,
                 work_file: str | os.PathLike | None = None, tool_format: str = "auto", url: str | None = None):
        if mode not in ("episode", "batch", "persistent", "serve"):
            raise ValueError(f"env.agent_mode: expected 'episode', 'batch', 'persistent' or 'serve', got {mode!r}")
        self.argv = shlex.split(command or "")
        if not self.argv and mode != "serve":
            raise ValueError("env.command: empty")
        self.command, self.timeout, self.on_error, self.cwd = command, timeout, on_error, cwd
        self.max_parallel, self.mode, self.host, self.port, self.url = max_parallel, mode, host, port, url
        self.tool_format = tool_format  # the model family's tool calls (`lmrl.rollout.chat_turns`)
        self.run_key = None
        if mode == "serve":
            self.field = "env.agent_mode=serve"
            self.work_file = Path(work_file or "agent.json")
            self.run_key = os.environ.get("LMRL_AGENT_KEY") or None
            if self.run_key is None and not is_loopback(host):
                raise ConfigError(f"env.agent_host: {host}: listening beyond loopback needs a run key of yours, in the "
                                  "LMRL_AGENT_KEY environment variable; or listen on 127.0.0.1")
            self.run_key = self.run_key or "lmrl-run-" + secrets.token_urlsafe(24)
        self._program: subprocess.Popen | None = None  # env.agent_mode=persistent: the run's program
        self._folder: str | None = None
        atexit.register(self.close)
        self._gateway: Gateway | None = None

    def __call__(self, row: Mapping[str, Any]) -> Any:
        raise RunError("env.name=agent: its episodes are run by its own program, not step by step")

    def gateway(self, generator: Generator, tokenizer: Any) -> Gateway:
        if self._gateway is not None and self._gateway.generator is not generator and self.mode == "serve":
            self._gateway.retarget(generator)  # programs keep the work URL they were given
        if self._gateway is None or self._gateway.generator is not generator:
            if self._gateway is not None:
                self._gateway.shutdown()
            self._gateway = Gateway(generator, tokenizer, host=self.host, port=self.port, run_key=self.run_key,
                                    tool_format=self.tool_format)
            self._gateway.public_url = self.url
            if self.mode == "serve":
                write_work_file(self.work_file, self.url or self._gateway.url, self.run_key)
        return self._gateway

    def run_episodes(self, generator: Generator, tokenizer: Any, prompts: list[list[int]],
                     rows: Sequence[Mapping[str, Any]], n: int, params: SamplingParams, max_turns: int,
                     max_tokens: int | None) -> Episodes:
        """`n` episodes per prompt, every episode's program at once; what `generate_episodes` returns."""
        gateway = self.gateway(generator, tokenizer)
        budget = max_tokens if max_tokens is not None else max_turns * params.max_new_tokens
        episodes: dict[str, _Episode] = {}
        for i in range(len(prompts) * n):
            p = prompts[i // n]
            seg = _Segment(list(p), [0.0] * len(p), False, tokenizer.decode(p, skip_special_tokens=True),
                           tokenizer.decode(p, skip_special_tokens=False))
            episodes[secrets.token_hex(8)] = _Episode(i, "lmrl-ep-" + secrets.token_urlsafe(24), rows[i // n], [seg],
                                                      params, max_turns, budget)
        gateway.episodes.update(episodes)
        gateway.batcher.precision = thread_precision()  # the trainer's autocast, as its own rollouts get
        try:
            if self.mode == "serve":
                run_served(gateway, episodes, self.timeout, self.work_file)
            else:
                {"batch": self._run_batch, "persistent": self._run_persistent}.get(self.mode, self._run)(gateway, episodes)
        finally:
            for eid in episodes:
                gateway.episodes.pop(eid, None)
        ordered = sorted(episodes.values(), key=lambda e: e.index)
        failed = [e for e in ordered if e.error is not None]
        if failed and self.on_error == "fail":
            e = failed[0]
            raise RunError(f"{self.field}: episode {e.index} (row {e.index // n}) {e.error} ({len(failed)} of "
                           f"{len(ordered)} episodes failed; reward.on_error=zero counts them and goes on)")
        for e in failed:
            print(f"lmrl: {self.field}: episode {e.index} failed: {e.error}", file=sys.stderr)
        return self._episodes(ordered, prompts, n, generator)

    def _run(self, gateway: Gateway, episodes: dict[str, _Episode]) -> None:
        """Every episode's program, at most `max_parallel` at a time, each killed at its own `timeout`."""
        waiting, running = list(episodes.items()), []
        try:
            while waiting or running:
                while waiting and len(running) < self.max_parallel:
                    eid, e = waiting.pop(0)
                    given = {"OPENAI_BASE_URL": gateway.episode_url(eid), "OPENAI_API_KEY": e.key,
                             "LMRL_ROW": json.dumps(dict(e.row), default=str)}
                    running.append((self._start(given), time.monotonic() + self.timeout, e))
                time.sleep(0.01)
                still = []
                for proc, deadline, e in running:
                    if proc.poll() is None and time.monotonic() < deadline:
                        still.append((proc, deadline, e))
                    else:
                        self._end(proc, e)
                running = still
        finally:
            for proc, _, _ in running:
                _kill(proc)

    def _run_batch(self, gateway: Gateway, episodes: dict[str, _Episode]) -> None:
        """One run of the command for all `episodes` (env.agent_mode=batch), killed at `timeout`."""
        with tempfile.TemporaryDirectory(prefix="lmrl-episodes-") as folder:  # mode 0700: the keys are in it
            proc = self._start({"LMRL_EPISODES": episodes_file(gateway, episodes, folder)}, drop=_OPENAI)
            deadline = time.monotonic() + self.timeout
            try:
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            finally:
                late = proc.poll() is None
                if late:
                    _kill(proc)
        _fail_unrewarded(episodes, f"the batch's program ran past env.timeout={self.timeout:g}s and was killed" if late
                         else _exit_line("the batch's program", proc) if proc.returncode != 0 else None)
        proc.stderr_file.close()

    def _run_persistent(self, gateway: Gateway, episodes: dict[str, _Episode]) -> None:
        """The batch's episodes file to the run's program, on its stdin (env.agent_mode=persistent); the batch is
        over when each episode has its reward, the program exited, or `timeout` passed (the program is then killed;
        the next batch starts it again)."""
        if self._program is None or self._program.poll() is not None:
            if self._program is not None:  # it ended in an earlier batch (and was told there)
                self._program.stderr_file.close()
            self._folder = self._folder or tempfile.mkdtemp(prefix="lmrl-episodes-")  # mode 0700
            self._program = self._start({}, drop=_OPENAI, stdin=True)
        proc, path = self._program, episodes_file(gateway, episodes, self._folder)
        with contextlib.suppress(OSError):  # an exited program is told below
            proc.stdin.write((path + "\n").encode())
            proc.stdin.flush()
        deadline = time.monotonic() + self.timeout
        waiting = lambda: [e for e in episodes.values() if e.reward is None and e.error is None]  # noqa: E731
        while waiting() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        os.remove(path)
        if waiting() and proc.poll() is None:
            _kill(proc)
            _fail_unrewarded(episodes, f"the run's program ran past env.timeout={self.timeout:g}s for this batch and "
                                       "was killed (it starts again for the next)")
        elif waiting():
            _fail_unrewarded(episodes, _exit_line("the run's program", proc))

    def close(self) -> None:
        """End the run's program (env.agent_mode=persistent: at the end of its stdin it should end itself); with
        env.agent_mode=serve, tell the programs asking for work that the run is over."""
        if self.mode == "serve" and self._gateway is not None:
            end_work(self._gateway, self.work_file)
            self._gateway = None
        if self._program is not None:
            with contextlib.suppress(OSError):
                self._program.stdin.close()
            try:
                self._program.wait(5)
            except subprocess.TimeoutExpired:
                _kill(self._program)
            self._program.stderr_file.close()
            self._program = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _start(self, given: dict[str, str], drop: Sequence[str] = (), stdin: bool = False) -> subprocess.Popen:
        env = {**{k: v for k, v in os.environ.items() if k not in drop}, **given}
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in _end, once the program is done
        try:
            proc = subprocess.Popen(self.argv, env=env, cwd=self.cwd, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
            proc.stderr_file = stderr  # type: ignore[attr-defined]
        except OSError as err:
            stderr.close()
            raise RunError(f"env.command: cannot start {self.argv[0]!r}: {err.strerror or err}") from None
        return proc

    def _end(self, proc: subprocess.Popen, e: _Episode) -> None:
        if proc.poll() is None:
            _kill(proc)
            e.error = e.error or f"ran past env.timeout={self.timeout:g}s and was killed"
        stderr = proc.stderr_file
        stderr.seek(0)
        lines = stderr.read().decode(errors="replace").strip().splitlines()
        stderr.close()
        if e.error is None and proc.returncode != 0:
            e.error = f"exited with status {proc.returncode}" + (f": {lines[-1][:300]}" if lines else "")
        if e.error is None and e.reward is None:
            e.error = "exited without reporting a reward (POST $OPENAI_BASE_URL/lmrl/reward {\"reward\": x})"

    def _episodes(self, ordered: list[_Episode], prompts: list[list[int]], n: int, generator: Any) -> Episodes:
        pad = int(getattr(generator, "pad_token_id", 0))
        ids, logps, trained, texts, finished, rewards, turns = [], [], [], [], [], [], []
        for e in ordered:
            segs = e.segments[1:] if e.error is None else []
            ids.append([t for s in segs for t in s.ids])
            logps.append([lp for s in segs for lp in s.logps])
            trained.append([s.trained for s in segs for _ in s.ids])
            texts.append("".join(s.text for s in segs))
            finished.append(bool(e.finished) and e.error is None)
            rewards.append(e.reward if e.error is None else 0.0)
            turns.append(e.turns)
        width, plen = max(1, max(len(x) for x in ids)), max(len(e.segments[0].ids) for e in ordered)
        B = len(ordered)
        prompt_ids = torch.full((B, plen), pad, dtype=torch.long)
        prompt_mask = torch.zeros(B, plen, dtype=torch.bool)
        response_ids = torch.full((B, width), pad, dtype=torch.long)
        logprobs = torch.zeros(B, width)
        mask = torch.zeros(B, width, dtype=torch.bool)
        attention = torch.zeros(B, width, dtype=torch.bool)
        for i in range(B):
            p, k = ordered[i].segments[0].ids, len(ids[i])  # the prompt as the agent rendered it (`_rebase`)
            prompt_ids[i, plen - len(p):] = torch.tensor(p, dtype=torch.long)
            prompt_mask[i, plen - len(p):] = True
            response_ids[i, :k] = torch.tensor(ids[i], dtype=torch.long)
            logprobs[i, :k] = torch.tensor(logps[i])
            mask[i, :k] = torch.tensor(trained[i], dtype=torch.bool)
            attention[i, :k] = True
        rollout = Rollout(prompt_ids, prompt_mask, response_ids, mask, logprobs, texts,
                          torch.tensor(finished, dtype=torch.bool), torch.arange(B) // n,
                          attention if bool((attention & ~mask).any()) else None)
        metrics = _metrics(ids, trained, turns, {})
        metrics["agent/retokenized_tokens"] = float(sum(e.retokenized for e in ordered))
        metrics["agent/failures"] = float(sum(e.error is not None for e in ordered))
        return Episodes(rollout, rewards, turns, metrics)


_OPENAI = ("OPENAI_BASE_URL", "OPENAI_API_KEY")
"""Not inherited by a program of several episodes: a client made without arguments must reach no other endpoint."""


def _exit_line(who: str, proc: subprocess.Popen) -> str:
    """`who` exited with status N: the last line of its stderr."""
    stderr = proc.stderr_file
    stderr.seek(0)
    lines = stderr.read().decode(errors="replace").strip().splitlines()
    return f"{who} exited with status {proc.returncode}" + (f": {lines[-1][:300]}" if lines else "")


def _fail_unrewarded(episodes: dict[str, _Episode], why: str | None) -> None:
    """Every episode still without a reward fails with `why` (None: for not having one); the others are kept."""
    for e in episodes.values():
        if e.error is None and e.reward is None:
            e.error = why or "had no reward reported (POST its base_url + /lmrl/reward {\"reward\": x})"


def _kill(proc: subprocess.Popen) -> None:
    """The program and everything it started (its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def close_agents(env: Any) -> None:
    """At the end of a run: an agent environment's programs hear that it is over (`AgentEnvironment.close`)."""
    if isinstance(env, AgentEnvironment):
        env.close()
