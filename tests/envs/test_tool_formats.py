"""The model family's tool-call format: Llama 3's JSON reply and Mistral's [TOOL_CALLS] besides Hermes / Qwen,
read from the chat template (or `model.tool_call_format`), parsed into `tool_calls` by the gateway and `lmrl serve`,
and a call sent back trains on exactly the tokens sampled. The tokenizers are made here, with templates that render
tools and calls as those families' templates do (nothing downloaded)."""

from __future__ import annotations

import json
import threading

import pytest

from lmrl.agents.programs import AgentEnvironment
from lmrl.rollout.base import SamplingParams
from lmrl.rollout.chat_turns import parse_tool_calls, tool_call_format
from lmrl.rollout.multiturn import generate_episodes
from tests.envs import python
from tests.envs.test_gateway_tools import ADD_REQUEST, AGENT, TOOLS_TEMPLATE, Scripted

# Llama 3.1's way: tools in the system turn ("Environment: ipython"), a call as {"name", "parameters"}, ended by
# <|eom_id|>, a tool result as an ipython turn
LLAMA3 = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m['tool_calls'] %}{\"name\": \"{{ c['function']['name'] }}\", \"parameters\": "
    "{{ c['function']['arguments'] }}}{% endfor %}<|eom_id|>"
    "{% elif m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Mistral's (v3 tokenizers): [AVAILABLE_TOOLS] before the user turn, a call as [TOOL_CALLS][{...}]</s>, a result
# as [TOOL_RESULTS]...[/TOOL_RESULTS]
MISTRAL = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% if tools and loop.first %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}[TOOL_CALLS][{% for c in m['tool_calls'] %}"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] }}, \"id\": "
    "\"{{ c['id'] }}\"}{% endfor %}]</s>"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{\"content\": {{ m['content'] | tojson }}}[/TOOL_RESULTS]"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
FAMILIES = {  # template, special tokens, EOS, how the model writes its call (not as the template does), its end,
    # and what marks a tool result in the prompt
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
               "<|eot_id|>", '<|python_tag|>{"name": "add", "parameters": {"b": 3, "a": 2}}', "<|eom_id|>", "<|start_header_id|>ipython"),
    "mistral": (MISTRAL, ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                          "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "</s>"],
                "</s>", '[TOOL_CALLS][{"arguments": {"a": 2, "b": 3}, "name": "add"}]', None, "[TOOL_RESULTS]"),
}


def family_tokenizer(name):
    from lmrl.models.tiny import bpe_chat_tokenizer

    template, specials, eos, call = FAMILIES[name][:4]
    tok = bpe_chat_tokenizer([call, "What is 2+3? The sum is 5.", template] * 10, vocab_size=320)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.eos_token, tok.chat_template = eos, template
    return tok


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, family_tokenizer(request.param)


def test_each_familys_calls_parse_into_openai_tool_calls_and_anything_else_stays_text():
    add = ("add", {"a": 2, "b": 3})

    def calls(text, fmt, raw=None):
        content, found = parse_tool_calls(text, "c", fmt, raw)
        return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found]

    assert calls('{"name": "add", "parameters": {"a": 2, "b": 3}}', "llama3") == (None, [add])
    assert calls('<|python_tag|>{"name": "add", "arguments": {"a": 2, "b": 3}}; {"name": "add", "parameters": '
                 '{"a": 2, "b": 3}}', "llama3") == (None, [add, add])
    for text in ('The sum: {"name": "add", "parameters": {}}', '{"name": "add"}', '{"name": "add", "parameters": {}} ok',
                 '{"name": "add", "parameters": {'):  # not the whole reply, no arguments, trailing text, cut short
        assert calls(text, "llama3") == (text, [])
    assert calls('[{"name": "add", "arguments": {"a": 2, "b": 3}}]', "mistral",  # [TOOL_CALLS]: a special token
                 raw='Adding.[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]</s>') == ("Adding.", [add])
    assert calls('[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}', "mistral")[1] == [add, add]
    assert calls("[TOOL_CALLS][{bad}]", "mistral", raw="[TOOL_CALLS][{bad}]</s>") == ("[TOOL_CALLS][{bad}]", [])
    assert calls('{"name": "add", "parameters": {}}', "hermes") == ('{"name": "add", "parameters": {}}', [])


def test_the_format_is_read_from_the_chat_template_unless_set(family):
    name, tok = family
    assert tool_call_format(tok) == name and tool_call_format(tok, "hermes") == "hermes"
    tok_qwen = type("T", (), {"chat_template": TOOLS_TEMPLATE})()
    assert tool_call_format(tok_qwen) == "hermes" and tool_call_format(object()) == "hermes"
    from lmrl.config import load_config
    from lmrl.errors import ConfigError

    assert load_config(None, ["model.tool_call_format=mistral"]).model.tool_call_format == "mistral"
    with pytest.raises(ConfigError, match="model.tool_call_format: "):
        load_config(None, ["model.tool_call_format=gorilla"])


def test_a_chat_agent_gets_the_familys_calls_and_trains_on_exactly_the_sampled_tokens(family, tmp_path, monkeypatch):
    name, tok = family
    call, end, marker = FAMILIES[name][3:]
    monkeypatch.setenv("AGENT_LOG", str(tmp_path / "log.jsonl"))
    monkeypatch.setenv("AGENT_STREAM", "0")
    rows = [{"prompt": "What is 2+3?"}]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": rows[0]["prompt"]}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]]
    episodes = generate_episodes(Scripted(tok, call, marker, end), tok, prompts, rows, 1,
                                 SamplingParams(max_new_tokens=40), AgentEnvironment(f"{python()} {AGENT}",
                                                                                     timeout=60), max_turns=3)
    [entry] = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(c["name"], c["arguments"]) for c in entry["calls"]] == [("add", {"a": 2, "b": 3})]
    assert entry["reasons"] == ["tool_calls", "stop"] and entry["answer"] == "5"
    assert episodes.rewards == [1.0] and episodes.metrics["agent/retokenized_tokens"] == 0
    r = episodes.rollout
    assert r.response_ids[0][r.response_mask[0]].tolist() == sum(entry["turns"], [])  # the call as the model wrote it
    assert tok.decode(entry["turns"][0], skip_special_tokens=False) == call + (end or tok.eos_token)
    observed = tok.decode(r.response_ids[0][r.response_attention[0] & ~r.response_mask[0]].tolist())
    assert marker in observed  # the tool message: new tokens, attended only
    naive = tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                     "tool_calls": [{"id": "c", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}],
                                    tokenize=False)
    assert call not in naive  # re-rendering the call would have trained on tokens the model never wrote


def test_lmrl_serve_answers_with_the_familys_tool_calls(family):
    import openai

    from lmrl.rollout.server import GenerationServer

    name, tok = family
    call, end, marker = FAMILIES[name][3:]
    server = GenerationServer(Scripted(tok, call, marker, end), tok, "policy")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        choice = client.chat.completions.create(**ADD_REQUEST).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None and server.tool_format == name
        [found] = choice.message.tool_calls
        assert found.function.name == "add" and json.loads(found.function.arguments) == {"a": 2, "b": 3}
    finally:
        server.shutdown()
