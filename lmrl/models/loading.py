"""Loading Hugging Face causal LMs and tokenizers, the frozen reference model, prompt encoding, and
the log-probs of response tokens under a model.

Shapes: B sequences, S = prompt + response positions (left-padded), T response tokens, V vocabulary.

Two conventions hold everywhere in lmrl and start here:

- Masks come from the generator (`attention_mask`, response mask), never from `pad_token_id`:
  many tokenizers have pad == eos, so "token != pad" would drop the real EOS of a completion.
- Batches are left-padded (prompts end at the same column, so the response is the last T columns),
  and position ids are `cumsum(attention_mask) - 1`: the first real token has position 0 whatever
  the padding, exactly as Hugging Face generation computes them. Training forwards use the same
  positions, so their log-probs match those seen while sampling.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lmrl.algorithms.logprobs import token_entropy, token_logprobs
from lmrl.errors import ConfigError, ModelError
from lmrl.models.shared_prompt import shared_prompt_logits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("cpu", "cuda", "auto")

Message = Mapping[str, str]
Prompt = str | Sequence[Message]


def _looks_local(name_or_path: str) -> bool:
    """True if `name_or_path` is meant as a local path rather than a hub id ("org/name").

    Checked before calling transformers so that a mistyped local path fails at once with a clear
    message instead of being sent to the hub (which retries for ~30 s without a network).
    """
    return (
        os.path.exists(name_or_path)
        or name_or_path.startswith(("/", ".", "~"))
        or "\\" in name_or_path
        or name_or_path.count("/") > 1
    )


def _check_exists(name_or_path: str | os.PathLike, config_key: str, what: str) -> str:
    path = os.fspath(name_or_path)
    if _looks_local(path) and not os.path.exists(os.path.expanduser(path)):
        raise ModelError(f"{config_key}: cannot load {what}{path!r}: no such file or directory")
    local = os.path.expanduser(path)
    needs = ("tokenizer_config.json", "tokenizer.json", "config.json") if what else ("config.json",)
    if os.path.isdir(local) and not any(os.path.isfile(os.path.join(local, name)) for name in needs):
        raise ModelError(f"{config_key}: cannot load {what}{path!r}: the directory holds no {' or '.join(needs)}, so it "
                         "is not one written by save_pretrained")
    return os.path.expanduser(path) if _looks_local(path) else path


def quiet_progress_bars():
    """transformers draws a progress bar per load and save: none in the middle of the console or of stderr."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def off():
        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was:
                hf_logging.enable_progress_bar()

    return off()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_tokenizer(
    name_or_path: str | os.PathLike,
    padding_side: str = "left",
    trust_remote_code: bool = False,
    config_key: str = "model.name_or_path",
):
    """Load a tokenizer with `AutoTokenizer`, padded on the left for generation.

    If the tokenizer has no pad token, the pad token becomes the EOS token. That is safe in lmrl
    because no mask is ever derived from `pad_token_id`: the generator returns explicit attention
    and response masks (see the module docstring).

    Args:
        name_or_path: a local directory or a hub id.
        padding_side: "left" (generation, lmrl's batches) or "right".
        trust_remote_code: passed to transformers; only for repositories you trust.
        config_key: the configuration key named in error messages.

    Raises:
        ValueError: the path does not exist or cannot be loaded, or the tokenizer has neither a pad
            nor an EOS token.
    """
    from transformers import AutoTokenizer

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side: must be 'left' or 'right', got {padding_side!r}")
    path = _check_exists(name_or_path, config_key, "tokenizer ")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:  # transformers raises both, often over several lines
        raise ModelError(f"{config_key}: cannot load tokenizer {path!r}: {_first_line(err)}") from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"{config_key}: tokenizer {path!r} has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device for `device`: "auto" is cuda when available, else cpu; "cuda" without a GPU fails."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"model.device: must be one of {list(DEVICES)} (or 'cuda:N'), got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device: {device!r} asked for, but this machine has no CUDA device; "
                          "use model.device=cpu (or auto)")
    return torch.device(device)


def load_causal_lm(
    name_or_path: str | os.PathLike,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
    config_key: str = "model.name_or_path",
) -> nn.Module:
    """Load a causal LM with `AutoModelForCausalLM` from a local directory or a hub id.

    Args:
        name_or_path: a local directory (e.g. one written by `save_pretrained`) or a hub id.
        dtype: "auto" (the checkpoint's own dtype, as transformers does), "float32", "bfloat16"
            or "float16".
        device: "cpu", "cuda" (or "cuda:N"), or "auto" (cuda when available).
        trust_remote_code: passed to transformers; only for repositories you trust.
        attn_implementation: e.g. "sdpa", "eager", "flash_attention_2"; None lets transformers choose.
        gradient_checkpointing: recompute activations in the backward pass (less memory, ~30% more
            compute); also turns the KV cache off, which checkpointing cannot use.
        config_key: the configuration key named in error messages.

    Returns:
        The model, on `device`, in train mode only if gradient checkpointing is on (eval otherwise;
        the trainer switches modes itself).

    Raises:
        ValueError: unknown dtype or device, or "<config_key>: cannot load 'X': <reason>" when the
            path does not exist or transformers cannot load it.
    """
    from transformers import AutoModelForCausalLM

    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"model.dtype: must be one of {['auto', *DTYPES]}, got {dtype!r}")
    target = resolve_device(device)
    path = _check_exists(name_or_path, config_key, "")
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    # transformers >= 4.56 takes `dtype=` (`torch_dtype=` is deprecated, and gone in 5.x).
    kwargs["dtype"] = "auto" if dtype == "auto" else DTYPES[dtype]
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with quiet_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:  # transformers raises both, often over several lines
        raise ModelError(f"{config_key}: cannot load {path!r}: {_first_line(err)}") from err
    model.to(target)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    else:
        model.eval()
    return model


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in the backward pass (non-reentrant: works with inputs that need no grad
    and with DDP/FSDP). transformers 5.x renamed the method (the old name warns); 4.x has only the old one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()


