"""A decode step of a Llama / Qwen2 / Qwen3 model over the engine's cache, module by module.

What the model's forward computes for one new token per row (RMSNorm, q / k / v, rotary at each row's position,
attention, the MLP), without transformers' per-step mask construction, rotary recomputation and module plumbing,
which at small sizes cost more than the arithmetic (Qwen3 adds an RMSNorm of each query and key head before
rotary). q / k / v run as one matmul (their weights concatenated once per engine) where they are plain
`nn.Linear`s; the linears and the MLP are `lmrl.engine.layers`' (oneDNN-packed with fused epilogues on a CPU where
that pays).

Attention is shared-prompt ("cascade") attention over `KVCache`: a row's scores over its prompt's keys (stored once
for the whole group) and over its own response keys go through one softmax, so the result is ordinary attention
over [prompt | response] (Juravsky et al., 2024, Hydragen) while the prompt part reads n times less memory. Key /
value heads are never repeated: a prompt's g query heads per key head form one matrix against its keys. On a CPU in
float32 with a C compiler, rotary, the cache write and attention run as one C call per layer and RMSNorm as another
(`lmrl.kernels`); elsewhere the same in PyTorch.
"""

from __future__ import annotations

import torch
from torch import nn

from lmrl.engine.cache import KVCache, StepRows
from lmrl.engine.layers import GatedMLP, Linear, plain_mlp, rms_norm
from lmrl.kernels import load as load_kernels
from lmrl.models.shared_prompt import apply_rotary, bypassable, decoder_stack, head_norms

# The C decode kernels (`lmrl.kernels`) where they apply; off here (or `LMRL_KERNELS=0` in the environment)
# decodes with the PyTorch ops alone (`benchmarks/decode_ab.py` compares the two).
USE_KERNELS = True


def supports(model: nn.Module) -> bool:
    """True if `model` is a causal LM whose decoder layers `LlamaStep` reproduces exactly (`bypassable`: Llama /
    Qwen2, static rotary, no hooks on the layers and attention modules, whose `forward` is bypassed; hooks on the
    leaf modules called here still run)."""
    return bypassable(model) and hasattr(model, "lm_head")


