"""The gateway's `tools` and `tool_calls`: a chat request's tools go through the chat template, the model's
Hermes / Qwen tool calls come back parsed in `message.tool_calls`, and the conversation sent back (the assistant
message with its calls, a `tool` message) trains on exactly the tokens sampled: the tool result is new tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmrl.agents.programs import AgentEnvironment
from lmrl.rollout.base import Rollout, SamplingParams
from lmrl.rollout.chat_turns import parse_tool_calls
from lmrl.rollout.multiturn import generate_episodes
from tests.envs import python

AGENT = Path(__file__).with_name("tool_agent.py")
# ChatML with tools as Qwen2.5 renders them: the tools in a system turn, calls as <tool_call>\n{json}\n</tool_call>,
# a tool message as a user turn holding <tool_response>
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the model writes its call its own way (no new lines, "arguments" first), not as the template renders it
CALL = '<tool_call>{"arguments": {"a": 2, "b": 3}, "name": "add"}</tool_call>'


# a chat request offering the `add` tool (the scripted model calls it)
ADD_REQUEST = dict(model="policy", messages=[{"role": "user", "content": "What is 2+3?"}], max_tokens=40,
                   tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])


class Scripted:
    """A generator that writes the tool call first (ended by `end`, default EOS), then, after a tool response (the
    prompt holds `marker`), the answer "5"."""

    def __init__(self, tok, call=CALL, marker="<tool_response>", end=None):
        self.tok, self.pad_token_id, self.marker = tok, tok.pad_token_id, marker
        ends = (tok.convert_tokens_to_ids(end) if end else tok.eos_token_id, tok.eos_token_id)
        self.turns = [tok(t, add_special_tokens=False)["input_ids"] + [e] for t, e in zip((call, "5"), ends)]

    def generate(self, prompts, n, params):
        rows = [self.turns[self.marker in self.tok.decode(p)] for p in prompts for _ in range(n)]
        width, plen = max(map(len, rows)), max(map(len, prompts))
        B = len(rows)
        response = torch.full((B, width), self.pad_token_id)
        mask = torch.zeros(B, width, dtype=torch.bool)
        for i, r in enumerate(rows):
            response[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), True
        prompt_ids = torch.tensor([[self.pad_token_id] * (plen - len(p)) + p for p in prompts for _ in range(n)])
        return Rollout(prompt_ids, prompt_ids != self.pad_token_id, response, mask, torch.where(mask, -0.5, 0.0),
                       [self.tok.decode(r, skip_special_tokens=True) for r in rows], torch.ones(B, dtype=torch.bool),
                       torch.arange(B) // n)


@pytest.fixture(scope="module")
def tool_tokenizer():
    from lmrl.models.tiny import bpe_chat_tokenizer

    tok = bpe_chat_tokenizer([CALL, "What is 2+3? The sum is 5.", TOOLS_TEMPLATE] * 10, vocab_size=320)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def test_parse_tool_calls_gives_openai_tool_calls():
    content, calls = parse_tool_calls('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "c")
    assert content == "Let me add."
    assert calls == [{"id": "c-0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    assert parse_tool_calls("<tool_call>{bad}</tool_call>") == ("<tool_call>{bad}</tool_call>", [])  # stays text


def test_the_gateways_own_replies_are_rendered_as_sampled_and_changed_ones_as_sent(tool_tokenizer):
    from lmrl.rollout.chat_turns import Reply, render_conversation

    tok = tool_tokenizer
    ours = {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "c-0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}
    reply = Reply(ours, "Sure." + CALL + "<|im_end|>", "<|im_end|>")
    user = {"role": "user", "content": "What is 2+3?"}
    tool = {"role": "tool", "tool_call_id": "c-0", "content": "5"}
    parts = {**ours, "content": [{"type": "text", "text": "Sure."}], "tool_calls": [  # the same, sent another way
        {"id": "c-0", "type": "function", "function": {"name": "add", "arguments": '{"b": 3, "a": 2}'}}]}
    for sent in (ours, parts):
        text, changed = render_conversation(tok, [user, sent, tool], None, [reply])
        assert "Sure." + CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n5" in text and changed == []
    text, changed = render_conversation(tok, [user, {**ours, "content": "Hm."}, tool], None, [reply])
    assert CALL not in text and "Hm.<tool_call>\n" in text and changed == [0]  # the agent's, as the template writes it


@pytest.mark.parametrize("stream", ["0", "1"])
def test_a_chat_agent_with_tools_gets_tool_calls_and_trains_on_exactly_the_sampled_tokens(tool_tokenizer, tmp_path,
                                                                                          monkeypatch, stream):
    tok = tool_tokenizer
    monkeypatch.setenv("AGENT_LOG", str(tmp_path / "log.jsonl"))
    monkeypatch.setenv("AGENT_STREAM", stream)  # "1": every turn streamed, put together from its chunks
    rows = [{"prompt": "What is 2+3?"}]
    prompts = [tok.apply_chat_template([{"role": "user", "content": rows[0]["prompt"]}], add_generation_prompt=True,
                                       tokenize=False)]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    episodes = generate_episodes(Scripted(tok), tok, prompts, rows, 2, SamplingParams(max_new_tokens=40),
                                 AgentEnvironment(f"{python()} {AGENT}", timeout=60), max_turns=3)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(log) == 2
    for entry in log:
        assert [(c["name"], c["arguments"]) for c in entry["calls"]] == [("add", {"a": 2, "b": 3})]
        assert entry["reasons"] == ["tool_calls", "stop"] and entry["answer"] == "5"
    assert episodes.rewards == [1.0, 1.0] and episodes.metrics["agent/retokenized_tokens"] == 0
    r = episodes.rollout
    for i in range(2):
        trained = r.response_ids[i][r.response_mask[i]].tolist()
        assert trained == sum(log[i]["turns"], [])  # the call as the model wrote it, not as the template writes it
        observed = tok.decode(r.response_ids[i][r.response_attention[i] & ~r.response_mask[i]].tolist())
        assert "<tool_response>\n5\n</tool_response>" in observed  # the tool message: new tokens, attended only
        prompt = tok.decode(r.prompt_ids[i][r.prompt_mask[i]].tolist())
        assert prompt.startswith("<|im_start|>system\nYou may call these tools:") and '"name": "add"' in prompt
    naive = tok.apply_chat_template([{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}], tokenize=False)
    assert CALL not in naive  # re-rendering the call would have trained on tokens the model never wrote


def test_lmrl_serve_renders_tools_and_answers_with_tool_calls_streamed_or_not(tool_tokenizer):
    import threading

    import openai

    from lmrl.rollout.server import GenerationServer

    server = GenerationServer(Scripted(tool_tokenizer), tool_tokenizer, "policy")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        choice = client.chat.completions.create(**ADD_REQUEST).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
        chunks = list(client.chat.completions.create(stream=True, **ADD_REQUEST))
        calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
        assert [(c.function.name, c.function.arguments) for c in calls] == [("add", call.function.arguments)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = client.chat.completions.create(**{**ADD_REQUEST, "tools": None}).choices[0]  # no tools: all text
        assert plain.message.content == CALL and plain.message.tool_calls is None and plain.finish_reason == "stop"
    finally:
        server.shutdown()
