"""A reward function that asks an HTTP server for the rewards.

Protocol (one request per batch):

    POST <url>
    Content-Type: application/json
    {"prompts": [...], "completions": [...], "<column>": [...], ...}   every list has N entries

    200 OK
    {"rewards": [r_0, ..., r_{N-1}]}    finite numbers, or null for "not applicable"

The keyword arguments lmrl passes (dataset columns, `completion_ids`, `finished`) are sent as extra
keys, all of them by default or those named in `include`. Connection errors, timeouts, 429 and 5xx
responses are retried up to `max_retries` times with exponential backoff
(backoff * 2^attempt seconds, at most `max_backoff`); other 4xx responses and malformed answers fail at
once. Every failure is a one-line RemoteRewardError (a `lmrl.errors.RewardError`) naming the URL
and the last problem: the HTTP status and the start of the body, or the completion whose reward is
not a finite number (Python's json reads `NaN` and `Infinity`, which are not rewards).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from lmrl.errors import RewardError
from lmrl.rewards.core import completion_text


class RemoteRewardError(RewardError):
    """The reward server could not be reached or gave an unusable answer (one-line message naming the URL)."""


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _retryable_status(status: int) -> bool:
    return status == 429 or status >= 500


async def post_retried(client: httpx.AsyncClient, url: str, *, max_retries: int, backoff: float, max_backoff: float,
                       timeout: float, **request: Any) -> tuple[httpx.Response | None, int, str]:
    """POST `url` (`request`: httpx's content / json / headers), retried with exponential backoff on connection
    errors, timeouts, 429 and 5xx: (the 200 response, or None; the attempts made; the last problem, in words).
    What the remote scorer and the judge (`lmrl.rewards.judge`) send."""
    last = "no attempt made"
    for attempt in range(max_retries + 1):
        if attempt > 0:
            await asyncio.sleep(min(backoff * 2 ** (attempt - 1), max_backoff))
        try:
            response = await client.post(url, **request)
        except httpx.TimeoutException:
            last = f"timed out after {timeout:g}s"
            continue
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
            continue
        if response.status_code == 200:
            return response, attempt + 1, ""
        last = f"HTTP {response.status_code}: {response.text[:100]!r}"
        if not _retryable_status(response.status_code):
            return None, attempt + 1, last
    return None, max_retries + 1, last


class RemoteScorer:
    """Async reward function: POSTs the batch to `url` and returns the server's rewards.

    Args:
        url: the endpoint, e.g. "http://127.0.0.1:8000/score".
        timeout: seconds allowed for each HTTP request (connect, read, write).
        max_retries: retries after the first attempt, on connection errors, timeouts, 429 and 5xx.
        backoff: delay before the first retry; doubles with each retry.
        max_backoff: cap on one delay.
        include: names of keyword arguments (columns) to send; None sends all of them.
        headers: extra HTTP headers (e.g. an Authorization token).
        name: metric name.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        include: Sequence[str] | None = None,
        headers: Mapping[str, str] | None = None,
        name: str = "remote",
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected an http:// or https:// URL, got {url!r}")
        if not timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        if max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {max_retries}")
        if backoff < 0 or max_backoff < 0:
            raise ValueError(f"backoff: delays must be >= 0, got backoff={backoff}, max_backoff={max_backoff}")
        self.url = url
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.include = None if include is None else list(include)
        self.headers = dict(headers or {})
        self.name = name

    def payload(self, prompts: list[Any], completions: list[str], **kwargs: Any) -> bytes:
        """The JSON request body for one batch."""
        kwargs = {k: v for k, v in kwargs.items() if k not in ("trainer_state", "log_metric", "log_extra")}  # lmrl's objects
        extra = kwargs if self.include is None else {k: kwargs[k] for k in self.include if k in kwargs}
        # a chat prompt's completion is sent as its text, the protocol's one form for completions
        body = {**extra, "prompts": prompts, "completions": [completion_text(c) for c in completions]}
        try:
            return json.dumps(body, default=_jsonable).encode()
        except TypeError as e:
            raise RemoteRewardError(f"remote reward {self.url}: cannot send the batch as JSON: {e}") from None

    def _fail(self, attempts: int, problem: str) -> RemoteRewardError:
        problem = " ".join(problem.split())[:300]
        return RemoteRewardError(f"remote reward {self.url} failed after {attempts} attempt(s): {problem}")

    def _parse(self, response: httpx.Response, n: int, attempts: int) -> list[float | None]:
        try:
            data = response.json()
        except ValueError:
            raise self._fail(attempts, f"response is not JSON: {response.text[:100]!r}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rewards"), list):
            raise self._fail(attempts, f'expected {{"rewards": [...]}}, got {str(data)[:100]}')
        rewards = data["rewards"]
        if len(rewards) != n:
            raise self._fail(attempts, f"server returned {len(rewards)} rewards for {n} completions")
        out: list[float | None] = []
        for i, r in enumerate(rewards):
            if r is None:
                out.append(None)
                continue
            if isinstance(r, bool) or not isinstance(r, (int, float)):
                raise self._fail(attempts, f"rewards must be numbers or null: completion {i} got {json.dumps(r)[:40]}")
            try:
                value = float(r)
            except OverflowError:  # an integer beyond float64
                value = math.inf
            if not math.isfinite(value):
                raise self._fail(attempts, f"rewards must be finite numbers or null: completion {i} got {str(r)[:40]}")
            out.append(value)
        return out

    async def __call__(self, prompts: list[Any], completions: list[str], **kwargs: Any) -> list[float | None]:
        body = self.payload(list(prompts), list(completions), **kwargs)
        headers = {"Content-Type": "application/json", **self.headers}
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            response, attempts, last = await post_retried(
                client, self.url, max_retries=self.max_retries, backoff=self.backoff, max_backoff=self.max_backoff,
                timeout=self.timeout, content=body, headers=headers)
        if response is None:
            raise self._fail(attempts, last)
        return self._parse(response, len(completions), attempts)
