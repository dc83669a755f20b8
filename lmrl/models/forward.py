"""The training forward: log-probs (and entropies) of a batch's response tokens under a model.

Every forward the trainer makes through the policy or the reference model comes here
(`model_forward_logprobs`); the math on the logits is `lmrl.algorithms.logprobs`.

Shapes: B sequences, S = prompt + response positions (left-padded), T response tokens, V vocabulary.

Two conventions hold everywhere in lmrl:

- Masks come from the generator (`attention_mask`, response mask), never from `pad_token_id`:
  many tokenizers have pad == eos, so "token != pad" would drop the real EOS of a completion.
- Batches are left-padded (prompts end at the same column, so the response is the last T columns),
  and position ids are `cumsum(attention_mask) - 1`: the first real token has position 0 whatever
  the padding, exactly as Hugging Face generation computes them. Training forwards use the same
  positions, so their log-probs match those seen while sampling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lmrl.algorithms.logprobs import token_entropy, token_logprobs
from lmrl.models.shared_prompt import lora_base, packed_states
from lmrl.models.vision import mrope_positions


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
    media: Mapping[str, torch.Tensor] | None = None,
    pack: bool = False,
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
        media: a vision-language model's processor outputs for the B rows, batched in row order
            (`lmrl.models.vision.row_media`): passed to the forward as they are; no prompt sharing then.
        pack: run the real tokens only (`lmrl.models.shared_prompt.packed_states` where the model allows, else
            the batch without its all-padding columns): the same outputs at every real position, 0 after a
            row's last real token.

    Returns:
        [B, T] float32 log-probs, differentiable when grad is enabled; with `return_entropy`, the
        pair (log-probs, entropies), both [B, T].
    """
    out = response_forward(model, sequences, attention_mask, num_response_tokens, temperature, chunk_size,
                           entropy=return_entropy, share_prompt=share_prompt, media=media, pack=pack)
    return (out.logprobs, out.entropy) if return_entropy else out.logprobs


def sequence_logprobs(model: nn.Module, prompt: list[int], response: list[int],
                      chunk_size: int | None = 128) -> torch.Tensor:
    """[T] float32 log-probs of the `response` tokens after `prompt` under `model` at temperature 1, on the CPU: one
    row, no padding (what the sync probe compares between the trainer and a sampler)."""
    device = next(model.parameters()).device
    ids = torch.tensor([[*prompt, *response]], device=device)
    return model_forward_logprobs(model, ids, torch.ones_like(ids), len(response), chunk_size=chunk_size)[0].cpu()


@dataclass
class ResponseForward:
    """What `response_forward` computes at the T response positions of B rows.

    Attributes:
        logprobs: [B, T] float32 log-probs of the response tokens.
        entropy: [B, T] entropies of softmax(logits / temperature), when asked for.
        hidden: [B, T, H] the last layer's output after the final norm (the LM head's input) at the positions
            that score the response tokens, when asked for; PPO's value head on the policy reads it
            (`model.shared_critic`).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


def response_forward(
    model: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    num_response_tokens: int,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    entropy: bool = False,
    hidden: bool = False,
    share_prompt: bool = False,
    media: Mapping[str, torch.Tensor] | None = None,
    pack: bool = False,
) -> ResponseForward:
    """`model_forward_logprobs` as a record, optionally with the final hidden states it scored from (`hidden`)."""
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
    width = t
    if pack and not media:  # the columns where no row has a real token do not run (exact: causal, and masked)
        sequences, attention_mask, t = trimmed(sequences, attention_mask, t)
    positions = position_ids_from_mask(attention_mask)
    if media:  # a Qwen2-VL-style model rotates with 3-D positions, never these 2-D ones copied to 3 axes
        rope = mrope_positions(model, sequences, attention_mask, media)
        positions = rope if rope is not None else positions
    share_prompt = share_prompt and not media  # the prompt's image features come from the model's own forward
    states = packed_states(model, sequences, attention_mask, positions, t, pack=pack) if share_prompt else None
    rows = sequences.shape[0]
    if states is not None:  # the LM head and the log-softmax only where a response token is scored
        logits = lora_base(model).lm_head(states.hidden)  # [n, V]
        tokens = sequences[states.rows, sequences.shape[1] - t + states.cols]
        # (straight into the caller's `width` columns: the positions after `trimmed`'s are 0 either way)
        logprobs = states.scatter(token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size), rows,
                                  width)
        ent = states.scatter(token_entropy(logits, chunk_size=chunk_size, temperature=temperature), rows,
                             width) if entropy else None
        return ResponseForward(logprobs, ent, states.padded(rows, width) if hidden else None)
    with _decoder_output(model) if hidden else contextlib.nullcontext() as captured:
        out = model(
            input_ids=sequences,
            attention_mask=attention_mask,
            position_ids=positions,
            logits_to_keep=t + 1,
            use_cache=False,
            **(media or {}),
        )
    # Models that ignore logits_to_keep return all S positions: keep the last T + 1 either way.
    logits = out.logits[:, -(t + 1) : -1]  # [B, T, V]
    states = captured[0][:, -(t + 1) : -1] if hidden else None
    tokens = sequences[:, -t:]  # [B, T]
    logprobs = token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size)
    ent = token_entropy(logits, chunk_size=chunk_size, temperature=temperature) if entropy else None
    return widened(ResponseForward(logprobs, ent, states), width)


def trimmed(sequences: torch.Tensor, attention_mask: torch.Tensor,
            num_response_tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(sequences, attention_mask, T')` without the leading columns that are padding in every row and the
    trailing response columns that are padding in every row (at least one response column stays): a forward of
    these gives the same outputs at every real position, since padding is never attended to and positions count
    real tokens only."""
    real = attention_mask.bool()
    p = sequences.shape[1] - num_response_tokens
    lead = min(int(real[:, :p].any(0).long().argmax()), p - 1)
    in_use = real[:, p:].any(0).nonzero()
    t = max(int(in_use[-1]) + 1 if len(in_use) else 1, 1)
    return sequences[:, lead : p + t], attention_mask[:, lead : p + t], t


