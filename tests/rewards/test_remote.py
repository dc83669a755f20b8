"""RemoteScorer against a real HTTP server on 127.0.0.1 (http.server in a thread)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmrl.rewards import RemoteRewardError, RemoteScorer, RewardError, score


class RewardServer:
    """Answers POSTs according to `behaviour(request_number, body) -> (status, body_bytes, delay_s)`."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                status, payload, delay = server.behaviour(len(server.requests), body)
                if delay:
                    time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # port 0: a free port
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        # a short poll interval so that shutdown() returns quickly
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def rewards_json(values) -> bytes:
    return json.dumps({"rewards": values}).encode()


def length_rewards(n, body):
    return 200, rewards_json([float(len(c)) for c in body["completions"]]), 0


FAST = {"backoff": 0.01, "max_backoff": 0.05}


def test_remote_scorer_works_and_sends_the_protocol():
    with RewardServer(length_rewards) as srv:
        fn = RemoteScorer(srv.url, timeout=5.0, **FAST)
        out = score(
            [fn], ["p0", [{"role": "user", "content": "hi"}]], ["a", "bcd"], {"answer": ["1", "2"]},
            finished=[True, False],
        )
    assert out.scores.tolist() == [1.0, 3.0]
    assert out.metrics["reward/remote/mean"] == 2.0
    body = srv.requests[0]
    assert body["prompts"] == ["p0", [{"role": "user", "content": "hi"}]]
    assert body["completions"] == ["a", "bcd"]
    assert body["answer"] == ["1", "2"] and body["finished"] == [True, False]


def test_remote_include_limits_columns_and_nulls_are_none():
    with RewardServer(lambda n, body: (200, rewards_json([None, 0.5]), 0)) as srv:
        fn = RemoteScorer(srv.url, include=["answer"], **FAST)
        out = score([fn], ["p", "q"], ["a", "b"], {"answer": ["1", "2"], "secret": ["x", "y"]})
    assert set(srv.requests[0]) == {"prompts", "completions", "answer"}
    assert out.metrics["reward/remote/none_frac"] == 0.5
    assert out.scores.tolist() == [0.0, 0.5]


def test_remote_retries_500_then_succeeds():
    def flaky(n, body):
        return (500, b"overloaded", 0) if n <= 2 else length_rewards(n, body)

    with RewardServer(flaky) as srv:
        out = score([RemoteScorer(srv.url, max_retries=3, **FAST)], ["p"], ["abcd"])
    assert out.scores.tolist() == [4.0]
    assert len(srv.requests) == 3


def test_remote_always_500_error_names_url():
    with RewardServer(lambda n, body: (503, b"down", 0)) as srv:
        fn = RemoteScorer(srv.url, max_retries=2, **FAST)
        with pytest.raises(RemoteRewardError) as e:
            asyncio.run(fn(["p"], ["a"]))  # called directly: the scorer's own error
    assert len(srv.requests) == 3  # first attempt + 2 retries
    msg = str(e.value)
    assert srv.url in msg and "after 3 attempt(s)" in msg and "HTTP 503: 'down'" in msg and "\n" not in msg
    assert isinstance(e.value, RewardError)  # one family: the trainer catches RewardError


def test_remote_4xx_is_not_retried():
    srv = RewardServer(lambda n, body: (400, b'{"detail": "bad request"}', 0))
    with srv, pytest.raises(RewardError, match="HTTP 400") as e:
        score([RemoteScorer(srv.url, max_retries=3, **FAST)], ["p"], ["a"])
    assert len(srv.requests) == 1
    assert srv.url in str(e.value) and "bad request" in str(e.value)  # the start of the body


def test_remote_error_body_is_cut_to_one_short_line():
    body = b"Traceback (most recent call last):\n" + b"x" * 5000
    with RewardServer(lambda n, b: (500, body, 0)) as srv, pytest.raises(RemoteRewardError) as e:
        asyncio.run(RemoteScorer(srv.url, max_retries=0, **FAST)(["p"], ["a"]))
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400 and "HTTP 500: 'Traceback (most recent call last):" in msg


