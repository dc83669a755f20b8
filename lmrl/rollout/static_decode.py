"""Decode steps with fixed shapes, so that a GPU can replay them as one CUDA graph.

On a GPU a small model's decode step is a few hundred short kernels, and launching them from Python costs
more than running them. A CUDA graph records the step's kernels once and replays them with one launch,
but only if every step has the same shapes and reads and writes the same memory. `StaticDecoder` gives
the step that form:
- the KV cache holds the whole rollout, `[b, heads, prompt + max_new_tokens, head_dim]` per layer
  (transformers' `StaticLayer`, which writes each new key at its running length, a tensor);
- the attention mask is one `[b, 1, 1, prompt + max_new_tokens]` buffer: the step's own slot is opened
  in place before it runs; slots not yet written stay closed (and hold zeros, never NaN);
- the step reads its tokens and positions from two `[b, 1]` buffers and writes its logits to one.
Rows that finish stay in the batch (their tokens are ignored): compacting would change the shapes.

`decode_path` chooses between this and lmrl's decode engine (`lmrl.engine`). On CUDA the step is captured after
one eager warm-up step; if capturing fails, the decoder says why once and runs the same fixed-shape step
eagerly. On a CPU there are no graphs: the fixed-shape step runs eagerly (only tests ask for it there),
and it samples the same tokens as the other paths (tested).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers.cache_utils import Cache, StaticLayer

from lmrl.engine.model_step import MASKED_KERNELS
from lmrl.models.shared_prompt import full_attention


def decode_path(model: nn.Module, device: torch.device, cuda_graph: bool) -> tuple[str, str]:
    """The decode path `HFGenerator` takes, and why: ("cuda_graph", why) for the fixed-shape step captured in a CUDA
    graph, else ("engine", why not) for `lmrl.engine`."""
    kernel = getattr(model.config, "_attn_implementation", None)
    if not cuda_graph:
        reason = "rollout.cuda_graph=false"
    elif device.type != "cuda":
        reason = f"no CUDA graphs on {device.type}"
    elif not full_attention(model):
        reason = "no CUDA graph: the model has sliding-window layers"
    elif kernel not in MASKED_KERNELS:
        reason = f"no CUDA graph: attn_implementation={kernel!r} takes no 4D mask (sdpa or eager do)"
    elif getattr(model, "hf_device_map", None):
        reason = "no CUDA graph: the model is spread over devices"
    else:
        return "cuda_graph", "a fixed-shape decode step captured in a CUDA graph"
    return "engine", reason


class StaticDecoder:
    """Decode steps of fixed shapes over a prefilled prompt cache, replayed as a CUDA graph where possible.

    Args:
        model: the causal LM (full attention, sdpa or eager kernel).
        prompt_cache: its cache after the prefill of the U distinct prompts: layers with `keys` / `values`
            of `[U, heads, P, head_dim]`.
        prompt_mask: `[U, P]` bool, the prompts' padding mask (left padding).
        row_prompt: `[b]` the distinct prompt of each row.
        max_new_tokens: steps the cache must hold.
        cache_keyword: the model's name for the cache argument (`past_key_values` or `cache`).
        graph: capture the step in a CUDA graph (on CUDA only).
    """

    def __init__(self, model: nn.Module, prompt_cache: Cache, prompt_mask: torch.Tensor, row_prompt: torch.Tensor,
                 max_new_tokens: int, cache_keyword: str, graph: bool) -> None:
        kernel = getattr(model.config, "_attn_implementation", None)
        if kernel not in MASKED_KERNELS:
            raise ValueError(f"attn_implementation: the fixed-shape decode step needs sdpa or eager, got {kernel!r}")
        self.model, self.cache_keyword = model, cache_keyword
        self.prompt_len = prompt_mask.shape[1]
        capacity = self.prompt_len + max_new_tokens
        layers = []
        for prefilled in prompt_cache.layers:
            keys = prefilled.keys.index_select(0, row_prompt)  # [b, H, P, D]: each row's copy of its prompt
            values = prefilled.values.index_select(0, row_prompt)
            layer = StaticLayer(capacity)
            layer.lazy_initialization(keys, values)  # zeros of [b, H, capacity, D]
            layer.keys[:, :, : self.prompt_len] = keys
            layer.values[:, :, : self.prompt_len] = values
            layer.cumulative_length.fill_(self.prompt_len)
            layers.append(layer)
        self.cache = Cache(layers=layers)
        rows = len(row_prompt)
        self.open = torch.zeros(rows, 1, 1, capacity, dtype=torch.bool, device=row_prompt.device)
        self.open[:, 0, 0, : self.prompt_len] = prompt_mask.index_select(0, row_prompt)
        dtype = next(model.parameters()).dtype
        # what the kernel reads: the bool mask itself (sdpa), or 0 / dtype-min where it is open / closed (eager)
        self.mask = self.open if kernel == "sdpa" else torch.zeros(self.open.shape, dtype=dtype, device=self.open.device)
        self._additive = kernel != "sdpa"
        self._sync_mask()
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=row_prompt.device)
        self.position = torch.zeros(rows, 1, dtype=torch.long, device=row_prompt.device)
        self.logits: torch.Tensor | None = None  # [b, V] the last step's, the graph's output buffer
        self.graph: torch.cuda.CUDAGraph | None = None
        self.use_graph = graph  # `decode_path` asks for it on CUDA only; elsewhere capturing fails, and falls back
        self.note: str | None = None  # why capturing failed, when it did

    def step(self, token: torch.Tensor, position: torch.Tensor, t: int) -> torch.Tensor:
        """Logits `[b, V]` after feeding `token` `[b]` at `position` `[b]`, the t-th response token (0-based)."""
        self.token.copy_(token[:, None])
        self.position.copy_(position[:, None])
        self.open[:, 0, 0, self.prompt_len + t] = True
        self._sync_mask(self.prompt_len + t)
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        logits = self._forward()
        if self.use_graph:  # the eager step above was the warm-up: capture the next ones
            self._capture()
        return logits

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.token, attention_mask=self.mask, position_ids=self.position,
                         **{self.cache_keyword: self.cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _capture(self) -> None:
        self.use_graph = False
        # recording runs nothing, so the cache and its running lengths are as the warm-up step left them
        lengths = [layer.cumulative_length.clone() for layer in self.cache.layers]
        try:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                self.logits = self._forward()
        except Exception as e:  # noqa: BLE001 - any failure falls back to the same step, eager
            self.note = f"CUDA graph capture failed, decoding eagerly: {type(e).__name__}: {e}"
            warnings.warn(self.note, RuntimeWarning, stacklevel=3)
            self.logits = None
            return
        finally:
            for layer, length in zip(self.cache.layers, lengths):
                layer.cumulative_length.copy_(length)
        self.graph = graph

    def _sync_mask(self, slot: int | None = None) -> None:
        if not self._additive:
            return
        closed = torch.finfo(self.mask.dtype).min
        if slot is None:
            self.mask.copy_(torch.where(self.open, 0.0, closed).to(self.mask.dtype))
        else:
            self.mask[:, 0, 0, slot] = 0.0
