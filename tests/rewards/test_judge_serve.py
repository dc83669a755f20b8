"""The judge reward through real processes: a real `lmrl serve rollout.backend=lmrl` (the shipped tiny model) judges
with both readers, each score what the server's own answer to the same request gives; `lmrl train
examples/judge.yaml` runs against it; a judge that stops answering mid-run stops the run after a checkpoint with
one line naming its URL."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from lmrl.models.shipped import SHIPPED_MODEL
from lmrl.rewards import resolve_reward, score
from lmrl.rollout.remote import ServerGenerator
from tests.forked import lmrl

ROOT = Path(__file__).resolve().parents[2]
# the judge computes the completion's sum: its answer is digits, or nothing (it stops) when it knows no more
SUMS = ["12+7", "57+68", "9+9", "3+4", "40+41", "5+5", "88+3", "1+1"]
QUICK = ["train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "data.num_eval_prompts=0",
         "log.console=false", "log.samples_every=1", "rollout.max_new_tokens=8"]


@pytest.fixture(scope="module")
def judge_server():
    """`lmrl serve rollout.backend=lmrl --port 0`, the shipped tiny model: a real OpenAI-compatible endpoint, which
    wants the API key it was started with (in the variable KEY, which the judges name in api_key_env)."""
    server = ServerGenerator.start(["rollout.backend=lmrl", "rollout.max_new_tokens=16"],
                                   AutoTokenizer.from_pretrained(SHIPPED_MODEL), timeout=60)
    os.environ[KEY] = server.api_key  # (inherited by the `lmrl train` processes below)
    yield server.url
    server.close()
    os.environ.pop(KEY, None)


KEY = "LMRL_TEST_JUDGE_KEY"


def ask(url: str, body: dict) -> dict:
    """The server's own answer to a request, as the judge sends it."""
    headers = {"Authorization": f"Bearer {os.environ[KEY]}"}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60).json()["choices"][0]


def test_the_regex_reader_scores_what_the_server_answers_and_counts_the_rest(judge_server):
    fn = resolve_reward("judge", url=judge_server + "/v1", model="tiny-addition", api="completions", api_key_env=KEY,
                        template="{completion}=", pattern=r"^(\d+)$", scale=[0, 99], max_tokens=4)
    out = score([fn], ["p"] * len(SUMS), SUMS, on_error="zero")
    expected, garbage = [], 0
    for s in SUMS:
        text = ask(judge_server, fn.request("p", s, {}))["text"]
        number = re.fullmatch(r"\d+", text)
        fine = number is not None and int(text) <= 99
        expected.append(int(text) / 99 if fine else 0.0)
        garbage += not fine
    assert out.extra_columns["judge/text"] == [ask(judge_server, fn.request("p", s, {}))["text"] for s in SUMS]
    assert out.scores.tolist() == pytest.approx(expected, abs=1e-12)
    assert 0 < garbage < len(SUMS) and out.metrics["reward/judge/errors"] == garbage  # "125" and "" among them
    # the default reader wants "Score: <n>": a model that only does sums never writes it, and every one is counted
    fn = resolve_reward("judge", url=judge_server + "/v1", model="tiny-addition", api="completions", api_key_env=KEY,
                        template="{completion}=", max_tokens=4)
    out = score([fn], ["p"] * len(SUMS), SUMS, on_error="zero")
    assert out.metrics["reward/judge/errors"] == len(SUMS) and out.scores.tolist() == [0.0] * len(SUMS)
    assert "holds no score" in out.errors["judge"]


def test_the_yes_no_reader_is_the_probability_in_the_servers_logprobs(judge_server):
    """`lmrl serve` gives the first token's 20 likeliest alternatives (`logprobs: 20`, the model's distribution at
    temperature 1): P(yes)/(P(yes)+P(no)) over them is a probability strictly between 0 and 1, what the answer's
    own alternatives give."""
    fn = resolve_reward("judge", url=judge_server + "/v1", model="tiny-addition", api="completions", api_key_env=KEY,
                        template="{completion}=", reader="yes_no", yes=["1"], no=["2", "9"],
                        temperature=1.0, params={"seed": 5})
    out = score([fn], ["p"] * len(SUMS), SUMS, on_error="zero")
    expected, garbage = [], 0
    for s in SUMS:
        body = fn.request("p", s, {})
        assert body["max_tokens"] == 1 and body["logprobs"] == 20 and body["seed"] == 5
        logprobs = ask(judge_server, body)["logprobs"]
        token, lp, [top] = logprobs["tokens"][0], logprobs["token_logprobs"][0], logprobs["top_logprobs"]
        values = list(top.values())
        assert values == sorted(values, reverse=True) and sum(map(math.exp, values)) <= 1 + 1e-5
        assert top[token] == pytest.approx(lp, abs=1e-5)  # sampled at temperature 1: its own entry, the same value
        p_yes = sum(math.exp(v) for t, v in top.items() if t == "1")
        p_no = sum(math.exp(v) for t, v in top.items() if t in ("2", "9"))
        expected.append(p_yes / (p_yes + p_no) if p_yes + p_no else 0.0)
        garbage += p_yes + p_no == 0
    assert out.scores.tolist() == pytest.approx(expected, abs=1e-9)
    assert out.metrics["reward/judge/errors"] == garbage == 0
    assert all(0.0 < v < 1.0 for v in out.scores.tolist())  # a probability, not the 1 or 0 of the sampled token


