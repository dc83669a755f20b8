"""Hugging Face generation backend: a decode loop with a KV cache, written for RL rollouts.

`HFGenerator` samples with the live `transformers` model the trainer updates in place, so every
rollout uses the current weights. It is faster than `model.generate` because it does only what
rollouts need:

1. prefill each distinct prompt once (`generate(num_return_sequences=n)` runs the prompt `n` times);
2. for Llama / Qwen2 models, decode steps with shared-prompt attention: each prompt's keys and
   values stored once, not once per completion, projections fused, C kernels on CPU
   (`lmrl.rollout.shared_prompt_decoder.SharedPromptDecoder`, which holds the switches
   `PACK_WEIGHTS`, `PACK_MIN_ELEMENTS` and `USE_KERNELS`);
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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from lmrl.models.shared_prompt import full_attention
from lmrl.models.vision import Media, batch_media, media_token_ids, mrope_positions
from lmrl.rollout.base import Rollout, SamplingParams
from lmrl.rollout.ops import cut_at_stop, decode_batch
from lmrl.rollout.shared_prompt_decoder import SharedPromptDecoder
from lmrl.rollout.static_decode import MASKED_KERNELS, StaticDecoder, decode_path

# Compact the batch (drop finished rows from the forward pass and the KV cache) once this fraction
# of the rows still in the batch has finished: compacting copies the cache, so doing it for every
# single finished row costs more than it saves.
COMPACT_FRACTION = 0.25
# Stop strings are searched in the decoded last (longest stop string in characters + this) tokens.
STOP_WINDOW_MARGIN = 8


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


def cache_keyword(model: nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in transformers releases that renamed it
    (5.24 deprecates `past_key_values`, to be removed in 5.40), else `past_key_values`. A peft model
    passes it through to its base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


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
    lean: bool  # shared-prompt step (`SharedPromptDecoder`)
    cache: Cache
    decoder: StaticDecoder | SharedPromptDecoder | None  # None: the model's own forward on `cache`
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
        banned = media_token_ids(model)  # image placeholders: never sampled
        self._banned = torch.tensor(banned, dtype=torch.long, device=self.device) if banned else None
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
        lean = self._full_attention and SharedPromptDecoder.supports(self.model)
        path, why = decode_path(self.model, self.device, self.cuda_graph, lean)
        if self.fixed_shapes and path != "cuda_graph":
            return "fixed_shapes", "fixed_shapes=True"
        return path, why

    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, media: Sequence[Media | None] | None = None
    ) -> Rollout:
        """Sample `n` completions for each prompt.

        Args:
            prompts: Token-id lists, one per prompt, each non-empty.
            n: Completions per prompt (>= 1); rows `i * n .. i * n + n - 1` belong to prompt `i`.
            params: Sampling parameters; `params.seed` makes the call reproducible.
            media: For a vision-language model, each prompt's processor outputs besides its ids
                (`lmrl.models.vision.Media`, None for a text prompt), computed once per prompt: the prefill
                runs them with the prompt, once per distinct prompt; decode steps are text only.

        Returns:
            A `Rollout` with `len(prompts) * n` rows, tensors on `self.device`.
        """
        _validate_prompts(prompts)
        if media is not None and len(media) != len(prompts):
            raise ValueError(f"media: {len(media)} bundles for {len(prompts)} prompts")
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
                    results.append(self._generate_chunk(prompts, row_prompt[rows].tolist(), params, rng, media))
        finally:
            self.model.train(was_training)
        return self._assemble(prompts, n, chunks, results, params)

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        row_prompt: list[int],
        params: SamplingParams,
        rng: torch.Generator,
        media: Sequence[Media | None] | None = None,
    ) -> _ChunkResult:
        """Prefill the distinct prompts of `row_prompt`, then decode one completion per row."""
        device, max_new, num_rows = self.device, params.max_new_tokens, len(row_prompt)
        # 1. prefill: each distinct prompt once
        start = self._prefill(prompts, row_prompt, max_new, media)
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
            token, token_logprob = _sample(logits, params, rng, self._banned)  # [a], [a]
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

    def _prefill(
        self, prompts: list[list[int]], row_prompt: list[int], max_new: int, media: Sequence[Media | None] | None = None
    ) -> _Prefill:
        """Run each distinct prompt of `row_prompt` once (with its images) and set up the decode path; `[b, V]`
        first logits."""
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
        next_position = prompt_mask.sum(1)  # [U]
        extra = batch_media([media[p] for p in distinct], device) if media is not None else {}
        rope = mrope_positions(self.model, prompt_ids, prompt_mask.long(), extra) if extra else None
        if rope is not None:  # 3-D positions (Qwen2-VL); text goes on after each prompt's largest position
            position_ids, next_position = rope, rope.amax(dim=(0, 2)) + 1
        out = self.model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask.long(),
            position_ids=position_ids,
            **{self._cache_kwarg: cache},
            use_cache=True,
            logits_to_keep=1,
            **extra,
        )
        logits = out.logits[:, -1].float().index_select(0, row_local)  # [b, V]
        next_position = next_position.index_select(0, row_local)  # [b]
        decoder, mask = None, None
        if static:
            decoder = StaticDecoder(self.model, cache, prompt_mask, row_local, max_new, self._cache_kwarg,
                                    graph=path == "cuda_graph")
        elif lean:
            decoder = SharedPromptDecoder(self.model, cache, prompt_mask, row_local, max_new)
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
            for text in decode_batch(self.tokenizer, ids, skip_special_tokens=True)
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
        for j, text in zip(live, decode_batch(self.tokenizer, tails)):
            if any(s in text for s in self.stop):
                hit[j] = True
        return hit.to(done.device)


def _sample(
    logits: torch.Tensor, params: SamplingParams, rng: torch.Generator, banned: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its log-prob under the untruncated distribution.

    Args:
        logits: `[B, V]` float32 next-token logits.
        params: temperature (0 = argmax), top_k, top_p.
        rng: Source of randomness.
        banned: `[K]` token ids never sampled (a vision-language model's image placeholders: one in a
            completion would give the training forward more image tokens than images).

    Returns:
        `[B]` token ids and `[B]` float32 log softmax(logits / temperature)[token] (temperature 1 when
        greedy). Top-k / top-p and `banned` only restrict where samples are drawn from; the log-prob is that
        of the full distribution, which is what the trainer's forward pass computes.
    """
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = (logits if banned is None else logits.index_fill(1, banned, float("-inf"))).argmax(dim=-1)
    else:
        logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [B, V]
        allowed = logp if banned is None else logp.index_fill(1, banned, float("-inf"))
        if params.top_k > 0 or params.top_p < 1.0:
            probs = torch.softmax(_truncate(allowed, params.top_k, params.top_p), dim=-1)
        else:
            probs = logp.exp() if banned is None else torch.softmax(allowed, dim=-1)
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