def test_remote_hanging_server_times_out_within_bounded_time():
    with RewardServer(lambda n, body: (*length_rewards(n, body)[:2], 2.0)) as srv:
        fn = RemoteScorer(srv.url, timeout=0.2, max_retries=1, **FAST)
        t0 = time.perf_counter()
        with pytest.raises(RewardError, match=r"timed out after 0.2s") as e:
            score([fn], ["p"], ["a"])
        elapsed = time.perf_counter() - t0
    assert elapsed < 1.5, f"2 attempts of 0.2 s took {elapsed:.2f}s"
    assert srv.url in str(e.value) and "after 2 attempt(s)" in str(e.value)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (rewards_json([1.0]), "server returned 1 rewards for 2 completions"),
        (b'{"scores": [1, 2]}', 'expected {"rewards": \\[...\\]}'),
        (b"not json", "response is not JSON"),
        (rewards_json(["1.0", 2.0]), 'rewards must be numbers or null: completion 0 got "1.0"'),
        (rewards_json([1.0, True]), "rewards must be numbers or null: completion 1 got true"),
        (rewards_json([1.0, [2.0]]), "rewards must be numbers or null: completion 1 got \\[2.0\\]"),
        (b'{"rewards": [1.0, Infinity]}', "rewards must be finite numbers or null: completion 1 got inf"),
        (b'{"rewards": [-Infinity, 1.0]}', "rewards must be finite numbers or null: completion 0 got -inf"),
        (b'{"rewards": [NaN, null]}', "rewards must be finite numbers or null: completion 0 got nan"),
        (b'{"rewards": [1e999, 1]}', "rewards must be finite numbers or null: completion 0 got inf"),
        (b'{"rewards": [1, 1' + b"0" * 400 + b"]}", "rewards must be finite numbers or null: completion 1 got 1000"),
    ],
)
def test_remote_wrong_count_and_malformed_answers(answer, message):
    srv = RewardServer(lambda n, body: (200, answer, 0))
    with srv, pytest.raises(RewardError, match=message) as e:
        score([RemoteScorer(srv.url, **FAST)], ["p", "q"], ["a", "b"])
    assert srv.url in str(e.value) and len(srv.requests) == 1  # not retried
    assert str(e.value).startswith("reward function 'remote' failed: RemoteRewardError: remote reward")
    assert "\n" not in str(e.value)
    with RewardServer(lambda n, body: (200, answer, 0)) as srv:
        out = score([RemoteScorer(srv.url, **FAST), lambda p, c, **kw: [1.0] * len(c)], ["p", "q"], ["a", "b"],
                    on_error="zero")
    assert out.metrics["reward/remote/errors"] == 1.0 and out.scores.tolist() == [1.0, 1.0]


def test_remote_large_finite_rewards_are_kept():
    with RewardServer(lambda n, body: (200, rewards_json([1e39, -1e300]), 0)) as srv:
        out = score([RemoteScorer(srv.url, **FAST)], ["p", "q"], ["a", "b"])
    assert out.scores.tolist() == [1e39, -1e300]


def test_remote_connection_refused_is_retried_then_reported():
    with RewardServer(length_rewards) as srv:
        url = srv.url
    # the server is closed: nothing listens on that port any more
    fn = RemoteScorer(url, timeout=1.0, max_retries=2, **FAST)
    with pytest.raises(RewardError, match=r"after 3 attempt\(s\): ConnectError") as e:
        score([fn], ["p"], ["a"])
    assert url in str(e.value)
    out = score([fn], ["p"], ["a"], on_error="zero")
    assert out.metrics["reward/remote/errors"] == 1.0 and out.scores.tolist() == [0.0]


def test_remote_scorer_validates_arguments():
    with pytest.raises(ValueError, match="url: expected an http"):
        RemoteScorer("127.0.0.1:8000")
    with pytest.raises(ValueError, match="max_retries: must be >= 0"):
        RemoteScorer("http://127.0.0.1:1", max_retries=-1)
