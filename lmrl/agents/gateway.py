"""The recording gateway: the live policy at one OpenAI-compatible endpoint per episode, for episodes driven by a
program written elsewhere (`lmrl.agents.programs`) or by a verifiers environment (`lmrl.agents.verifiers`).

The gateway (`Gateway`) serves the live policy, requests of all episodes batched together (`lmrl.rollout.batcher`:
with lmrl's decode a request joins the running decode at its next step), and records per episode exactly the token ids it sampled and their log-probs. When
the agent sends the conversation so far, the gateway matches it against the episode's own record (the prompt,
the sampled tokens, the observations it already tokenized) and tokenizes only what is new: tool results, user
turns, a chat template's markup. The model's output is never tokenized again.

An episode may be several training samples. Where a request does not extend the tokens of the episode so far (a
reasoning model's template cut the reasoning of earlier turns, the agent compacted its context or rewrote the
model's text), the record so far is closed as a sample of its own, trained in exactly the context it was sampled
in, and a new sample starts from the request's context: the part of it that still matches the record keeps its
ids, the rest is tokenized. Nothing sampled is dropped. Sampled tokens whose text the agent changed are counted
(`agent/retokenized_tokens`): the agent's version of that text is attended in the next sample, never trained on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmrl.agents.work import WORK, WorkQueue, authorize_run, hand_out
from lmrl.models.prompt_encoding import encode_text
from lmrl.rollout.base import Generator, SamplingParams
from lmrl.rollout.batcher import Batcher
from lmrl.rollout.chat_turns import Reply, render_conversation, turn_choice, turn_end
from lmrl.rollout.ops import stop_found
from lmrl.rollout.server import GenerationServer, Refused, _flag, _given, _Handler, _integer, _list, _same
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
    tail: str = ""
    """The stop string that ended a sampled turn, left out of `text` as the OpenAI API leaves it out: the agent may
    send it back after the text or not, and the record matches either way (its tokens are in `ids` already)."""
    rewritten: bool = False
    """A sampled turn whose text the agent changed (counted in `agent/retokenized_tokens` once)."""


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
    closed: list[list[_Segment]] = field(default_factory=list)
    """The samples before the current one (`segments`), each its record up to a request that did not extend it."""
    error: str | None = None
    handed: bool = False
    """env.agent_mode=serve: a program took it."""
    started: float | None = None  # env.agent_mode=episode: when its program started (time.monotonic)
    first_call: float | None = None  # when its first model call came
    ended: float | None = None  # when its program was done

    def known(self, chat: bool, text: str = "") -> str:
        """The record as text, each turn's stop string where `text` has it after that turn."""
        out = ""
        for s in self.segments:
            out += s.raw if chat else s.text
            if s.tail and text.startswith(out + s.tail):
                out += s.tail
        return out

    def response_length(self) -> int:
        """Tokens sampled and observed so far, every sample's (the contexts they restarted from not counted)."""
        return sum(len(s.ids) for sample in self.samples() for s in sample[1:])

    def samples(self) -> list[list[_Segment]]:
        """Every sample's record (its context first), the current one last."""
        return [*self.closed, self.segments]


