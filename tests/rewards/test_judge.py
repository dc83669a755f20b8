"""The judge reward (`fn: judge`) against a stub OpenAI endpoint on 127.0.0.1 (http.server in a thread) that
answers fixed texts and counts the requests: the readers, garbage counted under reward.on_error, timeouts,
retries, the cache, the API key's header, and the config's one-line refusals."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmrl.errors import ConfigError, RewardError
from lmrl.rewards import Failed, JudgeScorer, required_columns, resolve_reward, score


class Stub:
    """An OpenAI-like endpoint: `behaviour(request_number, body) -> (status, answer, delay_s)`; an answer that is a
    string is sent as the judge's text (chat or completions form, by the path asked)."""

    def __init__(self, behaviour):
        self.behaviour, self.requests, self.headers = behaviour, [], []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((self.path, body))
                stub.headers.append(dict(self.headers))
                status, answer, delay = stub.behaviour(len(stub.requests), body)
                time.sleep(delay)
                if isinstance(answer, str) and status == 200:
                    answer = chat(answer) if self.path.endswith("/chat/completions") else completion(answer)
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (the timeout test)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def chat(text, logprobs=None):
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}


def completion(text, logprobs=None):
    return {"choices": [{"index": 0, "text": text, "logprobs": logprobs}]}


def by_completion(texts):
    """Answer each request by the completion its prompt holds (after 'A: ')."""
    return lambda n, body: (200, texts[body["messages"][-1]["content"].split("A: ")[1]], 0)


FAST = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 5}
TEMPLATE = "Q: {prompt} Gold: {answer} A: {completion}"


def judge(url, **options):
    return resolve_reward("judge", url=url, model="stub-judge", template=TEMPLATE, **{**FAST, **options})


def test_a_well_formed_score_is_scaled_and_its_text_kept():
    texts = {"4": "Correct. **Score: 9**", "5": "Wrong. Score: 1 ... final Score: 2.5"}
    with Stub(by_completion(texts)) as stub:
        out = score([judge(stub.url)], ["2+2=", "2+2="], ["4", "5"], {"answer": ["4", "4"]})
    assert out.scores.tolist() == pytest.approx([0.9, 0.25], abs=1e-12)  # the last score on [0, 10]
    assert out.extra_columns["judge/text"] == [texts["4"], texts["5"]]
    path, body = min(stub.requests, key=lambda r: r[1]["messages"][-1]["content"])  # they arrive in any order
    assert path == "/v1/chat/completions" and body["model"] == "stub-judge" and body["temperature"] == 0.0
    assert body["messages"] == [{"role": "user", "content": "Q: 2+2= Gold: 4 A: 4"}]
    assert out.metrics["reward/judge/requests"] == 2 and out.metrics["reward/judge/tokens"] == 26
    assert out.metrics["reward/judge/errors"] == 0


def test_garbage_is_counted_under_on_error_never_a_silent_zero():
    texts = {"a": "Score: 10", "b": "I like it.", "c": "Score: 11", "d": "Score: 5"}
    prompts, completions, columns = ["p"] * 4, list("abcd"), {"answer": ["x"] * 4}
    with Stub(by_completion(texts)) as stub:
        out = score([judge(stub.url)], prompts, completions, columns, on_error="zero")
        assert out.scores.tolist() == [1.0, 0.0, 0.0, 0.5]
        assert out.metrics["reward/judge/errors"] == 2  # one per garbage answer, not one for the batch
        assert out.errors["judge"].startswith("reward function 'judge' failed on completion 1: the judge's answer "
                                              "holds no score") and out.errors["judge"].endswith("(and 1 more)")
        assert out.extra_columns["judge/text"][1] == "I like it."  # what the judge said stays readable
        with pytest.raises(RewardError, match=r"^reward function 'judge' failed on completion 1: the judge's answer "
                                              r"holds no score \(no number after 'Score:'\): 'I like it.'$"):
            score([judge(stub.url, cache_size=0)], prompts, completions, columns)
        with pytest.raises(RewardError, match=r"failed on completion 0: the judge's score '11' is outside its "
                                              r"scale \[0, 10\]"):
            score([judge(stub.url)], ["p"], ["c"], {"answer": ["x"]})


def test_a_judge_hanging_past_the_timeout_is_retried_then_one_line_naming_the_url():
    with Stub(lambda n, body: (200, "Score: 1", 3.0)) as stub:
        t0 = time.perf_counter()
        with pytest.raises(RewardError) as e:
            score([judge(stub.url, timeout=0.3, max_retries=2)], ["p"], ["c"], {"answer": ["x"]})
        took = time.perf_counter() - t0
    assert str(e.value) == (f"reward function 'judge' failed: JudgeError: judge {stub.url}/chat/completions failed "
                            "after 3 attempt(s): timed out after 0.3s")
    assert len(stub.requests) == 3 and took < 2.5  # 3 x 0.3 s and the backoff, not the stub's 3 s


