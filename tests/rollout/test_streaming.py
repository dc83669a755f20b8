"""`stream: true` on the generation server (`lmrl serve`'s HTTP, lmrl's decode), as the official `openai` client
consumes it: server-sent chunks that put together the same completion, token ids and usage as a plain request."""

from __future__ import annotations

import threading

import openai
import pytest

from lmrl.models.shipped import load_shipped
from lmrl.rollout.hf import HFGenerator
from lmrl.rollout.server import GenerationServer


def start(model, tok):
    server = GenerationServer(HFGenerator(model, tok, seed=0), tok, "policy")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def shipped():
    server, client = start(*load_shipped())
    yield client
    server.shutdown()


@pytest.fixture(scope="module")
def chat():
    from lmrl.models.tiny import bpe_chat_tokenizer, tiny_causal_lm

    tok = bpe_chat_tokenizer(["12+7=19 the sum is 19"] * 20, vocab_size=300)
    server, client = start(tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0).eval(), tok)
    yield client
    server.shutdown()


def test_streamed_completions_put_together_the_plain_answer(shipped):
    request = dict(model="policy", prompt="12+7=", max_tokens=6, n=2, seed=3, logprobs=0)
    plain = shipped.completions.create(**request)
    chunks = list(shipped.completions.create(stream=True, stream_options={"include_usage": True}, **request))
    assert len(chunks) > 2
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert mine[-1].finish_reason == choice.finish_reason and mine[-1].model_extra["token_ids"] == \
            choice.model_extra["token_ids"]
        logprobs = [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs]
        assert logprobs == pytest.approx(choice.logprobs.token_logprobs)
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_streamed_chat_completions_put_together_the_plain_answer(chat):
    request = dict(model="policy", messages=[{"role": "user", "content": "12+7="}], max_tokens=8, seed=5)
    plain = chat.chat.completions.create(**request).choices[0]
    content, reason, ids, roles = "", None, None, []
    for chunk in chat.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        roles += [delta.role] if delta.role else []
        reason = chunk.choices[0].finish_reason or reason
        ids = (chunk.choices[0].model_extra or {}).get("token_ids") or ids
    assert roles == ["assistant"] and content == plain.message.content and reason == plain.finish_reason
    assert ids == plain.model_extra["token_ids"]


def test_a_bad_stream_value_is_one_line_and_the_server_goes_on(shipped):
    with pytest.raises(openai.BadRequestError, match="stream: expected true or false, got \"yes\""):
        shipped.completions.create(model="policy", prompt="1+1=", max_tokens=2, extra_body={"stream": "yes"})
    assert shipped.completions.create(model="policy", prompt="1+1=", max_tokens=2).choices[0].text is not None


def test_lmrl_serve_streams_to_the_official_client():
    from tests.rollout.test_server_security import serve

    process, url = serve("rollout.max_new_tokens=8")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model="policy", prompt="12+7=", max_tokens=4, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].model_extra is not None
        assert len(chunks[-1].choices[0].model_extra["token_ids"]) >= 1
    finally:
        process.terminate()
        process.wait(30)