def widened(out: ResponseForward, width: int) -> ResponseForward:
    """`out` with its response axis padded with zeros to `width` columns (after `trimmed`)."""
    return ResponseForward(*(padded_to(x, width) for x in (out.logprobs, out.entropy, out.hidden)))


def padded_to(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """`[B, t, ...]` padded with zeros to `[B, width, ...]`."""
    if x is None or x.shape[1] == width:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1], *x.shape[2:])], dim=1)


def response_hidden(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, num_response_tokens: int,
                    share_prompt: bool = False, pack: bool = False) -> torch.Tensor:
    """`[B, T, H]` final hidden states at the positions that score the T response tokens, without the LM head:
    the decoder stack of a causal LM (looked through a peft LoRA wrapper) run alone, or each distinct prompt once
    (`share_prompt`); with `pack`, the real tokens only (0 after a row's last real token)."""
    width = num_response_tokens
    if pack:
        sequences, attention_mask, num_response_tokens = trimmed(sequences, attention_mask, num_response_tokens)
    t = num_response_tokens
    positions = position_ids_from_mask(attention_mask)
    states = packed_states(model, sequences, attention_mask, positions, t, pack=pack) if share_prompt else None
    if states is not None:
        return states.padded(len(sequences), width)
    with _decoder_output(model) as captured:  # the whole model runs (FSDP gathers at its root), the head on 1 position
        model(input_ids=sequences, attention_mask=attention_mask, position_ids=positions, logits_to_keep=1, use_cache=False)
    return padded_to(captured[0][:, -(t + 1) : -1], width)