def test_a_500_is_retried_then_succeeds_and_a_4xx_is_not_retried():
    with Stub(lambda n, body: (500, {"error": "busy"}, 0) if n == 1 else (200, "Score: 3", 0)) as stub:
        out = score([judge(stub.url)], ["p"], ["c"], {"answer": ["x"]})
    assert out.scores.tolist() == [pytest.approx(0.3)] and len(stub.requests) == 2
    assert out.metrics["reward/judge/retries"] == 1 and out.metrics["reward/judge/requests"] == 2
    with (Stub(lambda n, body: (401, {"error": {"message": "bad key"}}, 0)) as stub,
          pytest.raises(RewardError, match=r"judge http://.*/v1/chat/completions failed after 1 attempt\(s\): "
                                           r"HTTP 401: .*bad key")):
        score([judge(stub.url)], ["p"], ["c"], {"answer": ["x"]})
    assert len(stub.requests) == 1


def test_the_same_request_is_sent_once():
    with Stub(lambda n, body: (200, "Score: 7", 0)) as stub:
        fn = judge(stub.url)
        first = score([fn], ["p", "p", "q"], ["c", "c", "c"], {"answer": ["x"] * 3})
        assert len(stub.requests) == 2 and first.metrics["reward/judge/cache_hits"] == 1  # a repeat in the batch
        again = score([fn], ["p", "q"], ["c", "c"], {"answer": ["x", "x"]})
        assert len(stub.requests) == 2 and again.metrics["reward/judge/cache_hits"] == 2
        assert again.scores.tolist() == [pytest.approx(0.7)] * 2 and again.extra_columns["judge/text"] == ["Score: 7"] * 2
        score([fn], ["p"], ["c"], {"answer": ["y"]})  # another reference: another request
        score([judge(stub.url, temperature=0.5)], ["p"], ["c"], {"answer": ["x"]})  # another scorer, own cache
    assert len(stub.requests) == 4


def test_yes_no_reads_the_first_tokens_probabilities():
    top = [{"token": " Yes", "logprob": -0.4}, {"token": "No", "logprob": -1.3}, {"token": "yes", "logprob": -3.0},
           {"token": "Maybe", "logprob": -2.0}]
    answer = chat("Yes", {"content": [{"token": " Yes", "logprob": -0.4, "top_logprobs": top}]})
    with Stub(lambda n, body: (200, answer, 0)) as stub:
        out = score([judge(stub.url, reader="yes_no")], ["p"], ["c"], {"answer": ["x"]})
    p_yes, p_no = math.exp(-0.4) + math.exp(-3.0), math.exp(-1.3)
    assert out.scores.item() == pytest.approx(p_yes / (p_yes + p_no), abs=1e-12)
    body = stub.requests[0][1]
    assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["max_tokens"] == 1
    # the completions form: OpenAI's {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}]}
    answer = completion("no", {"tokens": ["no"], "token_logprobs": [-0.1], "top_logprobs": [{"no": -0.1, "yes": -2.5}]})
    with Stub(lambda n, body: (200, answer, 0)) as stub:
        out = score([judge(stub.url, reader="yes_no", api="completions")], ["p"], ["c"], {"answer": ["x"]})
    assert out.scores.item() == pytest.approx(math.exp(-2.5) / (math.exp(-2.5) + math.exp(-0.1)), abs=1e-12)
    assert stub.requests[0][0] == "/v1/completions" and stub.requests[0][1]["logprobs"] == 20
    assert stub.requests[0][1]["prompt"] == "Q: p Gold: x A: c"
    # neither yes nor no, or no log-probs at all: that completion's failure
    for answer, why in [(chat("Maybe", {"content": [{"token": "Maybe", "logprob": -0.1, "top_logprobs": []}]}),
                         "the judge's first token is neither yes nor no: ['Maybe']"),
                        (chat("Yes", None), "the judge's answer has no log-probs of its first token")]:
        with (Stub(lambda n, body, answer=answer: (200, answer, 0)) as stub,
              pytest.raises(RewardError, match=rf"^reward function 'judge' failed on completion 0: {re.escape(why)}")):
            score([judge(stub.url, reader="yes_no")], ["p"], ["c"], {"answer": ["x"]})


