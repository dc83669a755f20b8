"""Hugging Face generation backend: a decode loop with a KV cache, written for RL rollouts.

`HFGenerator` samples with the live `transformers` model the trainer updates in place, so every
rollout uses the current weights. It is faster than `model.generate` because it does only what
rollouts need:

1. prefill each distinct prompt once (`generate(num_return_sequences=n)` runs the prompt `n` times);
2. for Llama / Qwen2 models (`_SharedPromptDecoder`), decode steps run module by module with
   shared-prompt attention: each prompt's keys and values are stored once, not once per
   completion, and each row attends to them and to its own response keys under one softmax (on
   CPU attention was over half of a small model's decode time; this halves it). Rotary
   cos / sin are computed once per rollout instead of once per step; q / k / v run as one matmul
   (their weights concatenated once per rollout) and RMSNorm as torch's fused kernel, wherever those
   modules are plain and hook-free. On CPU in float32 the projection weights are also reordered once
   per rollout for oneDNN, and the MLP's SiLU and product and the residual adds run inside the
   matmuls (`_Linear`); there, with a C compiler, rotary, the cache write and attention run as one
   C call per layer and RMSNorm as another (`lmrl.kernels`);
3. other models: the prompt's KV cache is copied to its `n` completions, in a cache preallocated
   for prompt + `max_new_tokens` (no `torch.cat` of the whole cache per step) with, for
   full-attention models, a ready-made 4D attention mask sliced per step;
4. finished rows leave the forward batch (the cache is compacted with `index_select` once a
   quarter of the batch has finished), so late steps do less work;
5. sampling on `[B, V]` float32 logits with one `torch.Generator`, the log-prob of each sampled
   token computed from the same log-softmax, and stop strings checked on the last few tokens only.

Models whose config declares sliding-window or other non-full attention layers use transformers'
own `DynamicCache` and mask construction instead of (2) and (3); everything else is shared.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from lmrl.kernels import DecodeKernels
from lmrl.kernels import load as load_kernels
from lmrl.models.shared_prompt import apply_rotary, bypassable, full_attention, hooked
from lmrl.rollout.base import Rollout, SamplingParams
from lmrl.rollout.ops import cut_at_stop
from lmrl.rollout.static_decode import MASKED_KERNELS, StaticDecoder, decode_path

# Compact the batch (drop finished rows from the forward pass and the KV cache) once this fraction
# of the rows still in the batch has finished: compacting copies the cache, so doing it for every
# single finished row costs more than it saves.
COMPACT_FRACTION = 0.25
# Stop strings are searched in the decoded last (longest stop string in characters + this) tokens.
STOP_WINDOW_MARGIN = 8
# Decode-step matmuls with weights reordered for oneDNN on CPU in float32, for weights of at least
# PACK_MIN_ELEMENTS elements when torch runs 2+ threads (see `_Linear`, `_onednn_weight`); None: by
# the CPU, 2**17 with AVX2 and 2**19 with AVX-512, where plain matmuls are faster on small weights.
PACK_WEIGHTS = True
PACK_MIN_ELEMENTS: int | None = None
# The C decode kernels (`lmrl.kernels`) where they apply; off here (or `LMRL_KERNELS=0` in the
# environment) decodes with the PyTorch ops alone (`benchmarks/decode_ab.py` compares the two).
USE_KERNELS = True


class _PreallocatedLayer(DynamicLayer):
    """A full-attention KV-cache layer that writes into a buffer sized for the whole rollout.

    transformers' `DynamicLayer` concatenates the whole cache at every step (quadratic copying);
    this layer writes the new keys and values in place and returns views of the filled prefix.
    Buffers are `[B, capacity, H, D]` (sequence before heads) and the views `[B, H, L, D]`: each
    row's filled prefix is then one contiguous block, which CPU attention reads about as fast as a
    contiguous tensor (a `[B, H, capacity, D]` buffer sliced to L is ~2x slower in sdpa).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.key_buffer = key_states.new_empty((b, self.capacity, h, d))
        self.value_buffer = value_states.new_empty(
            (b, self.capacity, value_states.shape[1], value_states.shape[3])
        )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens for a capacity of {self.capacity}")
        self.key_buffer[:, self.length : end] = key_states.transpose(1, 2)
        self.value_buffer[:, self.length : end] = value_states.transpose(1, 2)
        self.length = end
        self._set_views()
        return self.keys, self.values

    def _set_views(self) -> None:
        self.keys = self.key_buffer[:, : self.length].transpose(1, 2)  # [B, H, L, D]
        self.values = self.value_buffer[:, : self.length].transpose(1, 2)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        # index_select also repeats rows: this is how the prompt cache is copied to its n completions
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, indices)
            self.value_buffer = self.value_buffer.index_select(0, indices)
            self._set_views()