@contextlib.contextmanager
def _decoder_output(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While inside, a forward of `model` puts its decoder stack's `last_hidden_state` ([B, S, H], after the
    final norm: the LM head's input) in the yielded list. A hook rather than `output_hidden_states`, which
    would keep every layer's [B, S, H] output."""
    base = lora_base(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.base_model
    captured: list[torch.Tensor] = []
    handle = decoder.register_forward_hook(lambda module, args, out: captured.append(out.last_hidden_state))
    try:
        yield captured
    finally:
        handle.remove()


class Forwards:
    """The run's forwards through its models, with the run's settings: the policy's (with or without gradient;
    with the hidden states a value head on the policy's backbone reads), the reference's and the critic's, each
    under bf16 autocast when the run asks for it. `counts` says how many of each kind ran.

    Args:
        policy: the policy being trained.
        reference: the frozen reference copy, or None: a LoRA run's reference is the policy with its adapters
            disabled (`reference_is_base`), a run without a KL term has none.
        critic: a `lmrl.models.critic` value model, or a value head on the policy (`shared_critic`), or None.
        temperature: the sampling temperature; logits are divided by it before every log-softmax.
        chunk_size: `token_logprobs`' chunk (None: the whole response at once).
        share_prompt: run each distinct prompt of a batch once (`lmrl.models.shared_prompt`).
        autocast_bf16: forwards under bf16 autocast.
        shared_critic: the critic is a head on the policy's own hidden states.
        teacher: on-policy distillation's frozen teacher (`lmrl.models.teacher`), or None.
        pack: every forward runs its rows' real tokens only (`train.packing`, `response_forward`'s `pack`).
    """

    def __init__(self, policy: nn.Module, reference: nn.Module | None, critic: nn.Module | None, *, temperature: float,
                 chunk_size: int | None, share_prompt: bool, autocast_bf16: bool, shared_critic: bool,
                 teacher: nn.Module | None = None, pack: bool = False):
        self.policy_model, self.reference_model, self.critic_model = policy, reference, critic
        self.teacher_model = teacher
        self.temperature, self.chunk_size, self.share_prompt, self.pack = temperature, chunk_size, share_prompt, pack
        self.autocast_bf16 = autocast_bf16
        self.shared_critic = critic is not None and shared_critic
        self.counts = {"policy": 0, "reference": 0, "critic": 0} | ({"teacher": 0} if teacher is not None else {})

    def policy(self, seqs: torch.Tensor, attn: torch.Tensor, T: int, grad: bool = False,
               hidden: bool = False, media: Mapping[str, torch.Tensor] | None = None) -> ResponseForward:
        """Log-probs and entropies of the `[b, T]` response tokens; with `hidden`, the hidden states too. `media`:
        the rows' images, for a vision-language policy (`lmrl.models.vision.row_media`)."""
        self.counts["policy"] += 1
        with torch.set_grad_enabled(grad), self.autocast():
            return response_forward(self.policy_model, seqs, attn, T, self.temperature, chunk_size=self.chunk_size,
                                    entropy=True, hidden=hidden, share_prompt=self.share_prompt, media=media,
                                    pack=self.pack)

    def policy_logprobs(self, seqs: torch.Tensor, attn: torch.Tensor, T: int,
                        media: Mapping[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(log-probs, entropies)`, `[b, T]` each, no gradient: the old log-probs `make_experience` asks for."""
        out = self.policy(seqs, attn, T, media=media)
        return out.logprobs, out.entropy

    def reference(self, seqs: torch.Tensor, attn: torch.Tensor, T: int,
                  media: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """`[b, T]` log-probs of the response tokens under the reference model, no gradient."""
        self.counts["reference"] += 1
        with torch.no_grad(), self.autocast(), self._reference() as reference:
            return model_forward_logprobs(reference, seqs, attn, T, self.temperature, chunk_size=self.chunk_size,
                                          share_prompt=self.share_prompt, media=media, pack=self.pack)

    def teacher(self, seqs: torch.Tensor, attn: torch.Tensor, T: int) -> torch.Tensor:
        """`[b, T]` log-probs of the response tokens under the teacher, no gradient: the reference's forward (the
        same temperature, chunks and shared prompts), through another model."""
        self.counts["teacher"] += 1
        with torch.no_grad(), self.autocast():
            return model_forward_logprobs(self.teacher_model, seqs, attn, T, self.temperature, chunk_size=self.chunk_size,
                                          share_prompt=self.share_prompt, pack=self.pack)

    @contextlib.contextmanager
    def _reference(self) -> Iterator[nn.Module]:
        """The reference model: the frozen copy, or for a LoRA run the policy itself with its adapters disabled
        (its base weights, which LoRA never changes) in eval mode, as the copy is."""
        if self.reference_model is not None:
            yield self.reference_model
            return
        policy = self.policy_model
        training = policy.training
        policy.eval()
        try:
            with policy.disable_adapter():
                yield policy
        finally:
            policy.train(training)

    def critic(self, seqs: torch.Tensor, attn: torch.Tensor, T: int, grad: bool = False) -> torch.Tensor:
        """`[b, T]` values of the response positions."""
        self.counts["critic"] += 1
        with torch.set_grad_enabled(grad), self.autocast():
            if self.shared_critic:  # the value head reads the policy's own hidden states
                return self.critic_model.response_values(self.policy_model, seqs, attn, T, share_prompt=self.share_prompt,
                                                         pack=self.pack)
            return self.critic_model.response_values(seqs, attn, T, share_prompt=self.share_prompt, pack=self.pack)

    def update_values(self, seqs: torch.Tensor, attn: torch.Tensor, T: int, policy_out: ResponseForward) -> torch.Tensor:
        """`[b, T]` values with their gradient, for the update: a value head on the policy's backbone reads the
        hidden states of the policy's forward (`policy_out`); a separate critic runs its own forward."""
        if self.shared_critic:
            return self.critic_model(policy_out.hidden)
        return self.critic(seqs, attn, T, grad=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=next(self.policy_model.parameters()).device.type, dtype=torch.bfloat16)
