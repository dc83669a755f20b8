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
full attention, no attention dropout in training and no gradient checkpointing; the modules called
here (norms, projections, MLP, embeddings, LM head) may be LoRA-wrapped (a peft LoRA model is
looked through) or hooked. Attention is torch's sdpa, or explicit matmuls with a float32 softmax for
a model loaded with attn_implementation="eager" (as transformers' eager attention; on CPU under
bfloat16 autocast it trains faster than sdpa, whose backward is slow there). Shapes: B rows,
S = P prompt + T response columns (left-padded prompts), U distinct prompts, H hidden size,
V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
    return not (model.training and dropout) and not _checkpointing(model)


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
    computed with each distinct prompt once; `position_ids` `[B, S]` as the model's forward takes them. A peft LoRA wrapper is looked through (its forward is the
    base model's, with the LoRA layers in place). None when `supports` is False or no two rows share a
    prompt (nothing to save): call the model instead."""
    hidden = shared_prompt_hidden(model, sequences, attention_mask, position_ids, num_response_tokens)
    return None if hidden is None else lora_base(model).lm_head(hidden)


def shared_prompt_hidden(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor, num_response_tokens: int, last: bool = False) -> torch.Tensor | None:
    """`[B, T, H]` final hidden states (after the last norm, as `last_hidden_state`) at columns S-T-1 .. S-2,
    the positions just before each response token, computed with each distinct prompt once; with `last`,
    `[B, T + 1, H]` at columns S-T-1 .. S-1 (a reward model pools the last real token's). `model` is a
    causal LM or its decoder stack (`decoder_stack`). None when `supports` is False or no two rows share a
    prompt."""
    num_rows, seq_len = sequences.shape
    p = seq_len - num_response_tokens
    # the last response token scores nothing and no other position attends to it: it is left out, and
    # the response part runs on the t = T - 1 columns before it (unless `last` asks for its hidden state)
    t = num_response_tokens - (0 if last else 1)
    model = lora_base(model)
    if t < 1 or not supports(model):
        return None
    # distinct prompts: the same real tokens at the same columns (padding zeroed out)
    prompt_mask = attention_mask[:, :p].long()
    key = torch.cat([sequences[:, :p] * prompt_mask, prompt_mask], dim=1)
    distinct, row_prompt = torch.unique(key, dim=0, return_inverse=True)  # [U, 2P], [B]
    num_prompts = distinct.shape[0]
    if num_prompts == num_rows:
        return None
    first = torch.full((num_prompts,), num_rows, device=sequences.device).scatter_reduce(
        0, row_prompt, torch.arange(num_rows, device=sequences.device), "amin")  # a row of each prompt
    prompt_ids, prompt_pos, prompt_mask = sequences[first, :p], position_ids[first, :p], prompt_mask[first].bool()

    inner, config = decoder_stack(model), model.config.get_text_config(decoder=True)
    attn = inner.layers[0].self_attn
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
    # [U, P] prompt tokens then [B, t] response tokens as one flat batch of U*P + B*t positions
    response_ids, response_pos = sequences[:, p : p + t], position_ids[:, p : p + t]
    hidden = torch.cat([inner.embed_tokens(prompt_ids).flatten(0, 1), inner.embed_tokens(response_ids).flatten(0, 1)])
    cos, sin = inner.rotary_emb(hidden, torch.cat([prompt_pos.flatten(), response_pos.flatten()])[None])
    cos, sin = cos[0, :, None], sin[0, :, None]  # [U*P + B*t, 1, D]
    # masks (True attends): prompts causally over their real tokens (a padding query sees itself, so no
    # row is empty); responses over their prompt's real tokens, then causally over their own real tokens
    eye = torch.eye(p, dtype=torch.bool, device=sequences.device)
    causal = torch.ones(p, p, dtype=torch.bool, device=sequences.device).tril()
    prompt_attends = ((causal & prompt_mask[:, None, :]) | eye)[:, None]  # [U, 1, P, P]
    response_mask = attention_mask[:, p : p + t].bool()
    own = torch.ones(t, t, dtype=torch.bool, device=sequences.device).tril() & response_mask[:, None, :]
    response_attends = torch.cat([prompt_mask[row_prompt][:, None, :].expand(num_rows, t, p), own], dim=2)[:, None]
    split = num_prompts * p
    # the model's own choice: eager is faster than sdpa under bfloat16 autocast on CPU (sdpa's backward)
    attend = _eager_attention if config._attn_implementation == "eager" else F.scaled_dot_product_attention

    for layer in inner.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(-1, heads, head_dim)
        k = attn.k_proj(x).view(-1, kv_heads, head_dim)
        v = attn.v_proj(x).view(-1, kv_heads, head_dim)
        q, k = head_norms(attn, q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if heads != kv_heads:
            k, v = (y.repeat_interleave(heads // kv_heads, dim=1) for y in (k, v))
        # [rows, heads, length, D] per prompt and per response
        qp, kp, vp = (y[:split].view(num_prompts, p, heads, head_dim).transpose(1, 2) for y in (q, k, v))
        qr, kr, vr = (y[split:].view(num_rows, t, heads, head_dim).transpose(1, 2) for y in (q, k, v))
        out_prompt = attend(qp, kp, vp, attn_mask=prompt_attends, scale=attn.scaling)
        keys = torch.cat([kp.index_select(0, row_prompt), kr], dim=2)  # [B, heads, P + T, D]
        values = torch.cat([vp.index_select(0, row_prompt), vr], dim=2)
        out_response = attend(qr, keys, values, attn_mask=response_attends, scale=attn.scaling)
        out = torch.cat([out_prompt.transpose(1, 2).flatten(0, 1), out_response.transpose(1, 2).flatten(0, 1)])
        hidden = hidden + attn.o_proj(out.flatten(1).to(x.dtype))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    prompt_hidden = hidden[:split].view(num_prompts, p, -1)
    response_hidden = hidden[split:].view(num_rows, t, -1)
    # column S-T-1 (the prompt's last, always a real token) scores response token 0; column S-T-1+j token j
    scoring = torch.cat([prompt_hidden[row_prompt, -1:], response_hidden], dim=1)  # [B, T, H] ([B, T + 1, H]: last)
    return inner.norm(scoring)


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
    """Gradient (activation) checkpointing is on: transformers' layers must run to recompute."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def hooked(module: nn.Module) -> bool:
    """A forward (pre-)hook is registered on `module`: it must be called, not bypassed or fused."""
    return bool(module._forward_hooks or module._forward_pre_hooks)