class _SharedPromptDecoder:
    """Decode steps of a Llama / Qwen2 causal LM, run module by module with shared-prompt attention.

    A decode step of transformers' model spends most of its time in attention over a KV cache that
    holds every prompt `n` times (once per completion). Here each distinct prompt's keys and values
    are kept once, `[U, K, P, D]` (U prompts, K key/value heads, P prompt tokens, D head dim), and
    each row's response keys and values separately, `[b, K, max_new, D]`. A row's attention scores
    over its prompt and over its own response are concatenated before one softmax, so the result is
    ordinary attention over [prompt | response] (the "cascade" / shared-prefix attention of
    Juravsky et al., 2024, Hydragen), while the prompt part reads `n` times less memory.

    Rows are laid out in `U x S` slots (S = most rows of one prompt) for the prompt part: queries of
    one prompt's rows then form one `[S * g, D]` matrix against that prompt's keys (g = query heads
    per key head). The step also skips transformers' per-step mask construction, rotary
    recomputation and module plumbing: cos / sin are computed once for all positions of the rollout.
    Only used for the exact Llama / Qwen2 decoder classes with a position-independent rotary
    embedding (`supports`); other models use the generic path.
    """

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """True if `model` is a causal LM whose decoder layers this class reproduces exactly
        (`lmrl.models.shared_prompt.bypassable`: Llama / Qwen2, static rotary, no hooks on the layers and
        attention modules, whose `forward` is bypassed; hooks on the leaf modules called here still run)."""
        return bypassable(model)

    def __init__(
        self,
        model: nn.Module,
        prompt_cache: Cache,
        prompt_mask: torch.Tensor,
        row_local: torch.Tensor,
        max_new: int,
    ) -> None:
        """Take the prompt keys / values of a prefill.

        Args:
            model: The causal LM (`supports(model)` is True).
            prompt_cache: Cache of the prefill of the U distinct prompts (`_PreallocatedLayer`s).
            prompt_mask: `[U, P]` bool, True on real prompt tokens.
            row_local: `[b]` prompt (0..U-1) of each row.
            max_new: Most response tokens.
        """
        inner = model.model
        self.model, self.layers = model, list(inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.num_kv_heads = model.config.get_text_config(decoder=True).num_key_value_heads
        self.group = model.config.get_text_config(decoder=True).num_attention_heads // self.num_kv_heads
        num_prompts, prompt_len = prompt_mask.shape
        # 16-bit models: attention in float32 (the upcast of keys and values is exact), as transformers'
        # sdpa kernels accumulate in float32 and round once; 16-bit matmuls and softmax would not
        dtype = prompt_cache.layers[0].keys.dtype
        dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        self.prompt_keys = [
            layer.keys.to(dtype).contiguous() for layer in prompt_cache.layers
        ]  # [U, K, P, D]
        self.prompt_values = [layer.values.to(dtype).contiguous() for layer in prompt_cache.layers]
        # [U, 1, 1, P] additive mask on padded prompt positions (every prompt has a real token)
        self.prompt_bias = torch.zeros(prompt_mask.shape, dtype=dtype, device=prompt_mask.device)
        self.prompt_bias = self.prompt_bias.masked_fill(~prompt_mask, torch.finfo(dtype).min)[:, None, None]

        # slot of each row: prompt * S + rank of the row among its prompt's rows
        counts = torch.bincount(row_local, minlength=num_prompts)
        self.slots_per_prompt = int(counts.max())
        order = torch.argsort(row_local, stable=True)
        starts = counts.cumsum(0) - counts
        rank = torch.empty_like(row_local)
        rank[order] = torch.arange(row_local.numel(), device=row_local.device) - starts[row_local[order]]
        self.slot = row_local * self.slots_per_prompt + rank  # [b]
        self.num_slots = num_prompts * self.slots_per_prompt
        self.identity_slots = bool(
            torch.equal(self.slot, torch.arange(self.num_slots, device=self.slot.device))
        )

        # preallocated; attention reads the first `length` positions, all written (rows advance together)
        shape = (row_local.numel(), self.num_kv_heads, max_new, self.head_dim)
        self.response_keys = [self.prompt_keys[0].new_empty(shape) for _ in self.layers]
        self.response_values = [self.prompt_keys[0].new_empty(shape) for _ in self.layers]
        positions = torch.arange(prompt_len + max_new, device=prompt_mask.device)[None]
        cos, sin = inner.rotary_emb(prompt_cache.layers[0].keys, position_ids=positions)  # model dtype
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [P + max_new, D]
        # q, k, v as one matmul (weights concatenated once per rollout) where they are plain nn.Linear
        # (not LoRA-wrapped or hooked); None: call the modules. Then every projection is a `_Linear`.
        rows = row_local.numel()
        self.qkv = [_Linear.concat([a.q_proj, a.k_proj, a.v_proj], rows) for a in (layer.self_attn for layer in self.layers)]
        self.o_proj = [_Linear.of(layer.self_attn.o_proj, rows) for layer in self.layers]
        self.mlp = [_GatedMLP(m, rows) if _plain_mlp(m) else None for m in (layer.mlp for layer in self.layers)]
        self.lm_head = _Linear.of(model.lm_head, rows)
        # the C kernels (`lmrl.kernels`) on CPU with fused q / k / v and float32 attention (float32 and
        # 16-bit models): rotary, the cache write and attention as one call per layer, and RMSNorm of
        # float32 models; else (or without a C compiler) PyTorch
        self.kernels = None
        if (USE_KERNELS and self.cos.device.type == "cpu" and dtype == torch.float32
                and all(qkv is not None for qkv in self.qkv) and self.head_dim % 2 == 0):
            self.kernels = load_kernels()
            self.kernel_cos, self.kernel_sin = self.cos.float(), self.sin.float()  # [P + max_new, D]
        self.row_prompt = self.slot // self.slots_per_prompt  # [b] for the kernel
        self.prompt_bias_rows = self.prompt_bias[:, 0, 0].contiguous()  # [U, P]
        self._check_kernel_inputs()

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (`[a]` indices) of the response cache."""
        self.response_keys = [x.index_select(0, keep) for x in self.response_keys]
        self.response_values = [x.index_select(0, keep) for x in self.response_values]
        self.slot = self.slot.index_select(0, keep)
        self.row_prompt = self.slot // self.slots_per_prompt
        self.identity_slots = False
        self._check_kernel_inputs()

    def step(self, token: torch.Tensor, position: torch.Tensor, t: int) -> torch.Tensor:
        """Feed `[b]` tokens at `[b]` positions as response token t; return `[b, V]` next-token logits."""
        b, heads, d = token.shape[0], self.num_kv_heads * self.group, self.head_dim
        hidden = self.model.model.embed_tokens(token)  # [b, hidden]
        if self.kernels is not None and not torch.is_autocast_enabled("cpu"):  # autocast: bf16 projections
            return self._kernel_step(hidden, position, t)
        cos, sin = self.cos[position][:, None], self.sin[position][:, None]  # [b, 1, D]
        kv = self.num_kv_heads
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = _rms_norm(layer.input_layernorm, hidden)
            if self.qkv[i] is not None:
                q, k, v = self.qkv[i](x).split([heads * d, kv * d, kv * d], dim=-1)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            # rotate queries and keys together: [b, heads + kv, D]
            qk = apply_rotary(torch.cat([q, k], dim=-1).view(b, heads + kv, d), cos, sin)
            self.response_keys[i][:, :, t] = qk[:, heads:]
            self.response_values[i][:, :, t] = v.view(b, kv, d)
            out = self._attend(i, qk[:, :heads].view(b, kv, self.group, d), t + 1)
            hidden = self.o_proj[i](out.reshape(b, heads * d).to(x.dtype), add=hidden)
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            hidden = self.mlp[i](x, residual=hidden) if self.mlp[i] is not None else hidden + layer.mlp(x)
        return self.lm_head(_rms_norm(self.model.model.norm, hidden))

    def _kernel_step(self, hidden: torch.Tensor, position: torch.Tensor, t: int) -> torch.Tensor:
        """`step` with the C kernels: per layer, RMSNorm, the fused q / k / v matmul, then one
        `decode_attention` call for rotary, the cache write and attention."""
        kernels, heads, position = self.kernels, self.num_kv_heads * self.group, position.contiguous()
        cos, sin = self.kernel_cos, self.kernel_sin
        for i, layer in enumerate(self.layers):
            x = _rms_norm(layer.input_layernorm, hidden, kernels)
            # 16-bit models: q / k / v upcast, attention in float32 (as the PyTorch path), output back
            out = kernels.decode_attention(
                self.qkv[i](x).float().contiguous(), cos, sin, position, self.prompt_keys[i], self.prompt_values[i],
                self.prompt_bias_rows, self.response_keys[i], self.response_values[i], self.row_prompt,
                heads, t, self.scaling, checked=True,
            )
            hidden = self.o_proj[i](out.to(hidden.dtype), add=hidden)
            x = _rms_norm(layer.post_attention_layernorm, hidden, kernels)
            hidden = self.mlp[i](x, residual=hidden) if self.mlp[i] is not None else hidden + layer.mlp(x)
        return self.lm_head(_rms_norm(self.model.model.norm, hidden, kernels))

    def _check_kernel_inputs(self) -> None:
        """What the kernel reads by pointer besides each step's q / k / v and positions, checked once per
        change (here and in `select`) so that its steps can pass `checked=True`."""
        if self.kernels is None:
            return
        heads = self.num_kv_heads * self.group
        for i in range(len(self.layers)):
            self.kernels.check_attention(self.kernel_cos, self.kernel_sin, self.prompt_keys[i], self.prompt_values[i],
                                         self.prompt_bias_rows, self.response_keys[i], self.response_values[i],
                                         self.row_prompt, heads)

    def _attend(self, i: int, q: torch.Tensor, length: int) -> torch.Tensor:
        """`[b, K, g, D]` queries -> `[b, K, g, D]` attention over the prompt and `length` response tokens.

        Attention is computed in the dtype of the stored keys (float32 for 16-bit models).
        """
        b, k, g, _ = q.shape
        q = q.to(self.prompt_keys[i].dtype) * self.scaling
        prompt_keys = self.prompt_keys[i]
        prompt_len = prompt_keys.shape[2]
        scores_prompt = self._from_slots(
            torch.matmul(self._to_slots(q), prompt_keys.transpose(2, 3)) + self.prompt_bias
        )  # [b, K, g, P]
        response_keys = self.response_keys[i][:, :, :length]  # [b, K, length, D]
        scores_response = torch.matmul(q, response_keys.transpose(2, 3))  # [b, K, g, length]
        probs = torch.softmax(torch.cat([scores_prompt, scores_response], dim=-1), dim=-1)
        out = self._from_slots(torch.matmul(self._to_slots(probs[..., :prompt_len]), self.prompt_values[i]))
        return out + torch.matmul(probs[..., prompt_len:], self.response_values[i][:, :, :length])

    def _to_slots(self, x: torch.Tensor) -> torch.Tensor:
        """`[b, K, g, X]` per row -> `[U, K, S * g, X]` per prompt (empty slots are zero)."""
        if not self.identity_slots:
            x = x.new_zeros((self.num_slots, *x.shape[1:])).index_copy_(0, self.slot, x)
        _, k, g, last = x.shape
        return (
            x.view(-1, self.slots_per_prompt, k, g, last)
            .transpose(1, 2)
            .reshape(-1, k, self.slots_per_prompt * g, last)
        )

    def _from_slots(self, x: torch.Tensor) -> torch.Tensor:
        """`[U, K, S * g, X]` per prompt -> `[b, K, g, X]` per row."""
        u, k, _, last = x.shape
        x = x.view(u, k, self.slots_per_prompt, self.group, last).transpose(1, 2)
        x = x.reshape(self.num_slots, k, self.group, last)
        return x if self.identity_slots else x.index_select(0, self.slot)


class _Linear:
    """`x @ weight.T + bias` in the decode steps, optionally followed by an activation, `+ add` or `* mul`.

    On CPU in float32, where `_onednn_weight` finds it pays, the weight is reordered once per rollout
    into oneDNN's blocked layout and the activation (SiLU), add or multiply run inside the matmul
    kernel (`torch.ops.mkldnn`, what torch.compile's CPU backend emits for linears with frozen
    weights): on an AVX2 CPU, rollouts of the vs-TRL benchmark's hidden 256 / 4 layers model are 1.14x
    faster (`benchmarks/decode_ab.py --toggle pack`). Elsewhere it is `F.linear` (or `addmm` for an
    add) and plain ops.
    A module that is not a plain, hook-free nn.Linear (LoRA, quantised, hooked) is called as is.
    """

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, rows: int,
                 module: nn.Module | None = None, pack: bool = True) -> None:
        self.module, self.bias = module, bias
        self.packed = None if weight is None or not pack else _onednn_weight(weight, rows)
        self.weight = weight if self.packed is None else None

    @classmethod
    def of(cls, module: nn.Module, rows: int) -> _Linear:
        """`module` as a `_Linear`; `rows`: the batch the weight layout is chosen for."""
        if not _plain_linear(module):
            return cls(None, None, rows, module=module)
        return cls(module.weight.detach(), None if module.bias is None else module.bias.detach(), rows)

    @classmethod
    def concat(cls, modules: list[nn.Module], rows: int, pack: bool = True) -> _Linear | None:
        """One `_Linear` doing the work of `modules` (outputs concatenated), or None if any of them is not
        a plain nn.Linear or only some have a bias. `pack=False`: never oneDNN-packed."""
        biases = [m.bias for m in modules]
        if not all(_plain_linear(m) for m in modules) or (None in biases and any(b is not None for b in biases)):
            return None
        weight = torch.cat([m.weight.detach() for m in modules])
        return cls(weight, None if biases[0] is None else torch.cat([b.detach() for b in biases]), rows, pack=pack)

    def __call__(self, x: torch.Tensor, act: nn.Module | None = None, add: torch.Tensor | None = None,
                 mul: torch.Tensor | None = None) -> torch.Tensor:
        """act(x @ W.T + b), then `+ add` or `* mul` (at most one of the two)."""
        if self.packed is not None and (act is None or _is_silu(act)):
            if add is not None or mul is not None:
                other, op = (add, "add") if add is not None else (mul, "mul")
                return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, op)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none" if act is None else "swish", [], "")
        if self.packed is not None:  # an activation oneDNN does not fuse
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        elif self.module is not None:
            y = self.module(x)
        elif act is None and add is not None and self.bias is None and x.dim() == 2:
            return torch.addmm(add, x, self.weight.t())  # the add inside the matmul
        else:
            y = F.linear(x, self.weight, self.bias)
        if act is not None:
            y = act(y)
        return y + add if add is not None else y * mul if mul is not None else y


class _GatedMLP:
    """A Llama / Qwen2 MLP plus the residual, `down(act(gate(x)) * up(x)) + residual`, from `_Linear`s.

    With oneDNN-packed weights, the activation, the product and the add run inside the three matmuls;
    otherwise gate and up are one matmul (weights concatenated) and the add is an `addmm`.
    """

    def __init__(self, mlp: nn.Module, rows: int) -> None:
        self.act = mlp.act_fn
        self.gate, self.up = _Linear.of(mlp.gate_proj, rows), _Linear.of(mlp.up_proj, rows)
        # the unpacked case: gate / up too small to pack on their own, so their concatenation (twice the
        # size, with no epilogue to fuse) stays unpacked too (packed: 0.94x at hidden 256 on AVX-512)
        self.gate_up = None if self.gate.packed is not None else _Linear.concat([mlp.gate_proj, mlp.up_proj], rows, pack=False)
        self.down = _Linear.of(mlp.down_proj, rows)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down(self.up(x, mul=self.gate(x, act=self.act)), add=residual)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up, add=residual)


def _onednn_weight(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """`weight` reordered for oneDNN's matmul with about `rows` input rows, or None where that does not
    pay or apply. Measured at 64 rows on 2 cores: on AVX2, oneDNN beat `F.linear` only with 2+ threads
    and weights of 2**17+ elements (1.2-1.4x at 256 x 768), and lost up to 2x on smaller ones or on one
    thread; on AVX-512 (with AMX) whole rollouts lost 0.92-0.93x at hidden 256-320, broke even at 384
    and won 1.12-1.13x at 512-1024, hence 2**19 there (`pack_min_elements`). Also None off CPU, for
    other dtypes, without oneDNN, or with `PACK_WEIGHTS` off."""
    if not (PACK_WEIGHTS and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.numel() >= pack_min_elements() and torch.get_num_threads() > 1
            and torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except (AttributeError, RuntimeError):  # a torch build without the op
        return None


def cache_keyword(model: nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in transformers releases that renamed it
    (5.24 deprecates `past_key_values`, to be removed in 5.40), else `past_key_values`. A peft model
    passes it through to its base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def pack_min_elements() -> int:
    """The smallest weight (in elements) `_onednn_weight` packs: `PACK_MIN_ELEMENTS`, or by the CPU."""
    if PACK_MIN_ELEMENTS is not None:
        return PACK_MIN_ELEMENTS
    return 2**19 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 2**17


def _is_silu(act: nn.Module) -> bool:
    """torch's or transformers' SiLU module, without hooks (what oneDNN's "swish" computes)."""
    return type(act).__name__ in ("SiLU", "SiLUActivation") and not hooked(act)


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and not hooked(module)


def _plain_mlp(mlp: nn.Module) -> bool:
    """A Llama / Qwen2 gated MLP: down(act(gate(x)) * up(x)), with no hooks on the module itself."""
    return type(mlp).__name__ in ("LlamaMLP", "Qwen2MLP") and not hooked(mlp)


def _rms_norm(norm: nn.Module, x: torch.Tensor, kernels: DecodeKernels | None = None) -> torch.Tensor:
    """Llama / Qwen2 RMSNorm with torch's fused kernel, or the C one (`kernels`, float32 `[b, hidden]`
    on CPU): weight * (x / rms(x)) computed in float32, as transformers does; other norm modules are called."""
    if type(norm).__name__ not in ("LlamaRMSNorm", "Qwen2RMSNorm") or hooked(norm):
        return norm(x)
    if kernels is not None and x.dim() == 2 and x.dtype == norm.weight.dtype == torch.float32 and x.device.type == "cpu":
        return kernels.rms_norm(x.contiguous(), norm.weight.detach(), norm.variance_epsilon)
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], norm.weight, eps=norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon).to(x.dtype)


