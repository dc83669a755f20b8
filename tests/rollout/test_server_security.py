"""Who gets into `lmrl serve`, and how much one request may ask for, as a user meets it: the server in a
subprocess (lmrl's decode over the shipped model: seconds to start), reached with http.client, raw sockets and
the official `openai` client. Every hostile request is one line and the server keeps serving after each."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from lmrl.config import load_config
from lmrl.errors import ConfigError, RunError
from lmrl.rollout import SamplingParams
from lmrl.rollout.remote import READY, ServerGenerator
from lmrl.rollout.server import GenerationServer, is_loopback
from tests import forked

ROOT = Path(__file__).resolve().parents[2]
KEY, SECRET = "k-3f9a1c77d2", "w-81b0e5aa4c"
GOOD = {"prompt": "12+7=", "max_tokens": 4, "temperature": 0}


def serve(*args: str, env: dict[str, str] | None = None) -> tuple[forked.Started, str]:
    """`lmrl serve ARGS --port 0` (lmrl's decode), once it prints its ready line: (process, url). A forked child
    (tests/forked.py): a process of its own, which signals reach, without the interpreter's start-up."""
    process = forked.start("serve", "rollout.backend=lmrl", *args, "--port", "0", cwd=ROOT,
                           env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    line = process.stdout.readline()
    assert line.startswith(READY), process.stderr.read()[-2000:]
    return process, line[len(READY):].strip()


@pytest.fixture(scope="module")
def server():
    process, url = serve("rollout.max_new_tokens=16", "--max-body-mb", "1", "--max-n", "8", "--max-sequences", "16",
                         env={"LMRL_API_KEY": KEY, "LMRL_WEIGHTS_SECRET": SECRET})
    yield url
    process.terminate()
    process.wait(30)


def call(url: str, method: str, path: str, body: bytes | dict | None = None, key: str | None = KEY,
         **headers: str) -> tuple[int, dict]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    connection.request(method, path, body=data, headers=headers)
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    return response.status, answer


def still_serves(url: str) -> None:
    status, answer = call(url, "POST", "/v1/completions", GOOD)
    assert status == 200 and len(answer["choices"]) == 1, answer


def test_nulls_are_not_given(server):
    """Clients send null for a parameter they leave unset: the default, as OpenAI's server does."""
    status, answer = call(server, "POST", "/v1/completions", {**GOOD, "n": None, "temperature": None, "top_p": None,
                                                              "stop": None, "seed": None, "top_k": None})
    assert status == 200 and len(answer["choices"]) == 1, answer


def refused(status: int, answer: dict, code: int, words: str) -> None:
    """One line in OpenAI's error shape."""
    assert status == code, answer
    message = answer["error"]["message"]
    assert words in message and "\n" not in message, message
    assert set(answer["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("POST", "/lmrl/generate"),
                                         ("POST", "/lmrl/weights")])
def test_every_endpoint_wants_the_key(server, method, path):
    body = GOOD if method == "POST" else None
    for key in (None, "", KEY + "x", KEY[:-1], "k" * 4096):
        status, answer = call(server, method, path, body, key=key)
        refused(status, answer, 401, "a missing or wrong API key")
        assert answer["error"]["code"] == "invalid_api_key"
    status, _ = call(server, "GET", "/health", key=None, Authorization=f"Basic {KEY}")  # only Bearer
    assert status == 401
    still_serves(server)


def test_the_openai_client_gets_in_with_the_key_only(server):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.AuthenticationError, match="a missing or wrong API key"):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).completions.create(model="m", prompt="1+1=")
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=30)
    done = client.completions.create(model="m", prompt="12+7=", max_tokens=4, temperature=0, n=2)
    assert len(done.choices) == 2 and done.choices[0].text == done.choices[1].text