def test_the_api_key_comes_from_the_named_variable(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-123")
    with Stub(lambda n, body: (200, "Score: 5", 0)) as stub:
        score([judge(stub.url, api_key_env="JUDGE_TEST_KEY")], ["p"], ["c"], {"answer": ["x"]})
    assert stub.headers[0]["Authorization"] == "Bearer sk-test-123"
    assert "sk-test-123" not in json.dumps(stub.requests)


def test_an_endpoint_answering_something_else_fails_the_call():
    with Stub(lambda n, body: (200, {"rewards": [1.0]}, 0)) as stub:
        out = score([judge(stub.url)], ["p", "q"], ["c", "c"], {"answer": ["x", "x"]}, on_error="zero")
    assert out.metrics["reward/judge/errors"] == 1 and out.errors["judge"].startswith(
        f"reward function 'judge' failed: JudgeError: judge {stub.url}/chat/completions: expected an OpenAI completion")


@pytest.mark.parametrize("options, line", [
    ({"api_key": "sk-1"}, "api_key: a saved config must not hold a secret; put the key in an environment variable "
                          "and name it in api_key_env"),
    ({"api_key_env": "LMRL_NO_SUCH_KEY"}, "api_key_env: the environment variable 'LMRL_NO_SUCH_KEY' (the judge's API "
                                          "key) is not set"),
    ({"template": "Rate {prompt}"}, "template: has no {completion}, so the judge would not see what it judges"),
    ({"template": "{completion} {0}"}, "template: {0} is not a field; use {prompt}, {completion} or {<column>}"),
    ({"template": "{completion} {"}, "template: Single '{' encountered in format string"),
    ({"url": "http://h/v1/chat/completions"}, "url: give the API's base (e.g. http://host:port/v1), not an endpoint"),
    ({"reader": "logits"}, "reader: expected 'regex' or 'yes_no', got 'logits'"),
    ({"api": "responses"}, "api: expected 'chat' or 'completions', got 'responses'"),
    ({"scale": [10, 0]}, "scale: expected [low, high], two finite numbers with low < high, got [10, 0]"),
    ({"pattern": "Score: ("}, "pattern: 'Score: (' is not a regular expression"),
    ({"concurrency": 0}, "concurrency: must be a whole number >= 1, got 0"),
    ({"max_tokens": 0}, "max_tokens: must be a whole number >= 1, got 0"),
    ({"temperature": -1}, "temperature: must be a number >= 0, got -1"),
    ({"yes": ["ok"], "no": ["OK"]}, "yes, no: expected two non-empty, disjoint lists of tokens"),
    ({"colour": "blue"}, "unknown option(s) ['colour']"),
])
def test_bad_options_are_one_line(options, line):
    with pytest.raises(ConfigError) as e:
        resolve_reward("judge", **{"url": "http://127.0.0.1:1/v1", "model": "m", "template": TEMPLATE, **options})
    assert str(e.value).startswith(f"reward 'judge': {line}") and "\n" not in str(e.value)


def test_the_templates_columns_are_required_of_every_row():
    fn = resolve_reward("judge", url="http://127.0.0.1:1/v1", model="m", template="{completion} vs {answer} ({level})")
    assert isinstance(fn, JudgeScorer) and required_columns([fn]) == {"answer": ["judge"], "level": ["judge"]}
    assert Failed("x") == Failed("x")



def test_a_judge_slower_than_reward_timeout_is_named_by_its_url():
    with Stub(lambda n, body: (200, "Score: 1", 2.0)) as stub, pytest.raises(RewardError) as e:
        score([judge(stub.url, timeout=30)], ["p"], ["c"], {"answer": ["x"]}, timeout=0.5)
    assert str(e.value) == f"reward function 'judge' failed: TimeoutError: timed out after 0.5s waiting for {stub.url}"


def test_at_most_concurrency_requests_are_in_flight():
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def slow(n, body):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.15)
        with lock:
            state["now"] -= 1
        return 200, "Score: 4", 0

    with Stub(slow) as stub:
        t0 = time.perf_counter()
        out = score([judge(stub.url, concurrency=3)], ["p"] * 9, [str(i) for i in range(9)], {"answer": ["x"] * 9})
        took = time.perf_counter() - t0
    assert state["most"] == 3 and len(stub.requests) == 9 and out.scores.tolist() == [pytest.approx(0.4)] * 9
    assert took > 0.4  # three rounds of 0.15 s: never more than three at once


def test_two_judges_keep_their_own_names():
    from lmrl.rewards import reward_set_from_config

    with Stub(lambda n, body: (200, "Score: 2" if "strict" in body["messages"][-1]["content"] else "Score: 8", 0)) as stub:
        entries = [{"fn": "judge", "name": name, "url": stub.url, "model": "m", "template": f"{name} {{completion}}"}
                   for name in ("strict", "kind")]
        out = score(reward_set_from_config(entries), ["p"], ["c"])
    assert out.per_function["strict"].tolist() == [pytest.approx(0.2)] and out.per_function["kind"].tolist() == [0.8]
    assert out.extra_columns == {"strict/text": ["Score: 2"], "kind/text": ["Score: 8"]}
    assert out.metrics["reward/strict/requests"] == 1 and out.metrics["reward/kind/requests"] == 1
