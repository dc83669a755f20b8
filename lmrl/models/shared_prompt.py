"""The training forward with each distinct prompt computed once.

A GRPO-style batch holds G completions of every prompt, and a plain forward runs each prompt token G
times. Here the rows' prompts are deduplicated: the prompt positions of each distinct prompt go
through every layer once, and each completion attends to its prompt's keys and values (indexed per
row, so the gradients of all G completions add up in the prompt's activations) and causally to its
own tokens. It computes the same function as transformers' forward: log-probs and gradients agree to
float rounding (tests), with the prompt's share of the projection and MLP work divided by G.
`python benchmarks/shared_prompt.py` measures it.

`shared_prompt_hidden` gives the final hidden states at those positions, for a model without an LM head
(PPO's critic, a value head on a Llama / Qwen2 / Qwen3 backbone) as for one with.

Only for the Llama / Qwen2 / Qwen3 classes whose decoder layers this module reproduces (`bypassable`), with
full attention and no attention dropout in training (under gradient checkpointing each layer runs again in the
backward, as transformers' do); the modules called
here (norms, projections, MLP, embeddings, LM head) may be LoRA-wrapped (a peft LoRA model is
looked through) or hooked. Attention is torch's sdpa, or explicit matmuls with a float32 softmax for
a model loaded with attn_implementation="eager" (as transformers' eager attention; on CPU under
bfloat16 autocast it trains faster than sdpa, whose backward is slow there). Shapes: B rows,
S = P prompt + T response columns (left-padded prompts), U distinct prompts, H hidden size,
V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

MODELS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
BACKBONES = ("LlamaModel", "Qwen2Model", "Qwen3Model")  # the same decoder stacks without an LM head (a critic's backbone)
LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
STATIC_ROPE = ("default", "linear", "llama3")  # inverse frequencies that do not depend on the length seen


def decoder_stack(model: nn.Module) -> nn.Module | None:
    """The decoder stack (embeddings, layers, final norm, rotary embedding) of a Llama / Qwen2 / Qwen3 causal LM, or
    the model itself when it is such a stack without an LM head; None for any other class."""
    name = type(model).__name__
    if name in MODELS:
        return getattr(model, "model", None)
    return model if name in BACKBONES else None


def bypassable(model: nn.Module) -> bool:
    """True if `model` is a Llama / Qwen2 / Qwen3 causal LM (or its decoder stack alone) whose model, layer and
    attention `forward` may be replaced by module-by-module code: the exact classes, a position-independent
    rotary embedding, no device map, and no hooks on the bypassed modules (hooks on the leaf modules still
    run)."""
    inner = decoder_stack(model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        return False
    bypassed = [inner, *inner.layers, *(layer.self_attn for layer in inner.layers)]
    return (
        getattr(rotary, "rope_type", None) in STATIC_ROPE
        and not getattr(model, "hf_device_map", None)
        and all(type(layer).__name__ in LAYERS for layer in inner.layers)
        and not any(hooked(m) or hasattr(m, "_hf_hook") for m in bypassed)
    )


def full_attention(model: nn.Module) -> bool:
    """Every layer attends to the whole past (no sliding-window layers)."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # older configs: a sliding_window attribute means sliding layers
        sliding = getattr(config, "sliding_window", None) is not None
        layer_types = ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers
    return all(t == "full_attention" for t in layer_types)


def supports(model: nn.Module) -> bool:
    """True if `shared_prompt_logits` computes `model`'s forward exactly."""
    if not (bypassable(model) and full_attention(model)):
        return False
    dropout = getattr(model.config, "attention_dropout", 0.0)
    return not (model.training and dropout)