def test_weights_want_their_own_secret(server, tmp_path):
    from transformers import AutoModelForCausalLM

    from lmrl.build import policy_path
    from lmrl.models.weights import export_weights
    from lmrl.rollout.wire import frames

    stream = b"".join(frames([("model.norm.weight", torch.ones(128))]))
    for secret in (None, "", SECRET + "x"):
        extra = {} if secret is None else {"X-Lmrl-Weights-Secret": secret}
        status, answer = call(server, "POST", "/lmrl/weights", stream, **extra)
        refused(status, answer, 403, "X-Lmrl-Weights-Secret")
    assert call(server, "GET", "/health")[1]["version"] == -1  # nothing was loaded
    # the client with both: the shipped model's own weights load
    model = AutoModelForCausalLM.from_pretrained(policy_path(load_config(None, [])))
    tok = _tokenizer()
    ServerGenerator(server, tok, api_key=KEY, weights_secret=SECRET).load_weights(export_weights(model), version=7)
    assert call(server, "GET", "/health")[1]["version"] == 7
    with pytest.raises(RunError, match=r"refused the weights: weights: a missing or wrong X-Lmrl-Weights-Secret"):
        ServerGenerator(server, tok, api_key=KEY).load_weights(export_weights(model), version=8)
    still_serves(server)


def test_a_weight_stream_is_cut_where_it_crosses_the_models_size(server):
    # the shipped model's 0.54M parameters in float64 and their frames' headers: about 5.4 MB; one tensor of 16 MB
    huge = [("model.norm.weight", torch.zeros(4_000_000))]
    with pytest.raises(RunError, match=r"refused the weights: body: over this server's limit of \d+ bytes "
                                       r"\(a weight push: the model's size\)"):
        ServerGenerator(server, _tokenizer(), api_key=KEY, weights_secret=SECRET).load_weights(huge, version=9)
    assert call(server, "GET", "/health")[1]["version"] != 9
    still_serves(server)


def _tokenizer():
    from lmrl.build import policy_path
    from lmrl.models.loading import load_tokenizer

    return load_tokenizer(policy_path(load_config(None, [])))


def test_a_huge_body_is_refused_before_it_is_read(server):
    parts = urlsplit(server)
    for path in ("/v1/completions", "/lmrl/generate"):
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {64 << 20}\r\n\r\n".encode())
            head, _, body = _read_answer(s)  # not a byte of the 64 MB sent: the answer comes all the same
        assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" in head, head
        refused(413, json.loads(body), 413, "over this server's limit of 1048576 bytes (lmrl serve --max-body-mb)")
    # chunked: cut where it crosses the limit
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"x" * (256 << 10)
        for _ in range(4):
            s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        s.sendall(f"{len(chunk):x}\r\n".encode())  # the fifth chunk's size is over the limit: refused unread
        head, _, body = _read_answer(s)
    assert head.startswith(b"HTTP/1.1 413"), head
    # a weight push is bounded by the model's size, not the JSON limit
    status, answer = call(server, "POST", "/lmrl/weights", b"", **{"Content-Length": str(1 << 40),
                                                                    "X-Lmrl-Weights-Secret": SECRET})
    refused(status, answer, 413, "over this server's limit")
    still_serves(server)


