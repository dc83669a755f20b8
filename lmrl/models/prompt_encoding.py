"""Prompt encoding: the token ids a prompt (a string or a chat conversation) becomes before generation.

A string prompt is tokenized as is (BOS only where the tokenizer itself starts texts with one, never
an EOS); a chat prompt (a list of {"role", "content"} messages) goes through the tokenizer's chat
template with the generation prompt. `prompt_lengths` is the same encoding, used to check every
dataset row's length before a model loads.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, str]
Prompt = str | Sequence[Message]


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _is_messages(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt)
    )


_ADDS_BOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front of a text when asked to add special tokens (asked once per tokenizer
    and BOS: a server encodes each request's prompt)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    try:
        known = _ADDS_BOS.get(tokenizer)
    except TypeError:  # a tokenizer that cannot be weakly referenced: asked every time
        known = None
    if known is not None and known[0] == bos:
        return known[1]
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    adds = len(probe) > 0 and probe[0] == bos
    with contextlib.suppress(TypeError):
        _ADDS_BOS[tokenizer] = (bos, adds)
    return adds


def encode_text(tokenizer, text: str) -> list[int]:
    """`tokenizer(text, add_special_tokens=False)["input_ids"]`, through its Rust tokenizer where that is the same
    call (a fast tokenizer with no truncation, fixed padding or special-token splitting set on it): transformers'
    wrapper costs several times the tokenizing of a short text, which a server pays on every request."""
    backend = getattr(tokenizer, "_tokenizer", None)
    padding = getattr(backend, "padding", {}) or {}  # to the longest of a batch: one text is never padded
    if (hasattr(backend, "encode") and getattr(backend, "truncation", True) is None
            and padding.get("length") is None and padding.get("pad_to_multiple_of") is None
            and getattr(tokenizer, "split_special_tokens", True) is False):
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompts(
    tokenizer,
    prompts: Sequence[Prompt],
    max_prompt_length: int,
    use_chat_template: bool | None = None,
    tools: list[dict] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt, unpadded.

    A string prompt is used as is: tokenized *without* the tokenizer's special tokens, then given a
    BOS token only if this tokenizer itself starts texts with BOS (Llama, Mistral, Gemma do; Qwen
    and GPT-2 do not). So models trained with BOS get it, and no tokenizer can append an EOS (some
    post-processors do) after which the model would have nothing left to say.

    A chat prompt (a list of {"role", "content"} dicts) goes through
    `tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`; the
    template itself writes any BOS or control tokens, so nothing else is added.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompts: strings and/or lists of messages.
        max_prompt_length: the longest allowed prompt, in tokens (`rollout.max_prompt_length`).
        use_chat_template: None: lists of messages use the chat template, strings are used as is;
            True: strings are also wrapped as one user message and templated; False: plain text
            only (a list of messages is an error).
        tools: JSON schemas of the tools the model may call (`lmrl.envs.Tools.schemas`), given to the
            chat template as `tools=` (templated prompts only; a plain-text prompt must describe them itself).

    Returns:
        One list of token ids per prompt.

    Raises:
        ValueError: a prompt is empty, is not a string or a list of messages, needs a chat template
            the tokenizer lacks, or is longer than `max_prompt_length`; the message names its index.
    """
    if max_prompt_length < 1:
        raise ValueError(f"rollout.max_prompt_length: must be >= 1, got {max_prompt_length}")
    add_bos = _adds_bos(tokenizer)
    encoded = []
    for i, prompt in enumerate(prompts):
        wrapped = isinstance(prompt, str) and bool(use_chat_template)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if use_chat_template:
                prompt = [{"role": "user", "content": prompt}]
        elif not _is_messages(prompt):
            raise ValueError(
                f"prompt {i} must be a string or a list of {{'role', 'content'}} messages, "
                f"got {type(prompt).__name__}"
            )
        elif len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        elif use_chat_template is False:
            raise ValueError(f"prompt {i} is a list of messages but use_chat_template=False (model.chat_template)")

        if isinstance(prompt, str):
            ids = encode_text(tokenizer, prompt)
            if add_bos and (not ids or ids[0] != tokenizer.bos_token_id):
                ids.insert(0, tokenizer.bos_token_id)
        else:
            if tokenizer.chat_template is None:
                raise ValueError(
                    f"prompt {i} is {'a string to wrap in a chat template (model.chat_template=true)' if wrapped else 'a list of messages'}"
                    " but the tokenizer has no chat template; use a chat model's tokenizer (model.name_or_path) or "
                    "plain-text prompts"
                )
            # return_dict=False: a plain list of ids in transformers 4.x and 5.x alike.
            ids = list(
                tokenizer.apply_chat_template(
                    [dict(m) for m in prompt], add_generation_prompt=True, tokenize=True, return_dict=False,
                    **({"tools": tools} if tools else {}),
                )
            )
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenization")
        if len(ids) > max_prompt_length:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, more than rollout.max_prompt_length={max_prompt_length}; "
                f"raise it (rollout.max_prompt_length={_next_power_of_two(len(ids))}) or shorten the prompt"
            )
        encoded.append(ids)
    return encoded


def prompt_lengths(tokenizer, prompts: Sequence[Prompt], use_chat_template: bool | None = None) -> list[int]:
    """Each prompt's length in tokens, as `encode_prompts` encodes it (for checking rows up front)."""
    return [len(ids) for ids in encode_prompts(tokenizer, prompts, sys.maxsize, use_chat_template)]
