"""Requests that join a running decode: a row that joined mid-decode samples what it samples alone, and a request
sent while another decodes joins it instead of waiting for it to end."""

from __future__ import annotations

import threading

import pytest
import torch

import lmrl.engine.engine as engine_module
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
from lmrl.rollout import HFGenerator, SamplingParams
from lmrl.rollout.batcher import Batcher
from lmrl.rollout.joining_decode import Joining, JoiningDecode, joinable
from tests.rollout.test_hf_generator import scrambled_model


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def generator(request, tok):
    return HFGenerator(scrambled_model(tok, request.param), tok, seed=0, eos_token_id=[])


@pytest.fixture(params=["module by module", "the model's forward"])
def steps(request, monkeypatch):
    """Both of the engine's steps: module by module (Llama / Qwen2) and the model's own forward (every other model)."""
    monkeypatch.setattr(engine_module, "llama_supports", lambda model: request.param == "module by module")
    return request.param


def alone(generator: HFGenerator, prompt: list[int], max_new: int, stop: list[str] = ()) -> tuple[list, list]:
    rollout = generator.generate([prompt], 1, SamplingParams(max_new_tokens=max_new, temperature=0.0, stop=list(stop)))
    k = int(rollout.response_mask.sum())
    return rollout.response_ids[0, :k].tolist(), rollout.logprobs[0, :k].tolist()


def test_a_row_that_joins_mid_decode_samples_what_it_samples_alone(generator, tok, steps):
    """Rows join at different steps, with prompts shorter and longer than the columns written so far (the cache is
    rebuilt with room on the left), and leave at different steps; each equals its own decode alone, greedy."""
    prompts = {"a": tok.encode("what is 2+2?"), "b": tok.encode("hello there, how are you today my friend"),
               "c": tok.encode("x"), "d": tok.encode("ab")}
    prompts["e"] = tok.encode("what is 3+4?")
    max_new = {"a": 14, "b": 9, "c": 5, "d": 7, "e": 60}
    # b's prompt is longer than the 12 + 3 columns written by then (room is made on the left); c ends first, and d
    # takes its slot; e wants more columns than are left (the cache grows, dropping the columns no row reads)
    joins_at = {"a": 0, "b": 3, "c": 3, "d": 6, "e": 12}
    decode = JoiningDecode(generator, SamplingParams(temperature=0.0))
    assert type(decode.engine.step_fn).__name__ == ("LlamaStep" if steps == "module by module" else "ModelStep")
    got = {}
    with torch.inference_mode():
        for step in range(80):
            joining = [Joining(prompts[k], max_new[k], k) for k, s in joins_at.items() if s == step]
            if joining:
                decode.add(joining)
            if not len(decode):
                break
            got.update({e.owner: e for e in decode.step()})
    assert sorted(got) == ["a", "b", "c", "d", "e"] and decode.rebuilds == 3, decode.rebuilds
    for k, ended in got.items():
        tokens, logprobs = alone(generator, prompts[k], max_new[k])
        assert ended.tokens == tokens and not ended.finished, k
        torch.testing.assert_close(torch.tensor(ended.logprobs), torch.tensor(logprobs), atol=1e-5, rtol=0)
    assert len({tuple(e.tokens[:5]) for e in got.values()}) > 1  # the prompts do not all answer alike


def test_a_joined_row_ends_at_its_stop_string_as_alone(generator, tok, steps):
    prompt = tok.encode("what is 2+2?")
    tokens, _ = alone(generator, prompt, 12)
    stop = tok.decode(tokens[3:5])  # a string the greedy completion reaches at its 5th token
    decode = JoiningDecode(generator, SamplingParams(temperature=0.0, stop=[stop]))
    with torch.inference_mode():
        decode.add([Joining(tok.encode("hello"), 12, "first")])
        ended = decode.step() + decode.step()
        decode.add([Joining(prompt, 12, "second")])
        while len(decode):
            ended += decode.step()
    second = next(e for e in ended if e.owner == "second")
    assert second.tokens == alone(generator, prompt, 12, [stop])[0] and second.finished
    assert second.text.endswith(stop)


