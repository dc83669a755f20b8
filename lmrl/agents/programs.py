"""An environment whose episodes are driven by a program written elsewhere (`env.name=agent`).

    env.name=agent env.command="python my_agent.py" env.timeout=60

For each episode lmrl starts the command with, in its environment:

    OPENAI_BASE_URL   the episode's own endpoint, http://127.0.0.1:PORT/episodes/ID/v1
    OPENAI_API_KEY    the episode's key (the official `openai` client reads both variables)
    LMRL_ROW          the dataset row, as JSON

The agent calls `/v1/completions` (the prompt so far, as text) or `/v1/chat/completions` (the messages so
far) and ends by reporting the episode's reward: `POST {OPENAI_BASE_URL}/lmrl/reward {"reward": 1.0}` with its
key (`client.post("/lmrl/reward", body={"reward": 1.0}, cast_to=object)`), then exits 0.

The gateway that serves and records the episodes is `lmrl.agents.gateway`.

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
the gateway for episodes with the run key (`lmrl.agents.work`).

Each chat turn's tool calls are parsed in the model family's format (`lmrl.rollout.chat_turns`: Hermes, Llama 3's
JSON, Mistral's [TOOL_CALLS]; `model.tool_call_format`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lmrl.agents.gateway import Gateway, _Episode, _Segment
from lmrl.agents.work import (
    end_work,
    episodes_file,
    run_served,
    write_work_file,
)
from lmrl.errors import ConfigError, RunError
from lmrl.rollout.base import Generator, Rollout, SamplingParams
from lmrl.rollout.batcher import thread_precision
from lmrl.rollout.multiturn import Episodes, _metrics
from lmrl.rollout.samples import sample_metrics
from lmrl.rollout.server import (
    is_loopback,
)

# A program per episode (env.agent_mode=episode) whose median time before its first request is at least this share
# of its whole run is mostly start-up: the run says so once.
STARTUP_SHARE = 0.5


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
            "serve": no command; programs of yours ask for episodes (`lmrl.agents.work`).
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
        self._told_startup = False  # `_tell_startup` said its line
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
                self._tell_startup(episodes.values())
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
                    e.started = time.monotonic()
                    running.append((self._start(given), e.started + self.timeout, e))
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

    def _tell_startup(self, episodes: Iterable[_Episode]) -> None:
        """Once per run: where a program per episode spends most of its time starting (an interpreter, its imports)
        before its first request, one line naming the modes that start a program for many episodes."""
        spans = [(e.first_call - e.started, e.ended - e.started) for e in episodes
                 if e.started is not None and e.first_call is not None and e.ended is not None]
        if self._told_startup or not spans:
            return
        start, whole = statistics.median(s for s, _ in spans), statistics.median(w for _, w in spans)
        if whole > 0 and start >= STARTUP_SHARE * whole:
            self._told_startup = True
            print(f"lmrl: env.agent_mode=episode: each agent program spent {start:.2f} s of its {whole:.2f} s (median) "
                  "starting, before its first request; env.agent_mode=batch or persistent runs one program for many "
                  "episodes (docs/agents.md)", file=sys.stderr)

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
        e.ended = time.monotonic()
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
        """The episodes as a rollout: a row each, its samples' response tokens one after another, the contexts its
        later samples were sampled after in `Rollout.contexts` (`lmrl.rollout.samples`)."""
        pad = int(getattr(generator, "pad_token_id", 0))
        ids, logps, trained, texts, finished, rewards, turns, contexts = [], [], [], [], [], [], [], []
        for e in ordered:
            samples = e.samples() if e.error is None else [e.samples()[0][:1]]
            row, later = [], []
            for j, sample in enumerate(samples):
                segs = sample[1:]
                while segs and not segs[-1].trained:  # text after a sample's last model turn conditions nothing
                    segs = segs[:-1]  # trained on (a tool result the budget refused a turn after, a closed sample's)
                if j and segs:  # (a sample begun by a request its budget refused has nothing to train on)
                    later.append((sum(len(s.ids) for s in row), list(sample[0].ids)))
                row += segs
            ids.append([t for s in row for t in s.ids])
            logps.append([lp for s in row for lp in s.logps])
            trained.append([s.trained for s in row for _ in s.ids])
            texts.append("".join(s.text + s.tail for sample in samples for s in sample[1:]))  # with its stops
            contexts.append(later)
            finished.append(bool(e.finished) and e.error is None)
            rewards.append(e.reward if e.error is None else 0.0)
            turns.append(e.turns)
        firsts = [e.samples()[0][0].ids for e in ordered]  # each row's prompt: its first sample's
        width, plen = max(1, max(len(x) for x in ids)), max(len(p) for p in firsts)
        B = len(ordered)
        prompt_ids = torch.full((B, plen), pad, dtype=torch.long)
        prompt_mask = torch.zeros(B, plen, dtype=torch.bool)
        response_ids = torch.full((B, width), pad, dtype=torch.long)
        logprobs = torch.zeros(B, width)
        mask = torch.zeros(B, width, dtype=torch.bool)
        attention = torch.zeros(B, width, dtype=torch.bool)
        for i in range(B):
            p, k = firsts[i], len(ids[i])  # as the agent rendered it (`_rebase`)
            prompt_ids[i, plen - len(p):] = torch.tensor(p, dtype=torch.long)
            prompt_mask[i, plen - len(p):] = True
            response_ids[i, :k] = torch.tensor(ids[i], dtype=torch.long)
            logprobs[i, :k] = torch.tensor(logps[i])
            mask[i, :k] = torch.tensor(trained[i], dtype=torch.bool)
            attention[i, :k] = True
        rollout = Rollout(prompt_ids, prompt_mask, response_ids, mask, logprobs, texts,
                          torch.tensor(finished, dtype=torch.bool), torch.arange(B) // n,
                          attention if bool((attention & ~mask).any()) else None,
                          contexts=contexts if any(contexts) else None)
        metrics = _metrics(ids, trained, turns, {})
        metrics.update(sample_metrics(rollout))
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