def reference_model(policy: nn.Module) -> nn.Module:
    """A frozen copy of the policy: the reference of the KL penalty.

    A deep copy (separate weights, same dtype and device), in eval mode (no dropout), with
    `requires_grad=False` on every parameter so that it never enters an optimizer or the autograd
    graph. It costs one more copy of the weights; a LoRA run needs none (its reference is the policy's
    own base model with its adapters disabled, `Trainer._reference`).
    """
    ref = copy.deepcopy(policy)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _is_messages(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt)
    )


def _adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front of a text when asked to add special tokens."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    return len(probe) > 0 and probe[0] == bos


def encode_prompts(
    tokenizer,
    prompts: Sequence[Prompt],
    max_prompt_length: int,
    use_chat_template: bool | None = None,
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
            raise ValueError(f"prompt {i} is a list of messages but use_chat_template=False")

        if isinstance(prompt, str):
            ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            if add_bos and (not ids or ids[0] != tokenizer.bos_token_id):
                ids.insert(0, tokenizer.bos_token_id)
        else:
            if tokenizer.chat_template is None:
                raise ValueError(
                    f"prompt {i} is a list of messages but the tokenizer has no chat template; "
                    "use a chat model's tokenizer or plain-text prompts"
                )
            # return_dict=False: a plain list of ids in transformers 4.x and 5.x alike.
            ids = list(
                tokenizer.apply_chat_template(
                    [dict(m) for m in prompt], add_generation_prompt=True, tokenize=True, return_dict=False
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


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left-padded batch, as Hugging Face generation computes them.

    Args:
        attention_mask: [B, S], 1 for real tokens, 0 for padding.

    Returns:
        [B, S] long: cumsum(mask) - 1, clamped at 0 (padding positions get 0; they are masked anyway).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def model_forward_logprobs(
    model: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    num_response_tokens: int,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    share_prompt: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens (the last T columns of `sequences`) under `model`.

    The logits at position t score the token at t + 1, so the T response tokens are scored by the
    logits at positions S-T-1 .. S-2. Only the last T + 1 positions get logits (`logits_to_keep`):
    the prompt's [B, S-T, V] logits are never computed. Logits are divided by the sampling
    temperature before the log-softmax, as during sampling.

    Args:
        model: a Hugging Face causal LM (or a DDP/FSDP wrapper of one).
        sequences: [B, S] token ids, prompt then response, left-padded.
        attention_mask: [B, S], 1 for real tokens (padding inside the response may be 1 or 0:
            it only affects log-probs at masked positions, which callers ignore).
        num_response_tokens: T, the number of response columns, 1 <= T < S.
        temperature: the sampling temperature.
        chunk_size: rows of the [B*T, V] logits turned into float32 at once (None: all).
        return_entropy: also return the entropy of softmax(logits / temperature) at each response
            position, from the same logits (no second forward).
        share_prompt: where rows share a prompt and the model allows it (Llama / Qwen2, see
            `lmrl.models.shared_prompt`), run each distinct prompt through the model once; the same
            function, less work when several completions of a prompt are scored together.

    Returns:
        [B, T] float32 log-probs, differentiable when grad is enabled; with `return_entropy`, the
        pair (log-probs, entropies), both [B, T].
    """
    seq_len = sequences.shape[1]
    t = num_response_tokens
    if not 1 <= t < seq_len:
        raise ValueError(
            f"num_response_tokens: must be in [1, {seq_len - 1}] for sequences of length {seq_len}, got {t}"
        )
    if attention_mask.shape != sequences.shape:
        raise ValueError(
            f"attention_mask: shape {tuple(attention_mask.shape)} != sequences shape {tuple(sequences.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    positions = position_ids_from_mask(attention_mask)
    logits = shared_prompt_logits(model, sequences, attention_mask, positions, t) if share_prompt else None  # [B, T, V]
    if logits is None:
        out = model(
            input_ids=sequences,
            attention_mask=attention_mask,
            position_ids=positions,
            logits_to_keep=t + 1,
            use_cache=False,
        )
        # Models that ignore logits_to_keep return all S positions: keep the last T + 1 either way.
        logits = out.logits[:, -(t + 1) : -1]  # [B, T, V]
    tokens = sequences[:, -t:]  # [B, T]
    logprobs = token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size)
    if not return_entropy:
        return logprobs
    return logprobs, token_entropy(logits, chunk_size=chunk_size, temperature=temperature)
