"""The generation server's batcher: concurrent requests that sample alike become one generator call and each
gets its own rows back; seeded or differently sampled requests do not mix; one bad request fails alone. Then
the same through a real `lmrl serve`: concurrent greedy requests answer what each answers alone."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lmrl.rollout.base import Rollout, SamplingParams
from lmrl.rollout.batcher import Batcher


class Recording:
    """A generator whose completion j of prompt p is [p[0], j]: each row says whose it is. It records its calls,
    and holds the first until `release` is set, so that the requests behind it queue up."""

    version = 3

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], int, SamplingParams]] = []
        self.release = threading.Event()

    def generate(self, prompts, n, params):
        self.calls.append((prompts, n, params))
        self.release.wait(10)
        if any(p[0] < 0 for p in prompts):
            raise RuntimeError("a negative prompt")
        rows = [[p[0], j] for p in prompts for j in range(n)]
        b = len(rows)
        return Rollout(prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.bool),
                       response_ids=torch.tensor(rows), response_mask=torch.ones(b, 2, dtype=torch.bool),
                       logprobs=torch.full((b, 2), -0.5), texts=[f"{r[0]}.{r[1]}" for r in rows],
                       finished=torch.ones(b, dtype=torch.bool),
                       prompt_index=torch.arange(len(prompts)).repeat_interleave(n))


def burst(batcher: Batcher, generator: Recording, requests: list[tuple[list[list[int]], int, SamplingParams]]):
    """Send `requests` at once while the generator holds a first call; returns each one's rows (or its error)."""
    with ThreadPoolExecutor(len(requests) + 1) as pool:
        first = pool.submit(batcher.generate, [[100]], 1, SamplingParams())
        while not generator.calls:  # the first call is running: the burst queues behind it
            threading.Event().wait(0.001)

        def one(request):
            try:
                return batcher.generate(*request)
            except RuntimeError as e:
                return e

        futures = [pool.submit(one, r) for r in requests]
        while len(batcher._queue) < len(requests):  # all queued behind the first call
            threading.Event().wait(0.001)
        generator.release.set()
        first.result()
        return [f.result() for f in futures]


def test_concurrent_requests_that_sample_alike_are_one_call_and_each_gets_its_rows():
    generator = Recording()
    batcher = Batcher(generator, threading.Lock())
    params = SamplingParams(max_new_tokens=4, temperature=0.7)
    requests = [([[i], [i + 50]], 2, params) for i in range(8)]
    answers = burst(batcher, generator, requests)
    assert len(generator.calls) == 2  # the first, then the eight together
    prompts, n, _ = generator.calls[1]
    assert n == 2 and sorted(p[0] for p in prompts) == sorted(q[0] for r in requests for q in r[0])
    for (mine, _, _), rows in zip(requests, answers):
        assert rows.tokens == [[p[0], j] for p in mine for j in range(2)]  # its own rows, in order
        assert rows.texts == [f"{p[0]}.{j}" for p in mine for j in range(2)]
        assert rows.logprobs == [[-0.5, -0.5]] * 4 and rows.finished == [True] * 4 and rows.version == 3


def test_seeded_or_differently_sampled_requests_do_not_mix():
    generator = Recording()
    batcher = Batcher(generator, threading.Lock())
    a, b = SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=5)
    seeded = SamplingParams(max_new_tokens=4, seed=7)
    answers = burst(batcher, generator, [([[1]], 1, a), ([[2]], 1, b), ([[3]], 1, seeded), ([[4]], 1, seeded),
                                         ([[5]], 2, a), ([[6]], 1, a)])
    calls = sorted(sorted(p[0] for p in prompts) + [n, params.max_new_tokens, params.seed]
                   for prompts, n, params in generator.calls[1:])
    # a and the other a together; b alone; each seeded request alone (its prompt i samples with seed + i); n=2 alone
    assert calls == sorted([[1, 6, 1, 4, None], [2, 1, 5, None], [3, 1, 4, 7], [4, 1, 4, 7], [5, 2, 4, None]])
    assert [r.tokens for r in answers] == [[[1, 0]], [[2, 0]], [[3, 0]], [[4, 0]], [[5, 0], [5, 1]], [[6, 0]]]