class Gateway(GenerationServer):
    """The live policy at one OpenAI-compatible endpoint per episode (module docstring); on loopback, unless
    env.agent_mode=serve listens elsewhere with a run key of the user's (`lmrl.agents.work`)."""

    def __init__(self, generator: Generator, tokenizer: Any, name: str = "lmrl-policy", host: str = "127.0.0.1",
                 port: int = 0, run_key: str | None = None, tool_format: str = "auto"):
        super().__init__(generator, tokenizer, name, host=host, port=port, api_key=run_key, tool_format=tool_format)
        self.RequestHandlerClass = _GatewayHandler
        # env.agent_mode=serve: programs that run on their own ask for episodes with the run key (`lmrl.agents.work`)
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
        keep_stop = _flag(body, "include_stop_str_in_output")
        with episode.lock:
            episode.first_call = episode.first_call or time.monotonic()
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
            ids, logps, full = rows.tokens[0], rows.logprobs[0], rows.texts[0]
            raw = self.tokenizer.decode(ids, skip_special_tokens=False)
            # the text as the OpenAI API returns it: without the stop string, unless the request asks for it
            found = stop_found(full, params.stop) if rows.finished[0] else None
            tail = found if found and not keep_stop else ""
            text = full[:len(full) - len(tail)]
            choice = turn_choice(full, ids, rows.finished[0], chat, body.get("tools") and self.tool_calls,
                                 f"call-{episode.index}-{episode.turns}", shown=text)
            choice["stop_reason"] = found
            episode.segments.append(_Segment(ids, logps, True, text, raw, choice.get("message"), tail))
            episode.turns += 1
            episode.finished = rows.finished[0]
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
            turns = [s for sample in episode.samples() for s in sample if s.message is not None]
            text, changed = render_conversation(self.tokenizer, messages, body.get("tools"),
                                                [Reply(s.message, s.raw, turn_end(self.tokenizer, s.ids), s.tail) for s in turns])
            for k in changed:  # the model's text the agent rewrote: attended from now on, counted once
                episode.retokenized += 0 if turns[k].rewritten else len(turns[k].ids)
                turns[k].rewritten = True
            return text
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("prompt: the gateway takes the conversation so far as one string")
        return prompt

    def _extend(self, episode: _Episode, text: str, chat: bool) -> None:
        """Match `text` to the episode's record and tokenize only the rest; where they part after a sampled turn,
        close the record as a sample and start a new one from `text` (module docstring)."""
        known = episode.known(chat, text)
        if text.startswith(known):
            if new := text[len(known):]:
                ids = encode_text(self.tokenizer, new)
                episode.segments.append(_Segment(ids, [0.0] * len(ids), False, new, new))
            return
        sampled = any(s.trained for s in episode.segments)
        prompt = episode.segments[0].raw if chat else episode.segments[0].text
        if not sampled and (chat or episode.closed):
            return self._rebase(episode, text)  # before its first turn: the agent's own rendering (tools, system)
        if not sampled and not text.startswith(prompt):
            raise Refused(400, "episode: the conversation does not start with the row's prompt "
                          f"({prompt[:60]!r}); the agent must send its prompt as given", "prompt_changed")
        ids, at = [], 0  # the record as far as `text` holds it, kept as it was sampled and tokenized
        for seg in episode.segments:
            whole = seg.raw if chat else seg.text
            if text.startswith(whole, at):
                ids += seg.ids
                at += len(whole)
                at += len(seg.tail) if seg.tail and text.startswith(seg.tail, at) else 0
                continue
            k = self._held(seg.ids, text, at, chat)
            ids, at = ids + seg.ids[:k], at + len(self._decode(seg.ids[:k], chat))
            if seg.trained and not chat and not seg.rewritten:  # the model's text the agent rewrote (chat: per reply)
                episode.retokenized += len(seg.ids) - k
                seg.rewritten = True
            break
        ids += encode_text(self.tokenizer, text[at:])
        if sampled:
            episode.closed.append(episode.segments)
        episode.segments = [_Segment(ids, [0.0] * len(ids), False, text if not chat else self._decode(ids, False),
                                     text if chat else self._decode(ids, True))]

    def _held(self, ids: list[int], text: str, at: int, chat: bool) -> int:
        """The longest run of `ids` whose text `text` holds at `at` as it was (a bisection: a prompt is long)."""
        low, high = 0, len(ids)
        while low < high:
            mid = (low + high + 1) // 2
            if text.startswith(self._decode(ids[:mid], chat), at):
                low = mid
            else:
                high = mid - 1
        return low

    def _rebase(self, episode: _Episode, text: str) -> None:
        """The episode's prompt becomes the agent's first chat request as rendered (the row's messages with the
        tools it offers, a system prompt of its own): prompts are attended, never trained on."""
        ids = encode_text(self.tokenizer, text)
        episode.segments = [_Segment(ids, [0.0] * len(ids), False, self._decode(ids, False), text)]

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
        episode (`lmrl.agents.verifiers`: one HTTP client per step instead of one per episode)."""
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