@pytest.mark.parametrize("head,status,words", [
    (b"GARBAGE\r\n\r\n", 400, "bad request line: 'GARBAGE' (METHOD PATH HTTP/1.1)"),
    (b"GET /health HTTP/2.0\r\n\r\n", 400, "bad request line"),
    (b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n", 400, "bad header line: b'no colon here\\r\\n'"),
    (b"GET /health HTTP/1.1\r\nX-Long: " + b"y" * (1 << 16) + b"\r\n\r\n", 431, "a header line over 65536 bytes"),
    (b"GET /health HTTP/1.1\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n", 431, "more than 100 headers"),
], ids=["request line", "HTTP/2", "header without a colon", "header too long", "too many headers"])
def test_a_malformed_request_head_is_one_line_and_the_server_goes_on(server, head, status, words):
    parts = urlsplit(server)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(head)
        answer_head, _, body = _read_answer(s)
    assert answer_head.startswith(f"HTTP/1.1 {status}".encode()) and b"Connection: close" in answer_head, answer_head
    assert json.loads(body)["error"]["message"].startswith(words), body
    still_serves(server)


def test_a_client_that_expects_100_continue_gets_it_before_it_sends_the_body(server):
    """curl asks so for a body over 1 KB, and waits a second for the interim answer before sending anyway."""
    parts = urlsplit(server)
    body = json.dumps({"prompt": "1+1=", "max_tokens": 2, "pad": "x" * 2000}).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
        s.settimeout(0.5)  # the interim answer comes at once, not with the final one
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.settimeout(10)
        s.sendall(body)
        head, _, answer = _read_answer(s)
    assert head.startswith(b"HTTP/1.1 200") and len(json.loads(answer)["choices"]) == 1, head


def _read_answer(s: socket.socket) -> tuple[bytes, bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, sep, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return head, sep, body


# (what, body, path, the error's words): the shipped model has 99 tokens and 64 positions; this server allows
# n <= 8, 16 sequences a request and max_tokens <= 16
HOSTILE = [
    ("bad JSON", b'{"prompt": "1+1=", ', "/v1/completions", "JSONDecodeError"),
    ("not an object", b"[1, 2]", "/v1/completions", "body: expected a JSON object, got list"),
    ("not UTF-8", b'{"prompt": "\xff\xfe"}', "/v1/completions", "UnicodeDecodeError"),
    ("n a string", {"prompt": "1+1=", "n": "x"}, "/v1/completions", 'n: expected an integer, got "x"'),
    ("n huge", {"prompt": "1+1=", "n": 100000}, "/v1/completions", "n: 100000 is more than this server allows (8; lmrl serve --max-n)"),
    ("n zero", {"prompt": "1+1=", "n": 0}, "/v1/completions", "n: must be >= 1, got 0"),
    ("n a float", {"prompt": "1+1=", "n": 2.5}, "/v1/completions", "n: expected an integer, got 2.5"),
    ("too many rows", {"prompt": ["1+1="] * 4, "n": 8}, "/v1/completions", "32 sequences, more than this server allows (16"),
    ("too many prompts", {"prompt": ["1+1="] * 100000}, "/v1/completions", "100000 prompts are more than this server allows"),
    ("max_tokens negative", {"prompt": "1+1=", "max_tokens": -1}, "/v1/completions", "max_tokens: must be >= 1, got -1"),
    ("max_tokens huge", {"prompt": "1+1=", "max_tokens": 1000000000}, "/v1/completions",
     "max_tokens: 1000000000 is more than this server allows (16; lmrl serve rollout.max_new_tokens=...)"),
    ("max_tokens a string", {"prompt": "1+1=", "max_tokens": "9"}, "/v1/completions", 'max_tokens: expected an integer, got "9"'),
    ("beyond the context", {"prompt": [5] * 60, "max_tokens": 16}, "/v1/completions",
     "max_tokens: a prompt of 60 tokens and max_tokens=16 exceed the model's context of 64 tokens"),
    ("token id out of vocab", {"prompt": [5, 99999999999], "max_tokens": 2}, "/v1/completions",
     "prompt 0: token id 99999999999 is outside the vocabulary of 99 tokens"),
    ("negative token id", {"prompt": [[5, -1]], "max_tokens": 2}, "/v1/completions", "token id -1 is outside"),
    ("prompt of floats", {"prompt": [[5, 1.5]]}, "/v1/completions", "prompt 0: expected a non-empty list of token ids"),
    ("prompt a number", {"prompt": 7}, "/v1/completions", "prompt: expected a string"),
    ("temperature a string", {"prompt": "1+1=", "temperature": "hot"}, "/v1/completions", "temperature: expected a number"),
    ("temperature negative", {"prompt": "1+1=", "temperature": -1}, "/v1/completions", "temperature: must be >= 0"),
    ("top_p zero", {"prompt": "1+1=", "top_p": 0}, "/v1/completions", "top_p: must be in (0, 1]"),
    ("stop a number", {"prompt": "1+1=", "stop": 5}, "/v1/completions", "stop: expected a string or a list of strings"),
    ("seed a string", {"prompt": "1+1=", "seed": "s"}, "/v1/completions", 'seed: expected an integer, got "s"'),
    ("messages missing", {"prompt": "1+1="}, "/v1/chat/completions", "messages: expected a non-empty list"),
    ("generate without prompts", {"n": 1}, "/lmrl/generate", "prompts: expected a non-empty list of lists"),
    ("generate with unknown params", {"prompts": [[5]], "params": {"evil": 1}}, "/lmrl/generate", "TypeError"),
    ("generate n huge", {"prompts": [[5]], "n": 10**9, "params": {"max_new_tokens": 4}}, "/lmrl/generate", "n: 1000000000 is more than"),
    ("generate max_new_tokens huge", {"prompts": [[5]], "params": {"max_new_tokens": 10**9}}, "/lmrl/generate",
     "max_new_tokens: 1000000000 is more than this server allows"),
    ("generate seed a list", {"prompts": [[5]], "params": {"seed": [1]}}, "/lmrl/generate", "params.seed: expected an integer"),
]


@pytest.mark.parametrize("what,body,path,words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_request_is_one_line_and_the_server_goes_on(server, what, body, path, words):
    status, answer = call(server, "POST", path, body)
    refused(status, answer, 400, words)
    still_serves(server)


def test_beyond_loopback_without_a_key_is_refused_at_start(tmp_path):
    out = forked.lmrl("serve", "--host", "0.0.0.0", "--port", "0", cwd=tmp_path, timeout=120,
                      env={**os.environ, "LMRL_API_KEY": ""})
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["lmrl: error: --host 0.0.0.0: listening beyond loopback needs an API key "
                                       "(--api-key KEY or the LMRL_API_KEY environment variable); or listen on 127.0.0.1"]
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("::")


class _Echo:
    """A generator stub: the weights endpoint is refused before it is asked for anything."""

    version = -1

    def load_weights(self, weights, version):
        raise AssertionError("weights were taken")


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_server_started_without_a_weights_secret_takes_no_weights_on_loopback_too(host):
    """A hand-started server without `--weights-secret` is an inference server: any local user could otherwise
    replace its model. (A server a run starts has a random secret of its own.)"""
    with pytest.raises(ConfigError, match="--host 0.0.0.0: listening beyond loopback needs an API key"):
        GenerationServer(_Echo(), None, "m", host="0.0.0.0")
    server = GenerationServer(_Echo(), None, "m", host=host, api_key=KEY)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        status, answer = call(url, "POST", "/lmrl/weights", b"\0\0\0\0")
        refused(status, answer, 403, "weights: this server takes no weights: it was started without a weights secret "
                "(lmrl serve --weights-secret SECRET, better LMRL_WEIGHTS_SECRET)")
        assert call(url, "GET", "/health")[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_a_run_trains_through_a_key_protected_server_and_saves_no_secret(server, tmp_path, monkeypatch):
    from lmrl import Trainer

    monkeypatch.setenv("LMRL_TEST_KEY", KEY)
    monkeypatch.setenv("LMRL_TEST_SECRET", SECRET)
    cfg = load_config(None, ["train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                             "rollout.max_new_tokens=8", f"train.output_dir={tmp_path}", "log.console=false",
                             "train.eval_every=0", "train.save_every=1", "rollout.backend=vllm-server",
                             f"rollout.vllm.server_url={server}", "rollout.vllm.server_api_key_env=LMRL_TEST_KEY",
                             "rollout.vllm.server_weights_secret_env=LMRL_TEST_SECRET"])
    history = Trainer(cfg).train().history
    assert len(history) == 2 and call(server, "GET", "/health")[1]["version"] == 2
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "lmrl_config.yaml" for p in written)
    assert "server_api_key_env: LMRL_TEST_KEY" in (tmp_path / "lmrl_config.yaml").read_text()  # the name, not the key
    for p in written:
        data = p.read_bytes()
        assert KEY.encode() not in data and SECRET.encode() not in data, p
    # without the key in its environment the run is refused before its first step, in one line
    monkeypatch.delenv("LMRL_TEST_KEY")
    with pytest.raises(RunError, match=rf"^rollout.vllm.server_url: {server}/health answered 401: authorization"):
        Trainer(cfg.model_copy(update={"train": cfg.train.model_copy(update={"output_dir": str(tmp_path / "b")})}))


def test_a_server_the_run_starts_has_keys_of_its_own_passed_by_environment():
    tok = _tokenizer()
    generator = ServerGenerator.start(["rollout.backend=lmrl"], tok, timeout=60)
    try:
        assert generator.api_key and generator.weights_secret and generator.api_key != generator.weights_secret
        cmdline = Path(f"/proc/{generator.process.pid}/cmdline").read_bytes()
        assert generator.api_key.encode() not in cmdline and generator.weights_secret.encode() not in cmdline
        assert call(generator.url, "GET", "/health", key=None)[0] == 401
        rollout = generator.generate([[1, 5, 6]], 2, SamplingParams(max_new_tokens=3, temperature=0.0))
        assert rollout.response_ids.shape[0] == 2
    finally:
        generator.close()


def test_top_logprobs_are_the_models_likeliest_tokens_in_openais_shapes():
    """Chat `logprobs: true, top_logprobs: k` and completions `logprobs: k`, read with the official client: each
    position's k alternatives are the top k of the model's own log-softmax there (a forward by hand), likeliest
    first; more than 20 is one line."""
    import openai

    from lmrl.models.shipped import load_shipped
    from lmrl.rollout.server import ModelGenerator

    model, tokenizer = load_shipped()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    server = GenerationServer(ModelGenerator(model, tokenizer), tokenizer, "m", max_prompt_length=64)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    try:
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "12+7="}], max_tokens=3,
                                              temperature=0, logprobs=True, top_logprobs=4)
        text = client.completions.create(model="m", prompt="12+7=", max_tokens=3, temperature=0, logprobs=4)
        status, answer = call(server.url, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "1+1="}], "logprobs": True, "top_logprobs": 21}, key=None)
    finally:
        server.shutdown()
    choice = chat.choices[0]
    ids = tokenizer("12+7=")["input_ids"] + [int(i) for i in choice.model_extra["token_ids"]]
    with torch.no_grad():
        expected = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    for position, entry in enumerate(choice.logprobs.content):
        want = expected[len(ids) - len(choice.logprobs.content) - 1 + position].topk(4)
        assert [tokenizer.decode([int(t)]) for t in want.indices] == [a.token for a in entry.top_logprobs]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(want.values.tolist(), abs=1e-5)
    assert [list(top) for top in text.choices[0].logprobs.top_logprobs] == [
        [a.token for a in entry.top_logprobs] for entry in choice.logprobs.content]  # the same model, both APIs
    assert status == 400 and answer["error"]["message"] == (
        "top_logprobs: 21 is more than this server allows (20; OpenAI's limit)")