@dataclass
class _ChunkResult:
    """Responses of one forward batch (b rows, Tc response tokens)."""

    tokens: torch.Tensor  # [b, Tc]
    logprobs: torch.Tensor  # [b, Tc]
    lengths: torch.Tensor  # [b] real response tokens
    finished: torch.Tensor  # [b]


@dataclass
class _Prefill:
    """What a chunk's decode loop starts from: the prefilled cache, the decode path's state, the first logits."""

    static: bool  # fixed-shape step (`StaticDecoder`): every row steps, the active ones are sampled
    lean: bool  # shared-prompt step (`_SharedPromptDecoder`)
    cache: Cache
    decoder: StaticDecoder | _SharedPromptDecoder | None  # None: the model's own forward on `cache`
    mask: torch.Tensor | None  # the model's forward: `attention_mask` over [prompt | response], sliced per step
    logits: torch.Tensor  # [b, V] float32, at each row's last prompt token
    next_position: torch.Tensor  # [b] position of each row's first response token
    prompt_len: int  # P, the left-padded prompt width


class HFGenerator:
    """Samples completions with a Hugging Face causal LM and its own KV-cached decode loop.

    Args:
        model: A `transformers` causal LM (the live object: generation always uses its current
            weights). It is put in eval mode during `generate` and its previous mode is restored.
            Pass the unwrapped module, not a DDP/FSDP wrapper.
        tokenizer: Its tokenizer; used only to decode texts, detect stop strings and find the
            EOS / pad ids. Generation itself works on token ids.
        batch_size: Most sequences (rows) per forward pass; larger requests are split. None: all
            rows at once.
        device: Device of the inputs and of the returned tensors; defaults to the model's device.
        eos_token_id: Token id(s) that end a completion. None: the union of
            `model.generation_config.eos_token_id` (an id or a list) and `tokenizer.eos_token_id`.
            An empty list disables EOS (completions run to `max_new_tokens`).
        pad_token_id: Id that fills padding; defaults to the tokenizer's pad id, else the first EOS id.
        seed: Seed of the generator's own `torch.Generator`, used when `SamplingParams.seed` is
            None. None draws it from torch's global RNG (so `torch.manual_seed` fixes it).
        cuda_graph: On CUDA, decode with fixed shapes and replay each step as a CUDA graph
            (`lmrl.rollout.static_decode`) where the model allows it; `decode_path` says why not.
        fixed_shapes: Take the fixed-shape decode step even where no graph is captured (a CPU):
            for tests, which check that it samples what the other paths sample.

    The model runs in its own dtype; logits are upcast to float32 for sampling and log-probs. With
    temperature 0 (greedy) the returned log-probs are those of softmax(logits), i.e. temperature 1.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        batch_size: int | None = None,
        device: torch.device | str | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        cuda_graph: bool = True,
        fixed_shapes: bool = False,
    ) -> None:
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"batch_size: must be None or an integer >= 1, got {batch_size!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.eos_token_ids = resolve_eos(model, tokenizer, eos_token_id)
        if pad_token_id is None:
            pad_token_id = tokenizer.pad_token_id
        if pad_token_id is None:
            pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id)
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        self._rng = torch.Generator(device=self.device)
        self._rng.manual_seed(seed)

        text_config = model.config.get_text_config(decoder=True)
        self._num_layers = text_config.num_hidden_layers
        # the preallocated cache and the ready-made mask assume every layer attends to the full past
        self._full_attention = full_attention(model)
        self._cache_kwarg = cache_keyword(model)
        self._attn_implementation = getattr(model.config, "_attn_implementation", None)
        self.cuda_graph, self.fixed_shapes = cuda_graph, fixed_shapes
        if fixed_shapes and (not self._full_attention or self._attn_implementation not in MASKED_KERNELS):
            raise ValueError("fixed_shapes: needs a full-attention model with the sdpa or eager kernel")

    def decode_path(self) -> tuple[str, str]:
        """The decode path the next chunk takes, and why: "cuda_graph", "fixed_shapes" (the same step
        without a graph), "shared_prompt" or "cache" (`lmrl.rollout.static_decode.decode_path`). Asked per
        chunk: hooks (FSDP's) may come and go."""
        lean = self._full_attention and _SharedPromptDecoder.supports(self.model)
        path, why = decode_path(self.model, self.device, self.cuda_graph, lean)
        if self.fixed_shapes and path != "cuda_graph":
            return "fixed_shapes", "fixed_shapes=True"
        return path, why

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Rollout:
        """Sample `n` completions for each prompt.

        Args:
            prompts: Token-id lists, one per prompt, each non-empty.
            n: Completions per prompt (>= 1); rows `i * n .. i * n + n - 1` belong to prompt `i`.
            params: Sampling parameters; `params.seed` makes the call reproducible.

        Returns:
            A `Rollout` with `len(prompts) * n` rows, tensors on `self.device`.
        """
        _validate_prompts(prompts)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: completions per prompt must be an integer >= 1, got {n!r}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        params.validate()
        rng = self._rng
        if params.seed is not None:
            rng = torch.Generator(device=self.device)
            rng.manual_seed(params.seed)

        num_rows = len(prompts) * n
        row_prompt = torch.arange(len(prompts)).repeat_interleave(n)  # [B]
        if self.batch_size is None or self.batch_size >= num_rows:
            chunks = [torch.arange(num_rows)]
        else:
            # rows of prompts of similar length share a forward batch: less padding
            by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
            order = torch.tensor(by_length).repeat_interleave(n) * n + torch.arange(n).repeat(len(prompts))
            chunks = list(order.split(self.batch_size))

        results = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for rows in chunks:
                    results.append(self._generate_chunk(prompts, row_prompt[rows].tolist(), params, rng))
        finally:
            self.model.train(was_training)
        return self._assemble(prompts, n, chunks, results, params)

    def _generate_chunk(
        self, prompts: list[list[int]], row_prompt: list[int], params: SamplingParams, rng: torch.Generator
    ) -> _ChunkResult:
        """Prefill the distinct prompts of `row_prompt`, then decode one completion per row."""
        device, max_new, num_rows = self.device, params.max_new_tokens, len(row_prompt)
        # 1. prefill: each distinct prompt once
        start = self._prefill(prompts, row_prompt, max_new)
        static, lean, cache, decoder, mask = start.static, start.lean, start.cache, start.decoder, start.mask
        logits, next_position, prompt_len = start.logits, start.next_position, start.prompt_len
        first_position = next_position  # [b] of every row, as the fixed-shape step takes them
        del start  # the first logits [b, V] are freed once the first step replaces them

        tokens = torch.full((num_rows, max_new), self.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(num_rows, max_new, dtype=torch.float32, device=device)
        lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=device)
        finished = torch.zeros(num_rows, dtype=torch.bool, device=device)
        active = torch.arange(num_rows, device=device)  # chunk rows still in the forward batch
        done = torch.zeros(num_rows, dtype=torch.bool, device=device)  # per active row
        stops = _StopChecker(self.tokenizer, params.stop, num_rows) if params.stop else None

        # 2. decode: sample from the last logits, record, feed the token back
        for t in range(max_new):
            token, token_logprob = _sample(logits, params, rng)  # [a], [a]
            tokens[active, t] = token
            logprobs[active, t] = token_logprob
            ended = torch.isin(token, self._eos) if len(self.eos_token_ids) else torch.zeros_like(done)
            if stops is not None:
                ended |= stops.update(active, token, done)
            ended &= ~done
            if bool(ended.any()):
                ended_rows = active[ended]
                lengths[ended_rows] = t + 1
                finished[ended_rows] = True
                done |= ended
            if t == max_new - 1 or bool(done.all()):
                break
            if int(done.sum()) >= COMPACT_FRACTION * done.numel():
                keep = (~done).nonzero().squeeze(1)
                active, done, token, next_position = (
                    active[keep],
                    done[keep],
                    token[keep],
                    next_position[keep],
                )
                if lean:
                    decoder.select(keep)
                elif not static:  # fixed shapes keep every row in the step; only the sampling leaves them
                    cache.batch_select_indices(keep)
                    mask = mask[keep]
            if static:  # every row steps (finished ones on padding); the rows still active are sampled
                every = torch.full((num_rows,), self.pad_token_id, dtype=torch.long, device=device)
                every[active] = token
                logits = decoder.step(every, first_position + t, t).index_select(0, active).float()
                continue
            if lean:
                logits = decoder.step(token, next_position + t, t).float()
                continue
            kv_length = prompt_len + t + 1
            out = self.model(
                input_ids=token[:, None],
                attention_mask=mask[..., :kv_length],
                position_ids=(next_position + t)[:, None],
                **{self._cache_kwarg: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1].float()
        return self._trimmed(tokens, logprobs, lengths, finished)

    def _prefill(self, prompts: list[list[int]], row_prompt: list[int], max_new: int) -> _Prefill:
        """Run each distinct prompt of `row_prompt` once and set up the decode path; `[b, V]` first logits."""
        device = self.device
        distinct = sorted(set(row_prompt))
        local = {p: i for i, p in enumerate(distinct)}
        row_local = torch.tensor([local[p] for p in row_prompt], device=device)  # [b] row -> prefill row
        prompt_ids, prompt_mask = self._left_pad([prompts[p] for p in distinct])  # [U, P]
        num_rows, prompt_len = len(row_prompt), prompt_ids.shape[1]
        capacity = prompt_len + max_new

        # positions count real tokens only (left padding)
        path, _ = self.decode_path()
        static, lean = path in ("cuda_graph", "fixed_shapes"), path == "shared_prompt"
        cache = self._new_cache(prompt_len if lean or static else capacity)
        position_ids = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)
        out = self.model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask.long(),
            position_ids=position_ids,
            **{self._cache_kwarg: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1].float().index_select(0, row_local)  # [b, V]
        next_position = prompt_mask.sum(1).index_select(0, row_local)  # [b]
        decoder, mask = None, None
        if static:
            decoder = StaticDecoder(self.model, cache, prompt_mask, row_local, max_new, self._cache_kwarg,
                                    graph=path == "cuda_graph")
        elif lean:
            decoder = _SharedPromptDecoder(self.model, cache, prompt_mask, row_local, max_new)
        else:
            cache.batch_select_indices(row_local)  # copy each prompt's cache to its rows
            # attention over [prompt | response]: the response part is all ones, sliced per step
            mask = torch.ones(num_rows, capacity, dtype=torch.bool, device=device)
            mask[:, :prompt_len] = prompt_mask.index_select(0, row_local)
            mask = self._decode_mask(mask)
        return _Prefill(static, lean, cache, decoder, mask, logits, next_position, prompt_len)

    def _trimmed(self, tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor,
                 finished: torch.Tensor) -> _ChunkResult:
        """`[b, max_new]` buffers cut to the longest row, padding (and log-prob 0) past each row's length."""
        width = int(lengths.max())
        valid = torch.arange(width, device=tokens.device) < lengths[:, None]
        tokens = tokens[:, :width].masked_fill(~valid, self.pad_token_id)
        logprobs = logprobs[:, :width].masked_fill(~valid, 0.0)
        return _ChunkResult(tokens=tokens, logprobs=logprobs, lengths=lengths, finished=finished)

    def _new_cache(self, capacity: int) -> Cache:
        if self._full_attention:
            return Cache(layers=[_PreallocatedLayer(capacity) for _ in range(self._num_layers)])
        return DynamicCache(config=self.model.config)

    def _decode_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """`[b, capacity]` bool mask -> what the decode steps pass as `attention_mask` (sliced on the last dim).

        A 4D mask is used by the model as is, which skips transformers' mask construction at every
        step; only for full attention with the sdpa (bool: True attends) or eager (additive float)
        kernels, whose mask formats are known. Otherwise the 2D padding mask is passed.
        """
        if not self._full_attention or self._attn_implementation not in ("sdpa", "eager"):
            return mask.long()
        mask = mask[:, None, None, :]  # [b, 1, 1, capacity]
        if self._attn_implementation == "sdpa":
            return mask
        dtype = next(self.model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token lists -> `[U, P]` left-padded ids and their bool mask."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = True
        return ids.to(self.device), mask.to(self.device)

    def _assemble(
        self,
        prompts: list[list[int]],
        n: int,
        chunks: list[torch.Tensor],
        results: list[_ChunkResult],
        params: SamplingParams,
    ) -> Rollout:
        """Put the rows of every chunk back in prompt order, padded to common widths."""
        num_rows = len(prompts) * n
        width = max(r.tokens.shape[1] for r in results)
        tokens = torch.full((num_rows, width), self.pad_token_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(num_rows, width, dtype=torch.float32, device=self.device)
        lengths = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        finished = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        for rows, r in zip(chunks, results):
            rows = rows.to(self.device)
            tokens[rows, : r.tokens.shape[1]] = r.tokens
            logprobs[rows, : r.logprobs.shape[1]] = r.logprobs
            lengths[rows] = r.lengths
            finished[rows] = r.finished
        response_mask = torch.arange(width, device=self.device) < lengths[:, None]
        prompt_ids, prompt_mask = self._left_pad(prompts)
        prompt_index = torch.arange(len(prompts), device=self.device).repeat_interleave(n)
        ids = [row[:length] for row, length in zip(tokens.tolist(), lengths.tolist())]
        texts = [
            cut_at_stop(text, params.stop)
            for text in self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        ]
        return Rollout(
            prompt_ids=prompt_ids.index_select(0, prompt_index),
            prompt_mask=prompt_mask.index_select(0, prompt_index),
            response_ids=tokens,
            response_mask=response_mask,
            logprobs=logprobs,
            texts=texts,
            finished=finished,
            prompt_index=prompt_index,
        )


class _StopChecker:
    """Detects, one step at a time, the token whose decoding completes a stop string.

    Only the last `max(len(stop)) + STOP_WINDOW_MARGIN` tokens of each live row are decoded (a stop
    string of L characters spans at most L tokens that each decode to at least one character), and
    a stop string is first found in that window at the step that completes it.
    """

    def __init__(self, tokenizer, stop: list[str], num_rows: int) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.window = max(len(s) for s in stop) + STOP_WINDOW_MARGIN
        self.history: list[list[int]] = [[] for _ in range(num_rows)]

    def update(self, active: torch.Tensor, token: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """Append this step's tokens; return `[a]` bool, True where a stop string was just completed."""
        live = (~done).nonzero().squeeze(1).tolist()
        rows, tokens = active.tolist(), token.tolist()
        tails = []
        for j in live:
            history = self.history[rows[j]]
            history.append(tokens[j])
            tails.append(history[-self.window :])
        hit = torch.zeros(done.shape, dtype=torch.bool)
        for j, text in zip(live, self.tokenizer.batch_decode(tails, skip_special_tokens=False)):
            if any(s in text for s in self.stop):
                hit[j] = True
        return hit.to(done.device)


def _sample(
    logits: torch.Tensor, params: SamplingParams, rng: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its log-prob under the untruncated distribution.

    Args:
        logits: `[B, V]` float32 next-token logits.
        params: temperature (0 = argmax), top_k, top_p.
        rng: Source of randomness.

    Returns:
        `[B]` token ids and `[B]` float32 log softmax(logits / temperature)[token] (temperature 1 when
        greedy). Top-k / top-p only restrict where samples are drawn from; the log-prob is that of the
        full distribution, which is what the trainer's forward pass computes.
    """
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(dim=-1)
    else:
        logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [B, V]
        if params.top_k > 0 or params.top_p < 1.0:
            probs = torch.softmax(_truncate(logp, params.top_k, params.top_p), dim=-1)
        else:
            probs = logp.exp()
        token = _sample_categorical(probs, rng)
    return token, logp.gather(1, token[:, None]).squeeze(1)


def _sample_categorical(probs: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """Draw one index per row of `[B, V]` non-negative weights by inverting the cumulative sum.

    One uniform number per row instead of `torch.multinomial`, which is ~25x slower on CPU for a
    32k vocabulary. The float64 cumsum keeps the rounding error far below any probability that
    matters; `right=True` never returns an index of zero weight.
    """
    cdf = probs.double().cumsum(-1)  # [B, V]
    u = torch.rand(cdf.shape[0], 1, generator=rng, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def _truncate(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf the `[B, V]` log-probs outside the top-k, then outside the top-p nucleus.

    Top-p keeps the smallest set of most likely tokens whose (top-k renormalised) mass reaches
    `top_p`; the most likely token is always kept.
    """
    if 0 < top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logp, dim=-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        remove = torch.zeros_like(logp, dtype=torch.bool).scatter_(1, order, mass_before >= top_p)
        logp = logp.masked_fill(remove, float("-inf"))
    return logp


def resolve_eos(model: nn.Module, tokenizer, eos_token_id: int | list[int] | None) -> list[int]:
    if eos_token_id is not None:
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    else:
        config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = config_eos if isinstance(config_eos, list) else [config_eos]
        ids = [*ids, tokenizer.eos_token_id]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _validate_prompts(prompts: list[list[int]]) -> None:
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts: expected a non-empty list of token-id lists")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise TypeError(f"prompts: prompt {i} must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"prompts: prompt {i} has zero tokens; every prompt needs at least one")
