"""Before the first step: can a step fit the device's memory? Lower bounds on what a step's generation and its
largest training forward need, compared with all the memory of the device, so that a size that cannot fit fails at
once, in one line, instead of swapping, hanging or running out of memory mid-run (docs/troubleshooting.md)."""

from __future__ import annotations

import os
from typing import Any

import torch

from lmrl.config import Config
from lmrl.errors import ConfigError
from lmrl.models.loading import DTYPES


def memory_bytes(device: torch.device) -> int:
    """All the memory of `device`: the GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _text(model_config: Any) -> Any:
    """The language model's part of a (vision-language) model's config."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def rollout_bytes(cfg: Config, model_config: Any, longest_prompt: int) -> int:
    """A lower bound on the memory one step's generation needs: the KV cache and the logits of one generation
    batch, and the token tensors of the whole batch. Compared with the device's memory before the first step,
    so that a size that cannot fit fails at once instead of swapping or hanging."""
    r = cfg.rollout
    text = _text(model_config)
    layers = getattr(text, "num_hidden_layers", 0) or 0
    heads = getattr(text, "num_attention_heads", 1) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (getattr(text, "hidden_size", 0) or 0) // heads
    vocab = getattr(text, "vocab_size", 0) or 0
    dtype = r.dtype or cfg.model.dtype
    itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else 2  # "auto": the checkpoint's, at least 2 bytes
    sequences = r.prompts_per_step * r.group_size
    at_once = min(r.batch_size or sequences, sequences)
    length = longest_prompt + r.max_new_tokens
    kv_cache = at_once * length * layers * 2 * kv_heads * head_dim * itemsize
    logits = at_once * vocab * 4
    tokens = sequences * length * 8 * 4  # ids, masks, log-probs of the whole batch
    return kv_cache + logits + tokens


def micro_batch_tokens(cfg: Config, longest_prompt: int) -> tuple[int, int]:
    """(tokens, response tokens) of the largest forward of the update and the experience, at most: with packing
    a micro-batch's real tokens (`optim.micro_batch_tokens` bounds them where set), without it its padded width."""
    rows = cfg.optim.micro_batch_size
    tokens, response = rows * (longest_prompt + cfg.rollout.max_new_tokens), rows * cfg.rollout.max_new_tokens
    if cfg.train.packing and cfg.optim.micro_batch_tokens is not None:
        # a row alone over the budget still runs whole
        bound = max(cfg.optim.micro_batch_tokens, longest_prompt + cfg.rollout.max_new_tokens)
        tokens, response = min(tokens, bound), min(response, bound)
    return tokens, response


def update_bytes(cfg: Config, model_config: Any, longest_prompt: int) -> int:
    """A lower bound on what the largest forward and backward of a step keep: each layer's input for the backward
    (what gradient checkpointing keeps too) and the logits of the response tokens (`micro_batch_tokens`)."""
    text = _text(model_config)
    layers, hidden = getattr(text, "num_hidden_layers", 0) or 0, getattr(text, "hidden_size", 0) or 0
    vocab = getattr(text, "vocab_size", 0) or 0
    itemsize = 2 if cfg.train.autocast_bf16 or cfg.model.dtype in ("bfloat16", "auto") else 4
    tokens, response = micro_batch_tokens(cfg, longest_prompt)
    return tokens * layers * hidden * itemsize + response * vocab * itemsize


def check_rollout_fits(cfg: Config, model_config: Any, longest_prompt: int, device: torch.device) -> None:
    """ConfigError when one step's generation (`rollout_bytes`), or its largest training forward (`update_bytes`),
    cannot fit in the device's memory."""
    have, gib = memory_bytes(device), 2**30
    update = update_bytes(cfg, model_config, longest_prompt)
    if update > have:
        tokens, _ = micro_batch_tokens(cfg, longest_prompt)
        o = cfg.optim
        raise ConfigError(
            f"optim: a training forward of up to {tokens:,} tokens (optim.micro_batch_size={o.micro_batch_size}"
            + (f", optim.micro_batch_tokens={o.micro_batch_tokens}" if o.micro_batch_tokens else "")
            + f") keeps at least {update / gib:,.0f} GiB for its backward; this {device.type} has {have / gib:,.0f} "
            "GiB: lower optim.micro_batch_size" + ("" if o.micro_batch_tokens else ", or set optim.micro_batch_tokens"))
    need = rollout_bytes(cfg, model_config, longest_prompt)
    if need <= have:
        return
    r = cfg.rollout
    raise ConfigError(
        f"rollout: a step generates {r.prompts_per_step * r.group_size} sequences (rollout.prompts_per_step="
        f"{r.prompts_per_step} x rollout.group_size={r.group_size}) of up to {longest_prompt + r.max_new_tokens} "
        f"tokens, which needs at least {need / gib:,.0f} GiB; this {device.type} has {have / gib:,.0f} GiB: lower "
        "rollout.prompts_per_step" + ("" if r.batch_size else ", or generate in parts with rollout.batch_size"))
