"""Shared-prompt decode steps for Llama / Qwen2 models, the fast path of `HFGenerator`'s decode loop.

`SharedPromptDecoder` runs a decode step module by module with shared-prompt attention: each prompt's
keys and values are stored once, not once per completion, and each row attends to them and to its own
response keys under one softmax (on CPU attention was over half of a small model's decode time; this
halves it). Rotary cos / sin are computed once per rollout instead of once per step; q / k / v run as
one matmul (their weights concatenated once per rollout) and RMSNorm as torch's fused kernel, wherever
those modules are plain and hook-free. On CPU in float32 the projection weights are also reordered once
per rollout for oneDNN, and the MLP's SiLU and product and the residual adds run inside the matmuls
(`_Linear`); there, with a C compiler, rotary, the cache write and attention run as one C call per
layer and RMSNorm as another (`lmrl.kernels`).

`lmrl.rollout.hf` prefills and samples; this module only steps. The switches below are module flags so
that `benchmarks/decode_ab.py` and the tests can turn each optimisation off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

from lmrl.kernels import DecodeKernels
from lmrl.kernels import load as load_kernels
from lmrl.models.shared_prompt import apply_rotary, bypassable, hooked

# Decode-step matmuls with weights reordered for oneDNN on CPU in float32, for weights of at least
# PACK_MIN_ELEMENTS elements when torch runs 2+ threads (see `_Linear`, `_onednn_weight`); None: by
# the CPU, 2**17 with AVX2 and 2**19 with AVX-512, where plain matmuls are faster on small weights.
PACK_WEIGHTS = True
PACK_MIN_ELEMENTS: int | None = None
# The C decode kernels (`lmrl.kernels`) where they apply; off here (or `LMRL_KERNELS=0` in the
# environment) decodes with the PyTorch ops alone (`benchmarks/decode_ab.py` compares the two).
USE_KERNELS = True


class SharedPromptDecoder:
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
