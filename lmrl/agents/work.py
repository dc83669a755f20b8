"""Episodes handed to agent programs that run on their own and ask for work (`env.agent_mode=serve`).

    lmrl train ... env.name=agent env.agent_mode=serve        # starts no program; writes <output_dir>/agent.json

lmrl starts nothing. When the gateway starts (the first batch of episodes) it writes `agent.json` in the run's
output directory (mode 0600: the run key is in it) and logs a line with the work URL:

    {"work_url": "http://127.0.0.1:PORT/lmrl/work", "key": "lmrl-run-...", "pid": 1234}

Programs (any number, any language) long-poll `POST work_url` with `Authorization: Bearer KEY` and a body
{"max": episodes wanted at most (default 1), "wait": seconds to wait for one (default 30, at most 60)}. The answer
is {"episodes": [{"index", "base_url", "api_key", "row"}, ...], "done": false}: each episode as
`env.agent_mode=batch` hands it out, run against its own base URL with its own key, its reward reported at
`base_url + /lmrl/reward`. An empty list means no work came within `wait`: ask again. {"done": true} (or a refused
connection) means the run is over. An episode is handed to one program only.

The run key reaches only /lmrl/work; an episode's key cannot ask for work (403), another run's key is 401. A batch
waits for its rewards at most `env.timeout`: episodes no program asked for, or that a program took and reported no
reward for, then fail with one line (`reward.on_error`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lmrl.rollout.server import Refused, _same

WORK = "/lmrl/work"
MAX_WAIT = 60.0  # seconds one poll may hold its connection
MAX_TAKE = 1024  # episodes one poll may take


class WorkQueue:
    """Episode ids waiting for a program; `take` hands each to one caller."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._waiting: list[str] = []
        self.done = False

    def offer(self, ids: list[str]) -> None:
        with self._ready:
            self._waiting.extend(ids)
            self._ready.notify_all()

    def withdraw(self, ids: list[str]) -> None:
        """The batch is over: what no program took is no longer handed out."""
        gone = set(ids)
        with self._ready:
            self._waiting = [i for i in self._waiting if i not in gone]

    def take(self, most: int, wait: float) -> list[str]:
        """Up to `most` waiting ids, waiting up to `wait` seconds for the first (none: [])."""
        with self._ready:
            self._ready.wait_for(lambda: self._waiting or self.done, timeout=wait)
            taken, self._waiting = self._waiting[:most], self._waiting[most:]
            return taken

    def close(self) -> None:
        with self._ready:
            self.done = True
            self._waiting = []
            self._ready.notify_all()


def work_request(body: dict[str, Any]) -> tuple[int, float]:
    """(max, wait) of a work request, checked: one line naming the field where it is wrong."""
    most, wait = body.get("max", 1), body.get("wait", 30.0)
    if isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= MAX_TAKE:
        raise ValueError(f"max: expected an integer from 1 to {MAX_TAKE}, got {json.dumps(most)[:40]}")
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_WAIT:
        raise ValueError(f"wait: expected seconds from 0 to {MAX_WAIT:g}, got {json.dumps(wait)[:40]}")
    return most, float(wait)


def write_work_file(path: Path, url: str, key: str) -> None:
    """agent.json, readable by the trainer's user only (the run key is in it), and a log line saying where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"work_url": url + WORK, "key": key, "pid": os.getpid()}, f)
    os.chmod(path, 0o600)  # an older file of another mode
    print(f"lmrl: env.agent_mode=serve: agent programs ask for episodes at POST {url}{WORK} with the run key in "
          f"{path}", file=sys.stderr, flush=True)


def authorize_run(server: Any, headers: Any) -> str:
    """/lmrl/work on the gateway `server`: the run key only; an episode's key is 403, any other 401."""
    if server.run_key is None:
        raise Refused(404, f"no such endpoint: POST {WORK} (only env.agent_mode=serve hands out work)")
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    if not _same(token, server.run_key):
        if any(_same(token, e.key) for e in server.episodes.values()):
            raise Refused(403, "authorization: an episode's key cannot ask for work; send the run key (agent.json)",
                          "wrong_key")
        raise Refused(401, "authorization: a missing or wrong run key: send the key of the run's agent.json",
                      "invalid_api_key")
    return WORK


def hand_out(gateway: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The answer to POST /lmrl/work: waiting episodes of `gateway`, each to one program."""
    most, wait = work_request(body)
    specs = []
    for eid in gateway.work.take(most, wait):
        e = gateway.episodes.get(eid)  # (None: its batch ended meanwhile)
        if e is not None:
            e.handed = True
            specs.append(json.loads(json.dumps(gateway.spec(eid), default=str)))
    return {"episodes": specs, "done": gateway.work.done}


def run_served(gateway: Any, episodes: dict[str, Any], timeout: float, work_file: Path) -> None:
    """A batch's episodes to whichever programs ask for work, until each has its reward or `timeout` passed; no
    program is started or killed. Those without a reward then fail, saying whether a program took them."""
    gateway.work.offer(list(episodes))
    deadline = time.monotonic() + timeout
    try:
        while any(e.reward is None and e.error is None for e in episodes.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gateway.work.withdraw(list(episodes))
    late = f"env.timeout={timeout:g}s"
    for e in episodes.values():
        if e.error is None and e.reward is None:
            e.error = (f"was taken by an agent program that reported no reward within {late}" if e.handed else
                       f"was asked for by no agent program within {late} (POST {gateway.public_url or gateway.url}{WORK} "
                       f"with the run key in {work_file})")


def end_work(gateway: Any, work_file: Path) -> None:
    """The run is over: waiting polls answer {"done": true}, agent.json goes, then the gateway stops."""
    gateway.work.close()
    with contextlib.suppress(OSError):
        work_file.unlink()
    time.sleep(0.2)  # the polls waiting get their answer before the server stops
    gateway.shutdown()


def episodes_file(gateway: Any, episodes: dict[str, Any], folder: str) -> str:
    """A JSONL file in `folder` (the trainer's user's only: the keys are in it), a line per episode."""
    path = os.path.join(folder, f"episodes-{secrets.token_hex(6)}.jsonl")
    with open(path, "w") as f:
        for eid in episodes:
            f.write(json.dumps(gateway.spec(eid), default=str) + "\n")
    return path
