"""Tiny models built from a config and a character-level tokenizer made locally.

Nothing here downloads anything: tests and the shipped default model use these builders.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
DEFAULT_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_tokenizer(chars: str = DEFAULT_CHARS, pad_is_eos: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, plus <pad> <s> </s> (ids 0, 1, 2).

    `pad_is_eos=True` makes the pad token the EOS token, as many real tokenizers do, to test that
    nothing derives the response mask from `pad_token_id`. Padding is on the left, for generation.
    """
    specials = [PAD, BOS, EOS]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in dict.fromkeys(chars):  # ordered, unique
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS if pad_is_eos else PAD,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return fast


def tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
):
    """A randomly initialised Llama- or Qwen2-architecture causal LM sized for tests."""
    import torch

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if arch not in cls:
        raise ValueError(f"arch: unknown architecture {arch!r}; choose one of {sorted(cls)}")
    config_cls, model_cls = cls[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()
