"""Tests for lmrl.models.loading: loading round trips, prompt encoding, reference model, log-probs."""

from __future__ import annotations

import pytest
import torch
from tokenizers import processors

from lmrl.models.loading import (
    encode_prompts,
    load_causal_lm,
    load_tokenizer,
    model_forward_logprobs,
    position_ids_from_mask,
    reference_model,
)
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm

ARCHS = ["llama", "qwen2"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module", params=ARCHS)
def saved(request, tmp_path_factory):
    """(arch, directory, in-memory model, tokenizer) for a tiny model written with save_pretrained."""
    tok = char_tokenizer()
    model = tiny_causal_lm(tok, arch=request.param, hidden_size=32, num_layers=2)
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return request.param, path, model, tok


def left_padded_batch(tok, prompts: list[str], responses: list[str]):
    """Prompt left-padded, response right-padded (mask 0 on response padding), as the generator returns."""
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    p_len, t = max(map(len, p_ids)), max(map(len, r_ids))
    seqs, masks = [], []
    for p, r in zip(p_ids, r_ids):
        seqs.append([tok.pad_token_id] * (p_len - len(p)) + p + r + [tok.pad_token_id] * (t - len(r)))
        masks.append([0] * (p_len - len(p)) + [1] * (len(p) + len(r)) + [0] * (t - len(r)))
    return torch.tensor(seqs), torch.tensor(masks), t


# --- loading ------------------------------------------------------------------------------------


def test_round_trip_same_logits_and_tokens(saved):
    arch, path, model, tok = saved
    loaded = load_causal_lm(path, dtype="float32")
    loaded_tok = load_tokenizer(path)
    assert type(loaded).__name__ == type(model).__name__
    assert loaded_tok.padding_side == "left"
    assert loaded_tok.pad_token_id == tok.pad_token_id
    text = "12+34=46"
    assert loaded_tok(text)["input_ids"] == tok(text)["input_ids"]
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-6, rtol=0)
    assert not loaded.training


@pytest.mark.parametrize(("dtype", "expected"), [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_dtype_option(saved, dtype, expected):
    _, path, _, _ = saved
    model = load_causal_lm(path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}


def test_auto_dtype_keeps_checkpoint_dtype(saved):
    _, path, _, _ = saved
    model = load_causal_lm(path)  # saved in float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_bad_dtype_and_device():
    with pytest.raises(ValueError, match=r"model.dtype: must be one of \['auto', 'float32'"):
        load_causal_lm("unused", dtype="fp8")
    with pytest.raises(ValueError, match="device: must be one of"):
        load_causal_lm("unused", device="tpu")


def test_missing_path_is_one_clear_line(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ValueError) as info:
        load_causal_lm(missing)
    msg = str(info.value)
    assert msg == f"model.name_or_path: cannot load {str(missing)!r}: no such file or directory"
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(missing)


def test_unloadable_directory_is_one_line(tmp_path):
    with pytest.raises(ValueError) as info:
        load_causal_lm(tmp_path)  # exists, but holds no model
    msg = str(info.value)
    assert msg.startswith(f"model.name_or_path: cannot load {str(tmp_path)!r}: ")
    assert "\n" not in msg


def test_gradient_checkpointing_option(saved):
    _, path, _, _ = saved
    model = load_causal_lm(path, gradient_checkpointing=True)
    layers = model.get_decoder().layers
    assert all(getattr(layer, "gradient_checkpointing", False) for layer in layers)
    assert model.config.use_cache is False


def test_tokenizer_without_pad_uses_eos(tmp_path):
    tok = char_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path, padding_side="right")
    assert loaded.pad_token == loaded.eos_token == "</s>"
    assert loaded.padding_side == "right"


# --- reference model ------------------------------------------------------------------------------


def test_reference_model_is_frozen_equal_copy(saved):
    _, path, _, tok = saved
    policy = load_causal_lm(path, dtype="float32")
    policy.train()
    ref = reference_model(policy)
    assert not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in policy.parameters())
    ids = torch.tensor([tok("7+8=15")["input_ids"]])
    policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, policy(ids).logits, atol=0, rtol=0)
        # separate weights: changing the policy leaves the reference alone
        next(policy.parameters()).add_(1.0)
        assert not torch.equal(next(ref.parameters()), next(policy.parameters()))


# --- prompt encoding ------------------------------------------------------------------------------


def test_string_prompts_used_as_is():
    tok = char_tokenizer()
    ids = encode_prompts(tok, ["ab", "1+2="], max_prompt_length=8)
    assert ids == [
        tok("ab", add_special_tokens=False)["input_ids"],
        tok("1+2=", add_special_tokens=False)["input_ids"],
    ]
    assert tok.bos_token_id not in ids[0]


def test_bos_added_only_when_tokenizer_adds_it_and_never_eos():
    tok = char_tokenizer()
    # a post-processor like Llama's adds BOS; some also append EOS, which a prompt must not end with
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    a, b = (
        tok("a", add_special_tokens=False)["input_ids"][0],
        tok("b", add_special_tokens=False)["input_ids"][0],
    )
    assert encode_prompts(tok, ["ab"], max_prompt_length=8) == [[1, a, b]]
    assert encode_prompts(tok, ["<s>ab"], max_prompt_length=8) == [[1, a, b]]  # no double BOS


