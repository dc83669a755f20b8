"""Concurrent requests of the generation server (`lmrl.rollout.server`) as shared generator work.

Clients that each ask one completion at the same moment (an agent framework's workers, an evaluation harness)
would otherwise run one after another, each paying the whole decode loop for a single row. The batcher queues
them and one thread serves the queue, in order:

- with lmrl's own decode (`lmrl.rollout.joining_decode.joinable`, any model its engine decodes), unseeded requests
  join a running decode (`JoiningDecode`, continuous batching): a request that arrives while others decode is
  prefilled and steps with them from the next step on, and each request is handed back the step its last row
  ends. Requests join from the head of the queue while they sample alike (temperature, top_p, top_k, stop; each
  row keeps its own max_tokens) and fit in `max_sequences` rows; one that samples otherwise, or a thread waiting
  for the lock (`exclusive`: a weight push), stops the joining, and the decode drains first.
- otherwise (a vLLM engine, which batches on its own; a seeded request) the thread takes the oldest request and
  every queued request that samples alike (the same n and `SamplingParams`, no seed), first waiting for the rest
  of a burst (while a request is still being read, the server's handler inside `incoming`, or one came within the
  window; at most `max_wait`), runs them as one `Generator.generate` call and hands each request its own rows.
  Requests arriving while a call decodes wait and go together into the next.

A seeded request runs alone: its prompt i samples with seed + i (`call_seed`), which a merged call would shift; so
a training run's requests (always seeded) are served exactly as before.

Where the time goes in whole calls, and what it does about it (32 one-completion requests against one n=32 request,
benchmarks/serve_concurrency.py): a burst's requests reach the server over a few milliseconds, more on a loaded
machine, so a fixed 1 ms window split bursts in two calls, the second waiting for the first: the window is a
tenth of the last call's time (a longer decode, or a busier machine, waits longer; a split costs a whole call).
Equal prompts of different requests (the episodes of one GRPO group, a client's retries) are one prompt with more
completions: its prefill runs once and its decode shares the prompt's keys and values, as for one n=32 request.

The thread runs calls under a precision context (`precision`, e.g. the trainer's bf16 autocast captured by
`thread_precision` in the thread that owns the run): torch keeps autocast per thread, so without it a call made
here would decode in float32 while the trainer's own rollouts run in bfloat16.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lmrl.rollout.base import Generator, SamplingParams
from lmrl.rollout.joining_decode import Joining, JoiningDecode, joinable


@dataclass
class Rows:
    """One request's completions, `n` per prompt in contiguous groups, each cut to its real tokens."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]
    texts: list[str]
    version: int
    """The policy version of the weights that sampled them."""


@dataclass
class _Request:
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    done: threading.Event = field(default_factory=threading.Event)
    rows: Rows | None = None
    error: BaseException | None = None
    ended: list[Any] = field(default_factory=list)  # a joining decode's rows (`Ended`), as they end

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    def key(self) -> Any:
        """Requests with equal keys can share a call."""
        if self.params.seed is not None:
            return id(self)
        p = self.params
        return (self.n, p.max_new_tokens, p.temperature, p.top_p, p.top_k, tuple(p.stop))

    def joins(self) -> Any:
        """Requests with equal keys can decode together in a `JoiningDecode` (each row has its own max_new); None
        for a seeded one."""
        p = self.params
        return None if p.seed is not None else (p.temperature, p.top_p, p.top_k, tuple(p.stop))


