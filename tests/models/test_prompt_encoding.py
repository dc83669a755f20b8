"""Tests for lmrl.models.prompt_encoding: string prompts as is, BOS only where the tokenizer adds it, chat
templates, and the one-line errors."""

from __future__ import annotations

import pytest
from tokenizers import processors

from lmrl.models.prompt_encoding import encode_prompts, encode_text
from lmrl.models.tiny import bpe_chat_tokenizer, char_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


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


def test_encode_text_is_the_tokenizers_own_call_and_takes_the_rust_path_only_where_that_is_the_same():
    bpe = bpe_chat_tokenizer(["hello world, how are you?", "the sum is 42", "<calc>1+2</calc>"] * 20, vocab_size=300)
    for tok, texts in ((char_tokenizer(), ["12+3=", "1 + 2 =", "\n\n=5\n", ""]),
                       (bpe, ["12+3=", " hello  world ", "<|im_start|>user\nhi<|im_end|>", "é漢字 🙂", "\n\n", ""])):
        for text in texts:
            assert encode_text(tok, text) == tok(text, add_special_tokens=False)["input_ids"], text
    bpe._tokenizer.enable_truncation(3)  # set on the Rust tokenizer: transformers' call turns it off, a direct one not
    ids = encode_text(bpe, "hello world, how are you?")
    assert len(ids) > 3 and ids == bpe("hello world, how are you?", add_special_tokens=False)["input_ids"]


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
