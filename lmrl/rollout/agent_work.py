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

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

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