def test_chat_prompts_use_template():
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    ids = encode_prompts(tok, ["2+2?", messages], max_prompt_length=64)
    expected = tok("system: be brief\nuser: 2+2?\nassistant: ", add_special_tokens=False)["input_ids"]
    assert ids[1] == expected
    assert ids[0] == tok("2+2?", add_special_tokens=False)["input_ids"]
    wrapped = encode_prompts(tok, ["hi"], max_prompt_length=64, use_chat_template=True)
    assert wrapped == [tok("user: hi\nassistant: ", add_special_tokens=False)["input_ids"]]


def test_chat_prompt_without_template_names_index():
    tok = char_tokenizer()
    with pytest.raises(
        ValueError, match="prompt 1 is a list of messages but the tokenizer has no chat template"
    ):
        encode_prompts(tok, ["ok", [{"role": "user", "content": "hi"}]], max_prompt_length=64)
    tok.chat_template = CHAT_TEMPLATE
    with pytest.raises(ValueError, match="prompt 0 is a list of messages but use_chat_template=False"):
        encode_prompts(
            tok, [[{"role": "user", "content": "hi"}]], max_prompt_length=64, use_chat_template=False
        )


def test_too_long_prompt_error_text():
    tok = char_tokenizer()
    prompts = ["a", "b", "c", "x" * 812]
    with pytest.raises(ValueError) as info:
        encode_prompts(tok, prompts, max_prompt_length=512)
    assert str(info.value) == (
        "prompt 3 has 812 tokens, more than rollout.max_prompt_length=512; "
        "raise it (rollout.max_prompt_length=1024) or shorten the prompt"
    )
    assert len(encode_prompts(tok, prompts, max_prompt_length=812)[3]) == 812  # the limit is inclusive


@pytest.mark.parametrize("bad", ["", []])
def test_empty_prompt_error(bad):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        encode_prompts(char_tokenizer(), ["ok", bad], max_prompt_length=8)


def test_prompt_of_wrong_type_names_index():
    with pytest.raises(ValueError, match="prompt 0 must be a string or a list of"):
        encode_prompts(char_tokenizer(), [42], max_prompt_length=8)


# --- log-probs ------------------------------------------------------------------------------------


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward_shift_and_gather(arch, temperature):
    tok = char_tokenizer(pad_is_eos=True)  # pad == eos: nothing may rely on pad_token_id
    model = tiny_causal_lm(tok, arch=arch, hidden_size=32)
    seqs, mask, t = left_padded_batch(tok, ["1+2=", "10+20=", "7="], ["3", "30", "seven"])
    got = model_forward_logprobs(model, seqs, mask, t, temperature=temperature)
    assert got.shape == (3, t) and got.dtype == torch.float32
    with torch.no_grad():
        logits = model(seqs, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    # logits at position s score token s + 1; the response is the last t columns
    full = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    expected = full.gather(-1, seqs[:, 1:, None]).squeeze(-1)[:, -t:]
    torch.testing.assert_close(got.detach(), expected, atol=1e-5, rtol=0)
    # the same thing, one token at a time, naively
    s = seqs.shape[1]
    for b in range(3):
        for j in range(t):
            pos = s - t + j
            naive = torch.log_softmax(logits[b, pos - 1] / temperature, dim=-1)[seqs[b, pos]]
            assert abs(got[b, j].item() - naive.item()) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_logprobs_equal_unpadded(arch):
    """Left padding + cumsum positions give the log-probs of each sequence run alone (as generation)."""
    tok = char_tokenizer()
    model = tiny_causal_lm(tok, arch=arch, hidden_size=32)
    prompts, responses = ["123+4=", "5="], ["127", "5"]
    seqs, mask, t = left_padded_batch(tok, prompts, responses)
    with torch.no_grad():
        batched = model_forward_logprobs(model, seqs, mask, t)
        for b, (p, r) in enumerate(zip(prompts, responses)):
            ids = tok(p + r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            alone = torch.tensor([ids])
            n = len(r) + 1
            single = model_forward_logprobs(model, alone, torch.ones_like(alone), n)
            torch.testing.assert_close(batched[b, :n], single[0], atol=1e-5, rtol=0)


def test_logits_only_for_response(saved):
    """The lm_head sees T + 1 positions, never the prompt's."""
    _, _, model, tok = saved
    seqs, mask, t = left_padded_batch(tok, ["1111111111+2=", "3="], ["1113", "5"])
    seen = []
    handle = model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[1]))
    try:
        with torch.no_grad():
            model_forward_logprobs(model, seqs, mask, t)
    finally:
        handle.remove()
    assert seen == [t + 1] and t + 1 < seqs.shape[1]


def test_chunked_logprobs_equal_and_differentiable(saved):
    _, _, model, tok = saved
    seqs, mask, t = left_padded_batch(tok, ["12+3=", "4+4="], ["15", "8"])
    whole = model_forward_logprobs(model, seqs, mask, t)
    chunked = model_forward_logprobs(model, seqs, mask, t, chunk_size=2)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    whole.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_logprobs_bad_arguments(saved):
    _, _, model, tok = saved
    seqs, mask, t = left_padded_batch(tok, ["1="], ["1"])
    with pytest.raises(ValueError, match="num_response_tokens: must be in"):
        model_forward_logprobs(model, seqs, mask, seqs.shape[1])
    with pytest.raises(ValueError, match="temperature: must be > 0"):
        model_forward_logprobs(model, seqs, mask, t, temperature=0.0)