def test_a_request_sent_while_another_decodes_joins_it_instead_of_waiting(tok, steps):
    """Counted in forward passes, not seconds: the second request, sent at the first's 4th step, is done within a
    few steps of the first's end, where two calls one after the other would take twice as many."""
    generator = HFGenerator(tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0), tok, seed=0, eos_token_id=[])
    assert joinable(generator) is generator
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    first, second = tok.encode("what is 2+2?"), tok.encode("ab")
    expected = [alone(generator, p, 16)[0] for p in (first, second)]
    batcher = Batcher(generator, threading.Lock())
    forwards, answers = [], {}

    def ask(name: str, prompt: list[int]) -> None:
        answers[name] = batcher.generate([prompt], 1, params)

    def count(*_):
        forwards.append(1)
        if len(forwards) == 4:  # the first request's 4th forward: send the second and wait until it is queued
            threading.Thread(target=ask, args=("second", second)).start()
            while not batcher._queue:
                threading.Event().wait(0.001)

    handle = generator.model.lm_head.register_forward_hook(count)  # once per forward, whichever path steps
    try:
        ask("first", first)
        while "second" not in answers:
            threading.Event().wait(0.001)
    finally:
        handle.remove()
    assert [answers["first"].tokens[0], answers["second"].tokens[0]] == expected
    # alone: a prefill and 15 steps each, 32 in all one after the other; joined: 16 + the second's prefill + 3
    assert len(forwards) == 16 + 1 + 3, len(forwards)
    assert answers["second"].logprobs[0] == pytest.approx(alone(generator, second, 16)[1], abs=1e-5)


def test_seeded_requests_and_models_that_cannot_join_keep_whole_calls(tok):
    from tests.rollout.test_batcher import Recording

    generator = Recording()
    generator.release.set()
    assert joinable(generator) is None  # not lmrl's decode: whole calls, as before
    assert Batcher(generator, threading.Lock()).generate([[7]], 2, SamplingParams()).tokens == [[7, 0], [7, 1]]
    hf = HFGenerator(tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0), tok, seed=0)
    batcher = Batcher(hf, threading.Lock())
    seeded = SamplingParams(max_new_tokens=6, seed=3)
    rows = batcher.generate([tok.encode("ab")], 2, seeded)
    rollout = hf.generate([tok.encode("ab")], 2, seeded)  # a seeded request is the generator's own call, exactly
    assert rows.tokens == [r[: int(m.sum())] for r, m in zip(rollout.response_ids.tolist(), rollout.response_mask)]


def test_a_request_whose_prefill_fails_fails_alone_and_the_decode_goes_on(tok):
    generator = HFGenerator(tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0), tok, seed=0, eos_token_id=[])
    batcher = Batcher(generator, threading.Lock())
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    good, answers = tok.encode("ab"), {}

    def ask(name: str, prompt: list[int]) -> None:
        try:
            answers[name] = batcher.generate([prompt], 1, params)
        except (IndexError, RuntimeError) as e:
            answers[name] = e

    def send_bad(*_):  # while the good request decodes, a prompt with a token id past the vocabulary joins
        if "bad" not in answers and not batcher._queue:
            threading.Thread(target=ask, args=("bad", [10**6])).start()
            while not batcher._queue and "bad" not in answers:
                threading.Event().wait(0.001)

    handle = generator.model.lm_head.register_forward_hook(send_bad)
    try:
        ask("good", good)
    finally:
        handle.remove()
    while "bad" not in answers:
        threading.Event().wait(0.001)
    assert isinstance(answers["bad"], (IndexError, RuntimeError))
    assert answers["good"].tokens[0] == alone(generator, good, 6)[0]
    assert batcher.generate([good], 1, params).tokens[0] == answers["good"].tokens[0]  # the batcher still serves