class LlamaStep:
    """Decode steps of a Llama / Qwen2 causal LM (`supports`) over a `KVCache`.

    Args:
        model: the causal LM; its weights are read when the step is built (q / k / v concatenated, oneDNN layouts):
            build a new step after the weights change.
        rows: about how many rows a step runs (oneDNN picks its weight layout for it).
    """

    shares_prompts = True  # a prompt's keys stored once for all its rows

    def __init__(self, model: nn.Module, rows: int) -> None:
        self.inner = decoder_stack(model)
        self.layers, self.model = list(self.inner.layers), model
        config = model.config.get_text_config(decoder=True)
        attn = self.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.group = self.heads // self.kv_heads
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.head_norms = getattr(attn, "q_norm", None) is not None  # Qwen3: RMSNorm of each query and key head
        self.qkv = [Linear.concat([a.q_proj, a.k_proj, a.v_proj], rows) for a in (layer.self_attn for layer in self.layers)]
        self.o_proj = [Linear.of(layer.self_attn.o_proj, rows) for layer in self.layers]
        self.mlp = [GatedMLP(m, rows) if plain_mlp(m) else None for m in (layer.mlp for layer in self.layers)]
        self.lm_head = Linear.of(model.lm_head, rows)
        self.cos = self.sin = None  # [positions, D] rotary tables in the cache's dtype, grown as positions do
        self.kernels, self._checked = None, -1  # the cache version the kernels' inputs were checked at
        self.kernel_steps = 0  # steps the C kernels ran: what a test counts
        self._logits: torch.Tensor | None = None  # see `_logits_buffer`

    def cache_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype keys and values are stored (and attention runs) in: float32 on a CPU for a 16-bit model (as
        transformers' kernels accumulate in float32), else the model's."""
        dtype = next(self.model.parameters()).dtype
        return torch.float32 if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16) else dtype

    def new_cache(self, device: torch.device, like: torch.Tensor | None = None, fixed: bool = False) -> KVCache:
        """An empty cache for these steps (`like`, a prefill's keys, is not needed: the model's config gives the
        shape; `fixed`: steps of fixed shapes); the C kernels are chosen here (they never read a column they did not
        write, so their stores skip the zero fill)."""
        dtype = self.cache_dtype(device)
        if (USE_KERNELS and device.type == "cpu" and dtype == torch.float32 and not fixed
                and all(qkv is not None for qkv in self.qkv) and self.head_dim % 2 == 0):
            self.kernels = load_kernels()
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, dtype, device, zeroed=self.kernels is None,
                       fixed=fixed)

    def rotary(self, positions: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin tables `[L, D]` for at least `positions` positions (the host's count: no device query)."""
        if self.cos is None or self.cos.shape[0] < positions:
            size = max(64, 2 * positions)
            cos, sin = self.inner.rotary_emb(like, position_ids=torch.arange(size, device=like.device)[None])
            self.cos, self.sin = cos[0].to(like.dtype).contiguous(), sin[0].to(like.dtype).contiguous()
        return self.cos, self.sin

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache: KVCache, positions: int) -> torch.Tensor:
        """Feed `[b]` tokens at `[b]` positions (each below `positions`), each written at its row's response column
        `cache.row_length`; return `[b, V]` next-token logits. The cache's lengths advance after this returns."""
        hidden = self.inner.embed_tokens(token)  # [b, hidden]
        cos, sin = self.rotary(positions, cache.row_keys[0])
        # autocast: bf16 projections; fixed shapes: the PyTorch path (what a GPU captures)
        kernels = self.kernels if not torch.is_autocast_enabled("cpu") and not cache.fixed else None
        if kernels is not None and self._checked != cache.version:
            for i in range(len(self.layers)):
                kernels.check_attention(cos, sin, cache.prompt_keys[i], cache.prompt_values[i],
                                        cache.prompt_length_tensor, cache.row_keys[i], cache.row_values[i], self.heads)
            self._checked = cache.version
        if kernels is not None:
            self.kernel_steps += 1
        else:
            cache.zero_unread()  # stores made for the kernel (autocast came on since) are read under a mask here
            rows = cache.step_rows(token.shape[0])
            cos, sin = cos[position][:, None], sin[position][:, None]  # [b, 1, D]
            masks = self._masks(cache, rows)
        for i, layer in enumerate(self.layers):
            x = rms_norm(layer.input_layernorm, hidden, kernels)
            if kernels is not None:
                # 16-bit models: q / k / v upcast, attention in float32 (as the PyTorch path), output back
                out = kernels.decode_attention(
                    self._qkv(i, layer.self_attn, x).float().contiguous(), cos, sin, position, cache.prompt_keys[i],
                    cache.prompt_values[i], cache.prompt_length_tensor, cache.row_keys[i], cache.row_values[i],
                    cache.prompt_tensor, cache.length_tensor, self.heads, self.scaling, checked=True)
            else:
                out = self._attention(i, layer.self_attn, x, cos, sin, cache, rows, masks)
            hidden = self.o_proj[i](out.to(hidden.dtype), add=hidden)
            x = rms_norm(layer.post_attention_layernorm, hidden, kernels)
            hidden = self.mlp[i](x, residual=hidden) if self.mlp[i] is not None else hidden + layer.mlp(x)
        hidden = rms_norm(self.inner.norm, hidden, kernels)
        return self.lm_head(hidden, out=self._logits_buffer(hidden))

    def _logits_buffer(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`[b, V]` room for this step's logits, reused step to step (the caller has sampled from the last ones)."""
        weight = self.lm_head.weight
        if weight is None or hidden.device.type != "cpu":
            return None
        rows = hidden.shape[0]
        if self._logits is None or self._logits.shape[0] < rows or self._logits.dtype != hidden.dtype:
            self._logits = hidden.new_empty((rows, weight.shape[0]))
        return self._logits[:rows]

    def _attention(self, i: int, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache, rows: StepRows, masks: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The PyTorch path of one layer's attention: `[b, hidden]` normed input -> `[b, heads * D]`; the new key
        and value written into the cache."""
        b, heads, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.qkv[i] is not None:
            q, k, v = self._qkv(i, attn, x).split([heads * d, kv * d, kv * d], dim=-1)
        else:
            q, k = head_norms(attn, attn.q_proj(x).view(b, heads, d), attn.k_proj(x).view(b, kv, d))
            q, k, v = q.reshape(b, -1), k.reshape(b, -1), attn.v_proj(x)
        qk = apply_rotary(torch.cat([q, k], dim=-1).view(b, heads + kv, d), cos, sin)  # [b, heads + kv, D]
        cache.row_keys[i][rows.index, :, rows.length] = qk[:, heads:].to(cache.dtype)
        cache.row_values[i][rows.index, :, rows.length] = v.view(b, kv, d).to(cache.dtype)
        out = self._attend(i, qk[:, :heads].reshape(b, kv, self.group, d), cache, rows, masks)
        return out.reshape(b, heads * d)

    def _qkv(self, i: int, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`[b, (heads + 2 kv) * D]` queries, keys and values of `[b, hidden]` normed inputs, in one matmul; Qwen3's
        head norms applied to the queries and keys."""
        qkv = self.qkv[i](x)
        if not self.head_norms:
            return qkv
        b, heads, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        q, k, v = qkv.split([heads * d, kv * d, kv * d], dim=-1)
        q, k = head_norms(attn, q.view(b, heads, d), k.view(b, kv, d))
        return torch.cat([q.reshape(b, -1), k.reshape(b, -1), v], dim=-1)

    def _masks(self, cache: KVCache, rows: StepRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive `[U, 1, 1, p]` prompt and `[b, 1, 1, n]` response masks over the columns this step reads
        (`rows`' spans): 0 where a row's prompt or response (with its new token) has a key, a very negative number
        elsewhere. Built from the device's lengths: no host synchronisation."""
        p, n = rows.prompt_columns, rows.response_columns
        closed = torch.finfo(cache.dtype).min
        columns = torch.arange(p, device=cache.device)
        prompt = columns[None] < (p - rows.prompt_length)[:, None]  # [U, p] True: before the prompt
        response = torch.arange(n, device=cache.device)[None] > rows.length[:, None]  # [b, n] not written yet
        zeros = torch.zeros((), dtype=cache.dtype, device=cache.device)
        return (torch.where(prompt, closed, zeros)[:, None, None], torch.where(response, closed, zeros)[:, None, None])

    def _attend(self, i: int, q: torch.Tensor, cache: KVCache, rows: StepRows,
                masks: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`[b, K, g, D]` queries -> `[b, K, g, D]` attention over each row's prompt and its response so far."""
        prompt_mask, response_mask = masks
        p, n = prompt_mask.shape[-1], response_mask.shape[-1]
        u, pc = prompt_mask.shape[0], cache.capacity[1]
        q = q.to(cache.dtype) * self.scaling
        prompt_keys = cache.prompt_keys[i][:u, :, pc - p:]  # [U, K, p, D]
        prompt_values = cache.prompt_values[i][:u, :, pc - p:]
        b = q.shape[0]
        if cache.fixed:  # each row's prompt gathered (the slots' layout changes with the rows; a graph's may not)
            prompt_keys, prompt_values = prompt_keys[rows.prompt], prompt_values[rows.prompt]  # [b, K, p, D]
            scores_prompt = torch.matmul(q, prompt_keys.transpose(2, 3)) + prompt_mask[rows.prompt]
        else:
            scores_prompt = self._from_slots(torch.matmul(self._to_slots(q, cache), prompt_keys.transpose(2, 3))
                                             + prompt_mask, cache)  # [b, K, g, p]
        response_keys = cache.row_keys[i][:b, :, :n]  # [b, K, n, D]
        scores_response = torch.matmul(q, response_keys.transpose(2, 3)) + response_mask  # [b, K, g, n]
        scores = torch.cat([scores_prompt, scores_response], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1).to(cache.dtype)
        if cache.fixed:
            out = torch.matmul(probs[..., :p], prompt_values)
        else:
            out = self._from_slots(torch.matmul(self._to_slots(probs[..., :p], cache), prompt_values), cache)
        return out + torch.matmul(probs[..., p:], cache.row_values[i][:b, :, :n])

    def _to_slots(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """`[b, K, g, X]` per row -> `[U, K, S * g, X]` per prompt (empty slots are zero)."""
        s, identity, slot = cache.slots()
        if not identity:
            x = x.new_zeros((len(cache.prompt_length) * s, *x.shape[1:])).index_copy_(0, slot, x)
        _, k, g, last = x.shape
        return x.view(-1, s, k, g, last).transpose(1, 2).reshape(-1, k, s * g, last)

    def _from_slots(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """`[U, K, S * g, X]` per prompt -> `[b, K, g, X]` per row."""
        u, k, _, last = x.shape
        s, identity, slot = cache.slots()
        x = x.view(u, k, s, self.group, last).transpose(1, 2).reshape(u * s, k, self.group, last)
        return x if identity else x.index_select(0, slot)
