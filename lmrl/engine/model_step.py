"""A decode step through the model's own forward: the engine's step for every model `LlamaStep` does not reproduce.

GPT-2, OPT, Falcon, Gemma, Mistral, Phi-3, the vision-language models, and a Llama / Qwen2 with hooks on its
layers (FSDP's) decode here: one forward of the model per step, one new token per row, over the engine's `KVCache` in
its joined layout (each row's prompt and response one contiguous span of its slot). Rows of different ages share the
step as in `LlamaStep`: each writes its new key at its own column, and attention reads the longest live span (rounded
up to the cache's block on a GPU), under a mask that opens each row's own prompt and response so far.

The mask is what the model's attention kernel takes:
- sdpa and eager: a 4D mask made here (boolean, or additive in the model's dtype), so transformers builds none. A model
  with sliding-window layers gets the window's mask too, counted in each row's own tokens (the rows' columns are
  not aligned), as a `{layer type: mask}` mapping where the model's config lists its layers' types;
- other kernels (flash-attention's): the 2D padding mask; a sliding window is then the kernel's own, counted back
  from each row's last key.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from lmrl.engine.cache import BLOCK, KVCache, StepRows

# The attention kernels whose 4D mask format is known: sdpa (bool, True attends), eager (additive float).
MASKED_KERNELS = ("sdpa", "eager")
LAYER_TYPES = ("full_attention", "sliding_attention")


def cache_keyword(model: nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in transformers releases that renamed it
    (5.24 deprecates `past_key_values`, to be removed in 5.40), else `past_key_values`. A peft model
    passes it through to its base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class _StepLayer(DynamicLayer):
    """One layer's keys and values in a step: `[b, K, L, D]` views of the columns the step reads; the model's new key
    and value are written at each row's own column."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, view: slice, rows: torch.Tensor, column: torch.Tensor):
        super().__init__()
        self.key_buffer, self.value_buffer, self.rows, self.column = keys, values, rows, column
        b = len(rows)
        self.keys, self.values = keys[:b, :, view], values[:b, :, view]
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.key_buffer[self.rows, :, self.column] = key_states[:, :, -1].to(self.dtype)
        self.value_buffer[self.rows, :, self.column] = value_states[:, :, -1].to(self.dtype)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2] - 1  # the new token sits in the last column the step reads (for the longest row)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2] - 1 + query_length, 0


class ModelStep:
    """Decode steps of any causal LM through its own forward, over a joined `KVCache`.

    Args:
        model: the causal LM (or vision-language model); its weights are read at every step.
    """

    shares_prompts = False  # each row has its prompt's keys in its own slot (the model's attention takes one tensor)

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        config = model.config.get_text_config(decoder=True)
        self.num_layers = config.num_hidden_layers
        self.kernel = getattr(model.config, "_attn_implementation", None)
        self.cache_keyword = cache_keyword(model)
        self.layer_types = getattr(config, "layer_types", None)
        self.window = getattr(config, "sliding_window", None)
        if self.layer_types is not None:
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"model: layer types {unknown} are not decoded by lmrl's engine (it decodes "
                                 f"{list(LAYER_TYPES)}); use rollout.backend=vllm")
            if "sliding_attention" not in self.layer_types:
                self.window = None
        self.sliding = self.window is not None
        # columns read: the longest live span exactly on a CPU (the model's attention copies what it reads to repeat
        # grouped-query heads, so every column costs), rounded up to the cache's block elsewhere (fewer shapes)
        self.block = 1 if next(model.parameters()).device.type == "cpu" else BLOCK

    def cache_dtype(self, device: torch.device) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def new_cache(self, device: torch.device, like: torch.Tensor, fixed: bool = False) -> KVCache:
        """An empty joined cache for keys shaped like `like` (`[U, K, P, D]`, a prefill's); `fixed`: steps of fixed
        shapes."""
        return KVCache(self.num_layers, like.shape[1], like.shape[3], self.cache_dtype(device), device, joined=True,
                       fixed=fixed)

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache: KVCache, positions: int) -> torch.Tensor:
        """Feed `[b]` tokens at `[b]` positions, each written at its row's response column `cache.row_length`;
        return `[b, V]` next-token logits. The cache's lengths advance after this returns."""
        rows = cache.step_rows(token.shape[0], self.block)
        p, n = rows.prompt_columns, rows.response_columns
        pc = cache.capacity[1]
        view = slice(pc - p, pc + n)
        column = pc + rows.length
        layers = [_StepLayer(cache.sequence_keys[i], cache.sequence_values[i], view, rows.index, column)
                  for i in range(self.num_layers)]
        out = self.model(input_ids=token[:, None], attention_mask=self._mask(cache, rows, p, n),
                         position_ids=position[:, None], **{self.cache_keyword: Cache(layers=layers)},
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _mask(self, cache: KVCache, rows: StepRows, p: int, n: int):
        """What the model's forward takes as `attention_mask` for the `p + n` columns the step reads (module
        docstring); built from the device's lengths, no host synchronisation."""
        columns = torch.arange(p + n, device=cache.device)[None]  # [1, L]
        last = (p + rows.length)[:, None]  # [b, 1] the column of each row's new token
        prompt_length = rows.prompt_length[: len(rows.length)]  # joined: prompt slot r is row r's
        full = (columns >= (p - prompt_length)[:, None]) & (columns <= last)  # [b, L]
        if self.kernel not in MASKED_KERNELS:
            return full.long()
        masks = {"full_attention": full}
        if self.sliding:
            masks["sliding_attention"] = full & (columns > last - self.window)
        masks = {kind: self._format(mask) for kind, mask in masks.items()}
        if self.layer_types is not None:
            return {kind: masks[kind] for kind in set(self.layer_types)}
        return masks["sliding_attention" if self.sliding else "full_attention"]

    def _format(self, mask: torch.Tensor) -> torch.Tensor:
        """`[b, L]` bool -> the kernel's `[b, 1, 1, L]`: bool for sdpa, 0 / the dtype's minimum for eager."""
        mask = mask[:, None, None, :]
        if self.kernel == "sdpa":
            return mask
        dtype = next(self.model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