def head_norms(attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's RMSNorm of each query and key head (`q_norm`, `k_norm`, over the head size) before rotary; `[..., heads,
    D]` queries and keys as they are for Llama / Qwen2, which have none."""
    if getattr(attn, "q_norm", None) is None:
        return q, k
    return attn.q_norm(q), attn.k_norm(k)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al., 2021) in Hugging Face's half-split layout."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def shared_prompt_logits(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor, num_response_tokens: int) -> torch.Tensor | None:
    """`[B, T, V]` logits at the positions that score the T response tokens (columns S-T-1 .. S-2),
    computed with each distinct prompt once; `position_ids` `[B, S]` as the model's forward takes them. A peft LoRA
    wrapper is looked through (its forward is the base model's, with the LoRA layers in place). None when `supports`
    is False or no two rows share a prompt (nothing to save): call the model instead."""
    hidden = shared_prompt_hidden(model, sequences, attention_mask, position_ids, num_response_tokens)
    return None if hidden is None else lora_base(model).lm_head(hidden)


def shared_prompt_hidden(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor, num_response_tokens: int, last: bool = False,
                         pack: bool = False) -> torch.Tensor | None:
    """`[B, T, H]` final hidden states (after the last norm, as `last_hidden_state`) at columns S-T-1 .. S-2,
    the positions just before each response token, computed with each distinct prompt once; with `last`,
    `[B, T + 1, H]` at columns S-T-1 .. S-1 (a reward model pools the last real token's). `model` is a
    causal LM or its decoder stack (`decoder_stack`). With `pack`, only the real tokens run (`packed_states`) and
    the positions after a row's last real token are 0. None when `supports` is False, or, without `pack`, no two
    rows share a prompt."""
    states = packed_states(model, sequences, attention_mask, position_ids, num_response_tokens, last=last, pack=pack)
    return None if states is None else states.padded(len(sequences), num_response_tokens + last)


@dataclass
class PackedStates:
    """Final hidden states at the positions that score response tokens, only where computed.

    Attributes:
        hidden: `[n, H]` after the final norm.
        rows, cols: `[n]` each: the row, and the response token it scores (0 .. T - 1; 0 .. T with `last`).
    """

    hidden: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor

    def padded(self, num_rows: int, num_cols: int) -> torch.Tensor:
        """`[num_rows, num_cols, H]`, zero where nothing was computed (differentiable)."""
        out = self.hidden.new_zeros(num_rows, num_cols, self.hidden.shape[-1])
        return out.index_put((self.rows, self.cols), self.hidden)

    def scatter(self, values: torch.Tensor, num_rows: int, num_cols: int) -> torch.Tensor:
        """`[n]` values of these positions as `[num_rows, num_cols]`, zero elsewhere (differentiable)."""
        return values.new_zeros(num_rows, num_cols).index_put((self.rows, self.cols), values)


def packed_states(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  position_ids: torch.Tensor, num_response_tokens: int, last: bool = False,
                  pack: bool = True) -> PackedStates | None:
    """The states that score the response tokens of B rows, each distinct prompt computed once, as a flat batch of
    tokens. With `pack`, the tokens are the real ones only: each prompt from its first real token, each response
    up to its last real token (the one after scores nothing and is left out too, unless `last`); nothing is
    padded in the projections, the MLP, the norms or the LM head the caller runs on the result, and attention runs
    per prompt and per completion, re-padded to the longest of this batch. Without `pack`, every column runs, as a
    padded forward would (the cost `train.packing=false` keeps, for comparison). Holes inside a row (an attention
    mask of 0 between real tokens) are masked as keys, as the model's forward masks them.

    Returns None when `supports` is False, a prompt's last column is padding (left padding assumed), or, without
    `pack`, no two rows share a prompt (nothing to save: call the model)."""
    model = lora_base(model)
    if not supports(model):
        return None
    at = _layout(sequences, attention_mask, num_response_tokens, last, pack)
    if at is None:
        return None
    inner, config = decoder_stack(model), model.config.get_text_config(decoder=True)
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, inner.layers[0].self_attn.head_dim
    group = heads // kv_heads
    hidden = inner.embed_tokens(sequences[at.rows, at.cols])  # [N, H]
    cos, sin = inner.rotary_emb(hidden, position_ids[at.rows, at.cols][None])
    cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, D]
    # the model's own choice: eager is faster than sdpa under bfloat16 autocast on CPU (sdpa's backward)
    attend = _eager_attention if config._attn_implementation == "eager" else F.scaled_dot_product_attention

    def padded(x: torch.Tensor, index: torch.Tensor, count: int, width: int) -> torch.Tensor:
        """`[n, h, D]` flat tokens -> `[count, h, width, D]` in their slots, zeros elsewhere."""
        out = x.new_zeros(count * width, x.shape[1], head_dim).index_copy(0, index, x)
        return out.view(count, width, x.shape[1], head_dim).transpose(1, 2)

    def attention(q, k, v, mask, scale):
        """Grouped-query attention without repeating the key / value heads: the query heads that share a key
        head are stacked along the query axis. q `[b, heads, n, D]`, k / v `[b, kv_heads, m, D]`, mask `[b, n, m]`;
        the output `[b * n, heads * D]`, flat."""
        b, n = q.shape[0], q.shape[2]
        q = q.reshape(b, kv_heads, group * n, head_dim)
        mask = mask[:, None].repeat(1, 1, group, 1)  # [b, 1, group * n, m]
        out = attend(q, k, v, attn_mask=mask, scale=scale).reshape(b, heads, n, head_dim)
        return out.transpose(1, 2).flatten(0, 1)

    split, U, B = at.split, at.num_prompts, len(sequences)

    def block(hidden: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(-1, heads, head_dim)
        k = attn.k_proj(x).view(-1, kv_heads, head_dim)
        v = attn.v_proj(x).view(-1, kv_heads, head_dim)
        q, k = head_norms(attn, q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # [rows, heads, length, D] per prompt and per response
        qp, kp, vp = (padded(y[:split], at.prompt_index, U, at.prompt_width) for y in (q, k, v))
        out = [attention(qp, kp, vp, at.prompt_attends, attn.scaling).index_select(0, at.prompt_index)]
        if at.response_width:
            qr, kr, vr = (padded(y[split:], at.response_index, B, at.response_width) for y in (q, k, v))
            keys = torch.cat([kp.index_select(0, at.row_prompt), kr], dim=2)  # [B, kv_heads, L + C, D]
            values = torch.cat([vp.index_select(0, at.row_prompt), vr], dim=2)
            out.append(attention(qr, keys, values, at.response_attends, attn.scaling).index_select(0, at.response_index))
        hidden = hidden + attn.o_proj(torch.cat(out).flatten(1).to(x.dtype))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    # model.gradient_checkpointing: each layer keeps only its input and runs again in the backward, as transformers'
    recompute = model.training and torch.is_grad_enabled() and _checkpointing(model)
    for layer in inner.layers:
        hidden = checkpoint(block, hidden, layer, use_reentrant=False) if recompute else block(hidden, layer)
    return PackedStates(inner.norm(hidden.index_select(0, at.scoring)), at.out_rows, at.out_cols)


@dataclass
class _Layout:
    """Where each token of `packed_states`' flat batch comes from, and how attention reads it: U distinct prompts of
    at most L tokens in `[U, L]` slots, B rows of at most C response tokens in `[B, C]` slots."""

    rows: torch.Tensor  # [N] the row and column of `sequences` of each flat token: prompts' first, then responses'
    cols: torch.Tensor
    split: int  # the prompts' share of N
    num_prompts: int
    row_prompt: torch.Tensor  # [B] each row's prompt
    prompt_width: int  # L
    response_width: int  # C
    prompt_index: torch.Tensor  # [prompt tokens] each one's slot in [U * L]
    response_index: torch.Tensor  # [response tokens] each one's slot in [B * C]
    prompt_attends: torch.Tensor  # [U, L, L] bool
    response_attends: torch.Tensor  # [B, C, L + C] bool
    scoring: torch.Tensor  # [n] the flat tokens whose states score a response token
    out_rows: torch.Tensor  # [n] which row and response token each scores
    out_cols: torch.Tensor


def _layout(sequences: torch.Tensor, attention_mask: torch.Tensor, T: int, last: bool, pack: bool) -> _Layout | None:
    """`packed_states`' layout of the flat batch (None where it steps aside)."""
    num_rows, seq_len = sequences.shape
    p = seq_len - T
    device, real = sequences.device, attention_mask.bool()
    if not bool(real[:, p - 1].all()):
        return None
    # distinct prompts: the same real tokens at the same columns (padding zeroed out)
    prompt_real = real[:, :p]
    key = torch.cat([sequences[:, :p] * prompt_real, prompt_real.long()], dim=1)
    distinct, row_prompt = torch.unique(key, dim=0, return_inverse=True)  # [U, 2P], [B]
    num_prompts = distinct.shape[0]
    if not pack and (num_prompts == num_rows or T - 1 + last < 1):
        return None
    first = torch.full((num_prompts,), num_rows, device=device).scatter_reduce(
        0, row_prompt, torch.arange(num_rows, device=device), "amin")  # a row of each prompt
    columns = torch.arange(max(p, T) + 1, device=device)
    # each prompt's span: from its first real column to p; each row's queries: response columns 0 .. count - 1
    if pack:
        start = torch.where(prompt_real[first], columns[:p], p).amin(1)  # [U]
        ends = torch.where(real[:, p:], columns[:T] + 1, 0).amax(1)  # [B] one past the last real response token
        count = (ends - 1 + last).clamp(min=0)
    else:
        start = torch.zeros(num_prompts, dtype=torch.long, device=device)
        count = torch.full((num_rows,), T - 1 + last, device=device)
    length = p - start  # [U]
    L, C = int(length.max()), int(count.max())
    prompt_slot = columns[:L] < length[:, None]  # [U, L] slots in use (left-aligned)
    response_slot = columns[:C] < count[:, None]  # [B, C]
    rows = torch.cat([first[:, None].expand(-1, L)[prompt_slot],
                      torch.arange(num_rows, device=device)[:, None].expand(-1, C)[response_slot]])
    cols = torch.cat([(start[:, None] + columns[:L])[prompt_slot], (p + columns[:C]).expand(num_rows, -1)[response_slot]])
    split = int(prompt_slot.sum())
    keys_real = real[rows, cols]
    prompt_keys = torch.zeros(num_prompts, L, dtype=torch.bool, device=device).index_put(
        prompt_slot.nonzero(as_tuple=True), keys_real[:split])  # [U, L]
    own_keys = torch.zeros(num_rows, C, dtype=torch.bool, device=device).index_put(
        response_slot.nonzero(as_tuple=True), keys_real[split:])  # [B, C]
    # masks (True attends): prompts causally over their real tokens (a padding query sees itself, so no
    # row is empty); responses over their prompt's real tokens, then causally over their own real tokens
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    prompt_attends = (causal & prompt_keys[:, None, :]) | torch.eye(L, dtype=torch.bool, device=device)
    own = torch.ones(C, C, dtype=torch.bool, device=device).tril() & own_keys[:, None, :]
    response_attends = torch.cat([prompt_keys[row_prompt][:, None, :].expand(-1, C, -1), own], dim=2)
    # the state that scores response token 0 is the prompt's last (always real); token j's is response token j - 1's
    response_first = split + torch.cumsum(count, 0) - count  # [B] flat index of each row's first response token
    score_slot = columns[:C + 1] < (count + 1)[:, None]  # [B, C + 1]: its prompt's last, then its response tokens
    flat = torch.where(score_slot, response_first[:, None] + columns[:C + 1] - 1, 0)
    flat[:, 0] = (torch.cumsum(length, 0) - 1)[row_prompt]
    return _Layout(rows, cols, split, num_prompts, row_prompt, L, C, prompt_slot.flatten().nonzero().squeeze(1),
                   response_slot.flatten().nonzero().squeeze(1), prompt_attends, response_attends, flat[score_slot],
                   torch.arange(num_rows, device=device)[:, None].expand(-1, C + 1)[score_slot],
                   columns[:C + 1].expand(num_rows, -1)[score_slot])


PAIR_MODELS = ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")


def shared_prefix_rewards(model: nn.Module, chosen: list[list[int]], rejected: list[list[int]]) -> torch.Tensor | None:
    """`[2b]` rewards of a reward model (one output, pooled at each row's last real token) for b chosen then b
    rejected sequences, with the tokens each pair shares at its start (the prompt, and any common start of the two
    answers) computed once: what the pair's two forwards of the plain batch compute twice. None when the model is
    not a Llama / Qwen2 / Qwen3 sequence classifier `supports` covers, or a pair shares no first token: call the model."""
    base = lora_base(model)
    backbone = getattr(base, "model", None)
    if type(base).__name__ not in PAIR_MODELS or backbone is None:
        return None
    shared = [min(_common(c, r), len(c) - 1, len(r) - 1) for c, r in zip(chosen, rejected)]  # each keeps a token
    if not shared or min(shared) < 1:
        return None
    rows = [(seq, n) for seqs in (chosen, rejected) for seq, n in zip(seqs, shared)]
    p, t = max(shared), max(len(seq) - n for seq, n in rows)
    device = next(model.parameters()).device
    sequences = torch.zeros(len(rows), p + t, dtype=torch.long)
    mask = torch.zeros(len(rows), p + t, dtype=torch.long)
    for i, (seq, n) in enumerate(rows):  # [2b, P + T]: the shared start left-padded to P, the rest right-padded
        sequences[i, p - n : p - n + len(seq)] = torch.tensor(seq)
        mask[i, p - n : p - n + len(seq)] = 1
    sequences, mask = sequences.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    hidden = shared_prompt_hidden(backbone, sequences, mask, positions, t, last=True)  # [2b, T + 1, H]
    if hidden is None:
        return None
    ends = torch.tensor([len(seq) - n for seq, n in rows], device=device)  # index T' of the row's last real token
    return base.score(hidden[torch.arange(len(rows), device=device), ends]).view(-1)


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common start of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v with the softmax in float32, as transformers' eager attention;
    `attn_mask` is boolean (True attends), broadcast over heads."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), value)


def lora_base(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft LoRA wrapper, else `model` (other peft methods change the
    forward: prompt tuning adds virtual tokens)."""
    config = getattr(model, "active_peft_config", None)
    return model.get_base_model() if getattr(config, "peft_type", None) == "LORA" else model


def _checkpointing(model: nn.Module) -> bool:
    """Gradient (activation) checkpointing is on (`model.gradient_checkpointing`): layers run again in the backward."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def hooked(module: nn.Module) -> bool:
    """A forward (pre-)hook is registered on `module`: it must be called, not bypassed or fused."""
    return bool(module._forward_hooks or module._forward_pre_hooks)