class Batcher:
    """Serves `generate` calls of many threads through one thread that batches them (module docstring).

    Args:
        generator: what samples; only the batcher's thread calls it.
        lock: held around each call (the server also holds it to load weights between calls).
        window: a burst has ended when no request came for this many seconds, or a tenth of the last call's
            seconds where that is longer.
        max_wait: the longest a request waits for the rest of its burst.
        max_sequences: the most rows of one merged call (prompts x n); 0: no limit. A request larger than
            it alone still runs alone.
    """

    def __init__(self, generator: Generator, lock: threading.Lock, window: float = 0.001, max_wait: float = 0.05,
                 max_sequences: int = 0):
        self.generator, self.lock, self.max_sequences = generator, lock, max_sequences
        self.window, self.max_wait = window, max_wait
        self.precision: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """Entered around each call: the numeric context (autocast) of the run the calls sample for."""
        self._last_call = 0.0  # seconds the last generator call took
        self._queue: list[_Request] = []
        self._ready = threading.Condition()
        self._incoming = 0  # requests being read and checked, that may come to `generate` next
        self._reading = threading.local()
        self._joining = joinable(generator)  # the decode new rows can join, or None: whole calls
        self._exclusive = 0  # threads waiting for the lock (`exclusive`): a joining decode takes no more rows
        threading.Thread(target=self._serve, name="lmrl-batcher", daemon=True).start()

    @contextlib.contextmanager
    def incoming(self) -> Iterator[None]:
        """Around the reading of a request that may generate: a burst's call waits for it (up to max_wait)."""
        with self._ready:
            self._incoming += 1
        self._reading.active = True
        try:
            yield
        finally:
            self._arrived()

    def _arrived(self) -> None:
        if getattr(self._reading, "active", False):
            self._reading.active = False
            with self._ready:
                self._incoming -= 1
                self._ready.notify_all()

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Rows:
        """`Generator.generate`, batched with whatever else is asked meanwhile; blocks until done."""
        request = _Request(prompts, n, params)
        with self._ready:
            self._queue.append(request)
            self._ready.notify_all()
        self._arrived()
        request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.rows is not None
        return request.rows

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The lock, between calls: a running joining decode takes no more rows meanwhile, so it ends soon (a
        weight push, a forward for top log-probs never waits behind an endless stream of joining requests)."""
        with self._ready:
            self._exclusive += 1
        try:
            with self.lock:
                yield
        finally:
            with self._ready:
                self._exclusive -= 1
                self._ready.notify_all()

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._queue or self._exclusive:
                    self._ready.wait()
            # a burst starts together, even where later requests could join: a request that joins a step later
            # pays a prefill of its own, and on a busy CPU a decode started at once slows the reading of the rest
            deadline, seen = time.monotonic() + self.max_wait, 0
            window = max(self.window, 0.1 * self._last_call)  # waiting costs a tenth of a call; a split, a whole one
            with self._ready:  # the rest of a burst
                while (self._incoming or len(self._queue) > seen) and time.monotonic() < deadline:
                    seen = len(self._queue)
                    self._ready.wait(min(window, max(deadline - time.monotonic(), 0)) if not self._incoming
                                     else max(deadline - time.monotonic(), 0))
            if self._joining is not None and self._queue[0].joins() is not None:
                self._run_joining()
            else:
                self._run(self._take())

    def _take(self) -> list[_Request]:
        """The oldest request and the queued ones that sample alike, within max_sequences."""
        with self._ready:
            key, batch, rows = self._queue[0].key(), [], 0
            for request in list(self._queue):
                size = len(request.prompts) * request.n
                if request.key() == key and (not batch or not self.max_sequences or rows + size <= self.max_sequences):
                    batch.append(request)
                    rows += size
                    self._queue.remove(request)
            return batch

    def _run(self, batch: list[_Request]) -> None:
        try:
            rows = self._generate([p for r in batch for p in r.prompts], batch[0].n, batch[0].params)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting requests
            if len(batch) > 1:  # one request's rows may be what failed: each alone, so the others still succeed
                for request in batch:
                    self._run([request])
                return
            batch[0].fail(e)
            return
        start = 0
        for request in batch:
            end = start + len(request.prompts) * request.n  # rows of prompt i are i*n .. i*n + n - 1
            request.rows = Rows(rows.tokens[start:end], rows.logprobs[start:end], rows.finished[start:end],
                                rows.texts[start:end], rows.version)
            request.done.set()
            start = end

    def _run_joining(self) -> None:
        """The queue's joinable requests through one `JoiningDecode` of the lmrl decode, under the lock: requests
        join between steps as they come (`_admit`), each handed back the step its last row ends."""
        decoder, flight = self._joining, []
        try:
            with self.lock, self.precision(), torch.inference_mode():
                was_training = decoder.model.training  # under the lock: a weight load may hold the model
                decoder.model.eval()
                try:
                    self._join_loop(decoder, flight)
                finally:
                    decoder.model.train(was_training)
        except BaseException as e:  # noqa: BLE001 - a step failed: every request in flight gets the error
            for request in flight:
                if not request.done.is_set():
                    request.fail(e)

    def _join_loop(self, decoder: Any, flight: list[_Request]) -> None:
        decode: JoiningDecode | None = None
        step = 0.0  # seconds the last step took
        while True:
            if decode is not None and len(decode):
                self._await_incoming(step)
            new = self._admit(None if decode is None or not flight else flight[0].joins(),
                              sum(len(r.prompts) * r.n - len(r.ended) for r in flight))
            if new:
                if decode is None or not flight:  # a new decode: the rows in flight (none) set its sampling
                    decode = JoiningDecode(decoder, new[0].params)
                try:
                    decode.add([Joining(p, r.params.max_new_tokens, (r, i)) for r in new
                                for i, p in enumerate(q for q in r.prompts for _ in range(r.n))])
                except BaseException as e:  # noqa: BLE001 - the newcomers' prefill failed: theirs alone
                    for request in new:
                        request.fail(e)
                else:
                    flight.extend(new)
            if decode is None or not len(decode):
                return
            start = time.perf_counter()
            done = decode.step()
            step = time.perf_counter() - start
            for ended in done:
                request, _ = ended.owner
                request.ended.append(ended)
                if len(request.ended) == len(request.prompts) * request.n:
                    flight.remove(request)
                    rows = sorted(request.ended, key=lambda e: e.owner[1])  # in the asked order
                    request.rows = Rows([e.tokens for e in rows], [e.logprobs for e in rows],
                                        [e.finished for e in rows], [e.text for e in rows],
                                        getattr(self.generator, "version", -1))
                    request.done.set()

    def _await_incoming(self, seconds: float) -> None:
        """Up to `seconds` (a step's time) for the requests being read now (`incoming`): they join this step
        instead of a later one, on their own prefill (a join costs about a step; on a busy CPU the waiting also
        gives their handlers the CPU)."""
        deadline = time.monotonic() + seconds
        with self._ready:
            while self._incoming and not self._exclusive and time.monotonic() < deadline:
                self._ready.wait(max(deadline - time.monotonic(), 0))

    def _admit(self, key: Any, in_flight: int) -> list[_Request]:
        """Queued requests that join the decode now: from the head of the queue, while they sample alike (`key`:
        the decode's; None: the head's) and fit in max_sequences rows (or the decode's batch_size) with those in
        flight. One of another kind at the head, or a thread waiting for the lock, stops the joining: the decode
        drains, and the queue goes on in order."""
        limits = [x for x in (self.max_sequences, self._joining.batch_size) if x]
        with self._ready:
            taken: list[_Request] = []
            while self._queue and not self._exclusive:
                head = self._queue[0]
                size = len(head.prompts) * head.n
                if head.joins() is None or (key is not None and head.joins() != key):
                    break
                if limits and in_flight and in_flight + size > min(limits):
                    break
                taken.append(self._queue.pop(0))
                key, in_flight = head.joins(), in_flight + size
            return taken

    def _generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Rows:
        distinct, repeats, where = _shared(prompts) if params.seed is None else (prompts, 1, list(range(len(prompts))))
        start = time.perf_counter()
        with self.lock, self.precision():
            rollout = self.generator.generate(distinct, n * repeats, params)
            version = getattr(self.generator, "version", -1)
        self._last_call = time.perf_counter() - start
        lengths = rollout.response_mask.sum(1).tolist()
        tokens = [row[:k] for row, k in zip(rollout.response_ids.tolist(), lengths)]
        logprobs = [row[:k] for row, k in zip(rollout.logprobs.tolist(), lengths)]
        finished, texts = [bool(f) for f in rollout.finished.tolist()], list(rollout.texts)
        rows = [r for w in where for r in range(w * n, w * n + n)]  # each prompt's n rows, in the asked order
        return Rows([tokens[r] for r in rows], [logprobs[r] for r in rows], [finished[r] for r in rows],
                    [texts[r] for r in rows], version)


def _shared(prompts: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
    """Equal prompts as one: (prompts to generate, completions per prompt as a multiple of n, where prompt i's
    rows start in units of n). A prompt asked k times is generated k / g times with g x n completions each, g the
    greatest common divisor of the counts (all equal prompts: one prompt; all different: as asked)."""
    seen: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        seen.setdefault(tuple(p), []).append(i)
    g = math.gcd(*(len(v) for v in seen.values()))
    distinct, where = [], [0] * len(prompts)
    for p, positions in seen.items():
        for j, i in enumerate(positions):
            if j % g == 0:
                distinct.append(list(p))
            where[i] = (len(distinct) - 1) * g + j % g  # unit (of n rows) among the call's rows
    return distinct, g, where


def thread_precision() -> Callable[[], contextlib.AbstractContextManager]:
    """The calling thread's autocast (per device type), as a context another thread can enter: torch keeps autocast
    per thread, so a batcher's thread would otherwise sample in the weights' own dtype."""
    on = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]

    def enter() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for device, dtype in on:
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype))
        return stack

    return enter