def test_a_request_that_fails_fails_alone():
    generator = Recording()
    batcher = Batcher(generator, threading.Lock())
    answers = burst(batcher, generator, [([[1]], 1, SamplingParams()), ([[-1]], 1, SamplingParams()),
                                         ([[2]], 1, SamplingParams())])
    assert answers[0].tokens == [[1, 0]] and answers[2].tokens == [[2, 0]]
    assert isinstance(answers[1], RuntimeError) and str(answers[1]) == "a negative prompt"


def test_max_sequences_bounds_a_merged_call():
    generator = Recording()
    batcher = Batcher(generator, threading.Lock(), max_sequences=4)
    burst(batcher, generator, [([[i]], 2, SamplingParams()) for i in range(5)])
    assert sorted(len(prompts) * n for prompts, n, _ in generator.calls[1:]) == [2, 4, 4]


def test_concurrent_requests_to_a_real_server_answer_what_each_answers_alone():
    from tests.rollout.test_server_security import KEY, call, serve

    process, url = serve("rollout.max_new_tokens=8", env={"LMRL_API_KEY": KEY})
    try:
        prompts = [f"{a}+{b}=" for a in range(3, 9) for b in (11, 47)]
        alone = [call(url, "POST", "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0})[1]
                 for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: call(url, "POST", "/v1/completions",
                                                    {"prompt": p, "max_tokens": 8, "temperature": 0,
                                                     "logprobs": 1})[1], prompts))
        for one, other in zip(alone, together):
            assert other["choices"][0]["text"] == one["choices"][0]["text"], json.dumps([one, other])[:500]
            assert other["choices"][0]["token_ids"] == one["choices"][0]["token_ids"]
            assert other["usage"] == one["usage"]
        assert len({a["choices"][0]["text"] for a in alone}) > 1  # the prompts do not all answer alike
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.parametrize("n", [1, 3])
def test_rows_of_a_request_are_its_prompts_groups(n):
    generator = Recording()
    generator.release.set()
    rows = Batcher(generator, threading.Lock()).generate([[7], [8]], n, SamplingParams())
    assert rows.tokens == [[p, j] for p in (7, 8) for j in range(n)]


def test_equal_prompts_of_different_requests_are_one_prompt_with_more_completions():
    generator = Recording()
    batcher = Batcher(generator, threading.Lock())
    params = SamplingParams(max_new_tokens=4, temperature=0.7)
    requests = [([[7]], 1, params)] * 4 + [([[8]], 1, params)] * 2 + [([[7], [8]], 1, params)]
    answers = burst(batcher, generator, requests)
    prompts, n, _ = generator.calls[1]
    # 7 asked 5 times, 8 three times: gcd 1, as asked; without the last request 7 x4 and 8 x2 share by 2
    assert sorted(p[0] for p in prompts) == [7] * 5 + [8] * 3 and n == 1
    generator = Recording()
    answers = burst(Batcher(generator, threading.Lock()), generator, requests[:6])
    prompts, n, _ = generator.calls[1]
    assert sorted(p[0] for p in prompts) == [7, 7, 8] and n == 2  # a prefill per distinct prompt (and group)
    rows = [a.tokens[0] for a in answers]
    assert sorted(map(tuple, rows)) == [(7, 0), (7, 0), (7, 1), (7, 1), (8, 0), (8, 1)]  # each row handed out once
    assert [r[0] for r in rows] == [7, 7, 7, 7, 8, 8] and all(a.texts == [f"{a.tokens[0][0]}.{a.tokens[0][1]}"]
                                                              for a in answers)


class Precision(Recording):
    """Records the autocast each call runs under."""

    def generate(self, prompts, n, params):
        self.autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        return super().generate(prompts, n, params)


def test_calls_run_under_the_precision_of_the_thread_that_set_it():
    from lmrl.rollout.batcher import thread_precision

    generator = Precision()
    generator.release.set()
    batcher = Batcher(generator, threading.Lock())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        batcher.generate([[1]], 1, SamplingParams())  # the batcher's thread does not inherit this thread's autocast
        assert generator.autocast[0] is False
        batcher.precision = thread_precision()
    batcher.generate([[1]], 1, SamplingParams())
    assert generator.autocast == (True, torch.bfloat16)
    batcher.precision = thread_precision()  # no autocast here
    batcher.generate([[1]], 1, SamplingParams())
    assert generator.autocast[0] is False