def test_the_example_trains_two_steps_against_a_served_judge(judge_server, tmp_path):
    text = (ROOT / "examples" / "judge.yaml").read_text()
    assert "url: http://127.0.0.1:8000/v1" in text
    (tmp_path / "judge.yaml").write_text(text.replace("url: http://127.0.0.1:8000/v1",
                                                      f"url: {judge_server}/v1\n      api_key_env: {KEY}"))
    out = lmrl("train", "judge.yaml", *QUICK, "train.output_dir=run", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # every completion judged: sent, or found in the cache
        assert r["reward/judge/requests"] + r["reward/judge/cache_hits"] == 4 and r["reward/judge/retries"] == 0
        assert 0 <= r["reward/judge/errors"] <= 4 and 0 <= r["reward/judge/mean"] <= 1
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(isinstance(s["judge/text"], str) for s in samples)  # what the judge said, kept
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


class _Judge(BaseHTTPRequestHandler):
    """A judge that answers the first `good` requests and then HTTP 503."""

    good = 4
    count = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).count += 1
        ok = self.count <= self.good
        data = json.dumps({"choices": [{"message": {"content": "Score: 6"}}]} if ok else {"error": "overloaded"})
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args):
        pass


def test_a_judge_that_stops_answering_stops_the_run_after_a_checkpoint(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    entry = f"{{fn: judge, url: '{url}', model: m, template: '{{prompt}} {{completion}}', max_retries: 1, backoff: 0.01}}"
    try:
        out = lmrl("train", *QUICK, "train.steps=3", "train.save_every=1", f"reward.functions=[{entry}]",
                   "rollout.temperature=1.5", "train.output_dir=run", cwd=tmp_path, timeout=300)
    finally:
        server.shutdown()
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith(f"lmrl: error: step 2: reward function 'judge' failed: JudgeError: judge "
                               f"{url}/chat/completions failed after 2 attempt(s): HTTP 503: "), lines[0]
    assert lines[0].endswith("checkpoint-1 written: add train.resume=auto to continue"), lines[0]
    assert (tmp_path / "run" / "checkpoint-1" / "model.safetensors").is_file()
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert 1 in steps and 2 not in steps


class _Says42(BaseHTTPRequestHandler):
    """A judge that answers "42" to everything: no score."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        data = json.dumps({"choices": [{"message": {"content": "42"}}]})
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["garbage", "down", "api_key", "api_key_env", "template"])
def test_the_judges_bad_inputs_are_one_line(case, tmp_path):
    """The rows of docs/bad-inputs.md for the judge, as `lmrl train` prints them."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Says42)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1] if case == 'garbage' else _free_port()}/v1"
    options = {"garbage": "", "down": ", max_retries: 0", "api_key": ", api_key: sk-1",
               "api_key_env": ", api_key_env: JUDGE_KEY", "template": ""}[case]
    template = "'Rate {prompt}'" if case == "template" else "'{prompt} {completion}'"
    entry = f"{{fn: judge, url: '{url}', model: m, template: {template}{options}}}"
    env = {k: v for k, v in os.environ.items() if k != "JUDGE_KEY"}
    try:
        out = lmrl("train", *QUICK, f"reward.functions=[{entry}]", "train.output_dir=run", cwd=tmp_path, env=env,
                   timeout=300)
    finally:
        server.shutdown()
    line = {
        "garbage": "step 1: reward function 'judge' failed on completion 0: the judge's answer holds no score "
                   "(no number after 'Score:'): '42'",
        "down": f"step 1: reward function 'judge' failed: JudgeError: judge {url}/chat/completions failed after "
                "1 attempt(s): ConnectError: All connection attempts failed",
        "api_key": "reward.functions[0]: reward 'judge': api_key: a saved config must not hold a secret; put the key "
                   "in an environment variable and name it in api_key_env",
        "api_key_env": "reward.functions[0]: reward 'judge': api_key_env: the environment variable 'JUDGE_KEY' (the "
                       "judge's API key) is not set",
        "template": "reward.functions[0]: reward 'judge': template: has no {completion}, so the judge would not see "
                    "what it judges",
    }[case]
    assert out.returncode == (1 if case in ("garbage", "down") else 2), out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [f"lmrl: error: {line}"]
    assert (tmp_path / "run").exists() == (case in ("garbage", "down"))  # refused ones write nothing
    assert "sk-1" not in out.stderr