@pytest.mark.parametrize("route", ["/v1/completions"])  # (chat: the shipped model has no chat template; the agent tests)
def test_the_text_leaves_the_stop_string_out_unless_asked(server, route):
    """The OpenAI API's text "will not contain the stop sequence"; vLLM's include_stop_str_in_output puts it back;
    vLLM's stop_reason names it. The token ids are the sampled ones either way."""
    chat = route.endswith("chat/completions")
    ask = {"messages": [{"role": "user", "content": "12+7="}]} if chat else {"prompt": "12+7="}
    ask |= {"max_tokens": 8, "temperature": 0}

    def text(answer):
        choice = answer["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]

    status, free = call(server, "POST", route, ask)
    assert status == 200 and text(free), free
    stop = text(free)[-1]  # the last character greedy decoding writes: it stops there again
    status, cut = call(server, "POST", route, {**ask, "stop": [stop]})
    status_kept, kept = call(server, "POST", route, {**ask, "stop": [stop], "include_stop_str_in_output": True})
    assert status == status_kept == 200, (cut, kept)
    assert text(kept).endswith(stop) and text(cut) == text(kept)[:-len(stop)]
    assert cut["choices"][0]["stop_reason"] == kept["choices"][0]["stop_reason"] == stop
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["token_ids"] == kept["choices"][0]["token_ids"]
    assert free["choices"][0]["stop_reason"] is None  # ended at EOS or the length
    status, answer = call(server, "POST", route, {**ask, "include_stop_str_in_output": "yes"})
    refused(status, answer, 400, "include_stop_str_in_output: expected true or false")