def test_32_concurrent_openai_clients_cost_the_server_at_most_1_5x_one_request_with_n_32(tmp_path):
    """32 agents' one-completion requests, at once, against one request with n=32 of the same prompt and max_tokens,
    through a real `lmrl serve` and the official client (each call ~1 ms of the client's CPU, ~0.5 ms of the
    server's): a model whose decode is long against that, so that what is measured is the batching.

    Held to 1.5x in the server process's CPU time, summed over 5 interleaved rounds: served one at a time, the 32
    requests would cost it about 32 decodes. Wall time is what a user waits, but in the suite the other worker's
    tests share the 2 cores (1.82x measured there, 1.22x alone), so the wall-clock ratio is measured by
    benchmarks/serve_concurrency.py and only printed here."""
    import statistics
    import time

    from openai import OpenAI

    from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
    from tests.rollout.test_server_security import serve

    tok = char_tokenizer()
    tiny_causal_lm(tok, hidden_size=64, num_layers=2, max_position_embeddings=256).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    process, url = serve(f"model.name_or_path={tmp_path}", "rollout.max_new_tokens=192", env={"LMRL_API_KEY": "k"})
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=120)
        ask = {"model": "m", "prompt": "12+34=", "max_tokens": 192, "temperature": 0.0}

        def batched() -> tuple[float, list[list[int]]]:
            start = time.perf_counter()
            answer = client.completions.create(**ask, n=32)
            return time.perf_counter() - start, [c.model_extra["token_ids"] for c in answer.choices]

        def concurrent() -> tuple[float, list[list[int]]]:
            barrier = threading.Barrier(33)

            def one(_):
                barrier.wait()
                return client.completions.create(**ask, n=1).choices[0].model_extra["token_ids"]

            with ThreadPoolExecutor(32) as pool:
                futures = [pool.submit(one, i) for i in range(32)]
                barrier.wait()
                start = time.perf_counter()
                rows = [f.result() for f in futures]
            return time.perf_counter() - start, rows

        def server_cpu() -> float:  # seconds of CPU the server process (all its threads) has used
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        batched(), concurrent()  # warm: the client's 32 kept-alive connections, the server's threads
        times: dict[str, list[float]] = {"batched": [], "concurrent": []}
        cpu = {"batched": 0.0, "concurrent": 0.0}
        for _ in range(5):  # interleaved, so a busy moment of the machine falls on both
            for name, measure in (("batched", batched), ("concurrent", concurrent)):
                before = server_cpu()
                seconds, rows = measure()
                cpu[name] += server_cpu() - before
                times[name].append(seconds)
                assert len(rows) == 32 and len({len(r) for r in rows}) == 1 and len(rows[0]) > 100  # the same work
        ratio = cpu["concurrent"] / cpu["batched"]
        wall = statistics.median(times["concurrent"]) / statistics.median(times["batched"])
        print(f"server CPU {ratio:.2f}x, wall {wall:.2f}x")
        assert ratio <= 1.5, f"32 concurrent requests cost the server {ratio:.2f}x the CPU of one with n=32: {cpu}"
    finally:
        process.terminate()
        process.wait(30)


class Slow(Recording):
    """Each call takes `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.release.set()

    def generate(self, prompts, n, params):
        threading.Event().wait(self.seconds)
        return super().generate(prompts, n, params)


def test_after_a_long_call_a_burst_spread_over_more_than_the_minimum_window_is_still_one_call():
    # window 1 ms; after a 1 s call, a tenth of it: 100 ms, ten times the gaps below (a loaded CPU once stretched
    # them past the 50 ms of a 0.5 s call)
    generator = Slow(1.0)
    batcher = Batcher(generator, threading.Lock())
    batcher.generate([[1]], 1, SamplingParams())
    with ThreadPoolExecutor(4) as pool:
        futures = []
        for i in range(4):  # 10 ms apart: each gap ten times the 1 ms minimum
            futures.append(pool.submit(batcher.generate, [[10 + i]], 1, SamplingParams()))
            threading.Event().wait(0.01)
        rows = [f.result().tokens for f in futures]
    assert rows == [[[10 + i, 0]] for i in range(4)]
    assert [len(prompts) for prompts, _, _ in generator.calls] == [1, 4]
