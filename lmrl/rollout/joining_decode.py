"""Requests that join a running decode (continuous batching), for the generation server's batcher.

`HFGenerator.generate` decodes a fixed set of rows: a request that arrives while it runs waits for the whole call.
`JoiningDecode` is a decode loop that takes new rows between any two steps and hands each row back the step it
ends: the newcomers' distinct prompts are prefilled on their own (a forward over just them), their keys and values
copied into the running cache, and from then on they step with the rest. Used only by `lmrl.rollout.batcher` for
unseeded requests (an agent's, an OpenAI client's); a training batch, always seeded, goes through `generate` as
before, on its own decode paths.

How rows of different ages share one cache (`_JoinLayer`): every step writes one column for all rows, each row in a
slot of its own. A joining row's prompt sits right before the column its first token will take, left-padded like a
prompt of `generate`, and its attention mask covers its own prompt and every column from there on; what lies left
of it (older rows' columns, a slot's earlier tenant) is masked. Positions are each row's own, so a row decodes what
it decodes alone (test: greedy, the same tokens and log-probs within 1e-5 in float32). A row that ends leaves at
once, its slot taken by the last row (only that row's keys move). The cache is rebuilt (copied once, the columns no
row reads dropped) only when the slots, the room left of the next column (a longer prompt) or the columns right of
it (a longer max_new) run out, with a quarter more of each (`SLACK`).

Llama / Qwen2 models decode in `lmrl.engine.DecodeEngine`, the loop `generate` runs too (this class only hands
rows in and texts out); others step with the model's own forward over `_JoinLayer`s as above. Only full-attention
models with the sdpa or eager kernel (`joinable`); others keep the batcher's whole-call behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from lmrl.engine import DecodeEngine, Request
from lmrl.engine import supports as engine_supports
from lmrl.engine.cache import PrefillLayer, fill_holes
from lmrl.engine.sampling import row_keys, sample
from lmrl.rollout.base import SamplingParams
from lmrl.rollout.hf import HFGenerator, StopChecker
from lmrl.rollout.ops import cut_at_stop, decode_batch

# Llama / Qwen2 models decode in the engine (`lmrl.engine`); off: the model's forward for every model (the tests run
# both).
LEAN_STEPS = True
# Room a rebuilt cache keeps beyond what the rows in flight need, as a fraction of it: more slots, more columns
# left of the next one (a longer prompt's) and right of it (a longer max_new's).
SLACK = 0.25


def joinable(generator: Any) -> HFGenerator | None:
    """The lmrl decode behind `generator` (itself, or the `decoder` of `lmrl serve`'s `ModelGenerator`) when rows
    can join its decode: a full-attention model with the sdpa or eager kernel (whose 4D masks it passes). None: the
    batcher runs whole calls."""
    decoder = generator if isinstance(generator, HFGenerator) else getattr(generator, "decoder", None)
    if (isinstance(decoder, HFGenerator) and decoder._full_attention
            and decoder._attn_implementation in ("sdpa", "eager")):
        return decoder
    return None


@dataclass
class Joining:
    """One row that joins: its prompt, its most new tokens, and whatever the caller tells its rows apart by."""

    prompt: list[int]
    max_new: int
    owner: Any


@dataclass
class Ended:
    """A row the step ended: its sampled tokens and their log-probs, and why it ended."""

    owner: Any
    tokens: list[int]
    logprobs: list[float]
    finished: bool  # EOS or a stop string; False: it reached its max_new
    text: str  # decoded, special tokens skipped, cut after the first stop string


@dataclass
class _Row:
    owner: Any
    max_new: int
    start: int  # the first cache column it attends to
    key: int  # its index in the stop checker's history
    stream: int  # its random stream (`lmrl.engine.sampling.row_keys`)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class _JoinLayer(DynamicLayer):
    """One layer's keys and values in a joining decode: `[R, capacity, K, D]` buffers of R row slots, the first
    `rows` in use, every slot writing its next key at column `length`; attention reads columns `lo .. length` of
    the slots in use (`keys`, `values`: `[rows, K, length - lo, D]`)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int, rows: int, lo: int):
        super().__init__()
        self.key_buffer, self.value_buffer = keys, values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.length, self.rows, self.lo = length, rows, lo
        self._set_views()

    def _set_views(self) -> None:
        self.keys = self.key_buffer[: self.rows, self.lo: self.length].transpose(1, 2)
        self.values = self.value_buffer[: self.rows, self.lo: self.length].transpose(1, 2)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[rows, K, D]` keys and values at the next column; the columns attention reads."""
        self.key_buffer[: self.rows, self.length] = keys
        self.value_buffer[: self.rows, self.length] = values
        self.length += 1
        self._set_views()
        return self.keys, self.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.append(key_states[:, :, -1], value_states[:, :, -1])  # the model's forward: one new token

    def get_seq_length(self) -> int:
        return self.length - self.lo

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length - self.lo + query_length, 0


class JoiningDecode:
    """A decode loop of `generator`'s model that rows join (`add`) and leave (`step`) between steps.

    Args:
        generator: the `HFGenerator` whose model, tokenizer, EOS, banned tokens and unseeded random stream it uses.
        params: temperature, top_p, top_k and stop strings of every row (each row has its own max_new).

    The caller runs it under `torch.inference_mode()` with the model in eval mode. Rows sit in the first slots of
    the cache (`_JoinLayer`), in the order of `rows`; a row that ends leaves its slot to the last row (only that
    row's keys move); a joining row takes the next free slot, its prompt in the columns just before the next one
    written. The cache is rebuilt only when the slots, the room left of that column, or the columns run out.
    """

    def __init__(self, generator: HFGenerator, params: SamplingParams):
        self.g, self.params = generator, params
        self.rows: list[_Row] = []
        self.layers: list[_JoinLayer] = []
        self.mask: torch.Tensor | None = None  # [R, capacity] bool: the columns each slot's row attends to
        self.position: torch.Tensor | None = None  # [b] position of each row's next token
        self.logits: torch.Tensor | None = None  # [b, V] float32, each row's next-token logits
        self.columns = 0  # the next column written
        self.forwards = 0  # forward passes run (prefills and steps): what a test counts
        self.rebuilds = 0
        self.stops = StopChecker(generator.tokenizer, params.stop, 0) if params.stop else None
        self.lean = None  # the engine, for the models it decodes
        if LEAN_STEPS and engine_supports(generator.model):
            self.lean = DecodeEngine(generator.model, params, generator.eos_token_ids, banned=generator._banned, stops=self.stops, rows=generator.batch_size or 64,
                                     pad_token_id=generator.pad_token_id)

    def __len__(self) -> int:
        return len(self.lean) if self.lean is not None else len(self.rows)

    def add(self, joining: list[Joining]) -> None:
        """Prefill the distinct prompts of `joining` and put their rows in the batch; their first token is sampled
        by the next `step`."""
        g = self.g
        if self.lean is not None:
            keys = row_keys(g.draw_seed(), torch.arange(len(joining))).tolist()
            self.lean.add([Request(j.prompt, j.max_new, j.owner, k) for j, k in zip(joining, keys)])
            self.forwards, self.rebuilds = self.lean.forwards, self.lean.rebuilds
            return
        distinct = list(dict.fromkeys(tuple(j.prompt) for j in joining))
        local = torch.tensor([distinct.index(tuple(j.prompt)) for j in joining], device=g.device)  # [r]
        ids, prompt_mask = g._left_pad([list(p) for p in distinct])  # [U, P]
        width = ids.shape[1]
        prefill = Cache(layers=[PrefillLayer(width) for _ in range(g._num_layers)])
        out = g.model(input_ids=ids, attention_mask=prompt_mask.long(),
                      position_ids=(prompt_mask.long().cumsum(1) - 1).clamp(min=0),
                      **{g._cache_kwarg: prefill}, use_cache=True, logits_to_keep=1)
        self.forwards += 1
        logits = out.logits[:, -1].float().index_select(0, local)  # [r, V]
        position = prompt_mask.sum(1).index_select(0, local)  # [r]
        prompt_mask = prompt_mask.index_select(0, local)  # [r, P]
        b, r = len(self.rows), len(joining)
        remaining = max([row.max_new - len(row.tokens) for row in self.rows] + [j.max_new for j in joining])
        if (not self.layers or b + r > self.mask.shape[0] or self.columns < width
                or self.columns + remaining > self.mask.shape[1]):
            self._rebuild(b + r, width, remaining, prefill.layers[0].key_buffer)
        at = slice(self.columns - width, self.columns)
        for layer, new in zip(self.layers, prefill.layers):
            layer.key_buffer[b: b + r, at] = new.key_buffer.index_select(0, local)
            layer.value_buffer[b: b + r, at] = new.value_buffer.index_select(0, local)
        self.mask[b: b + r] = False
        self.mask[b: b + r, at] = prompt_mask
        self.mask[b: b + r, self.columns:] = True
        first = (prompt_mask.long().cumsum(1) == 0).sum(1).tolist()  # left padding of each new row's prompt
        streams = row_keys(g.draw_seed(), torch.arange(len(joining))).tolist()
        for j, pad, stream in zip(joining, first, streams):
            self.rows.append(_Row(j.owner, j.max_new, at.start + pad, self._stop_key(), stream))
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.position = position if self.position is None else torch.cat([self.position, position])
        self._set_rows()

    def _rebuild(self, rows: int, width: int, remaining: int, like: torch.Tensor) -> None:
        """New buffers with room for `rows` rows, a prompt of `width` columns left of the next column and `remaining`
        columns right of it, each with a quarter more (`SLACK`) so that the next joins fit without a rebuild; the live
        columns of the rows in flight are copied, the ones no row reads dropped. A rebuild copies the cache once,
        as a whole call's compaction does; the slack keeps the memory near a whole call's (rows x columns)."""
        b, lo = len(self.rows), min((row.start for row in self.rows), default=self.columns)
        live = self.columns - lo
        columns = max(live, width + int(SLACK * width))
        capacity, slots = columns + remaining + int(SLACK * remaining), rows + max(int(SLACK * rows), 4)
        mask = torch.zeros(slots, capacity, dtype=torch.bool, device=like.device)
        layers = []
        for i in range(self.g._num_layers):
            old = self.layers[i] if self.layers else None
            # zeros, not empty: a masked column still multiplies its value by a zero weight (NaN * 0 is NaN)
            keys, values = (like.new_zeros((slots, capacity, *like.shape[2:])) for _ in range(2))
            if b:
                keys[:b, columns - live: columns] = old.key_buffer[:b, lo: self.columns]
                values[:b, columns - live: columns] = old.value_buffer[:b, lo: self.columns]
            layers.append(_JoinLayer(keys, values, columns, b, 0))
        if b:
            mask[:b, columns - live: columns] = self.mask[:b, lo: self.columns]
            mask[:b, columns:] = True
        for row in self.rows:
            row.start += columns - live - lo
        self.layers, self.mask, self.columns = layers, mask, columns
        self.rebuilds += 1

    def _set_rows(self) -> None:
        """The layers' views after rows came or went: the rows in use, from the first column one of them reads."""
        lo = min(row.start for row in self.rows)
        for layer in self.layers:
            layer.rows, layer.lo = len(self.rows), lo
            layer._set_views()

    def _leave(self, keep: list[int]) -> list[int]:
        """Only rows `keep` stay: each slot of a row that left, below the new row count, takes a row from above it.
        Returns the old index of each new slot's row."""
        order, moving, holes = fill_holes(keep)
        if moving:
            src = torch.tensor(moving, device=self.mask.device)
            dst = torch.tensor(holes, device=self.mask.device)
            for layer in self.layers:
                layer.key_buffer.index_copy_(0, dst, layer.key_buffer.index_select(0, src))
                layer.value_buffer.index_copy_(0, dst, layer.value_buffer.index_select(0, src))
            self.mask.index_copy_(0, dst, self.mask.index_select(0, src))
        self.rows = [self.rows[i] for i in order]
        return order

    def _stop_key(self) -> int:
        if self.stops is None:
            return -1
        self.stops.history.append([])
        return len(self.stops.history) - 1

    def step(self) -> list[Ended]:
        """Sample each row's next token; hand back the rows that ended, feed the others' tokens forward."""
        g = self.g
        if self.lean is not None:
            out = [Ended(e.owner, e.tokens, e.logprobs, e.finished, "") for e in self.lean.step()]
            texts = decode_batch(g.tokenizer, [e.tokens for e in out], skip_special_tokens=True) if out else []
            for e, text in zip(out, texts):
                e.text = cut_at_stop(text, self.params.stop)
            self.forwards, self.rebuilds = self.lean.forwards, self.lean.rebuilds
            return out
        keys = torch.tensor([row.stream for row in self.rows], device=self.logits.device)
        steps = torch.tensor([len(row.tokens) for row in self.rows], device=self.logits.device)
        token, logprob = sample(self.logits, self.params, keys, steps, g._banned)  # [b], [b]
        ended = torch.isin(token, g._eos) if len(g.eos_token_ids) else torch.zeros_like(token, dtype=torch.bool)
        if self.stops is not None:
            keys = torch.tensor([row.key for row in self.rows])
            ended |= self.stops.update(keys, token.cpu(), torch.zeros(len(self.rows), dtype=torch.bool)).to(ended.device)
        out, keep = [], []
        for i, (row, t, lp, end) in enumerate(zip(self.rows, token.tolist(), logprob.tolist(), ended.tolist())):
            row.tokens.append(t)
            row.logprobs.append(lp)
            if end or len(row.tokens) >= row.max_new:
                out.append(Ended(row.owner, row.tokens, row.logprobs, bool(end), ""))
            else:
                keep.append(i)
        for e, text in zip(out, decode_batch(g.tokenizer, [e.tokens for e in out], skip_special_tokens=True)):
            e.text = cut_at_stop(text, self.params.stop)
        if not keep:
            self.rows, self.logits, self.position = [], None, None
            return out
        if len(keep) < len(self.rows):  # the ended rows leave the forward batch
            index = torch.tensor(self._leave(keep), device=token.device)
            token, self.position = token.index_select(0, index), self.position.index_select(0, index)
            self._set_rows()
        b, lo = len(self.rows), self.layers[0].lo
        self.columns += 1
        mask = self.mask[:b, lo: self.columns]  # [b, C]: this step's column included
        logits = g.model(input_ids=token[:, None], attention_mask=g._decode_mask(mask),
                         position_ids=self.position[:, None], **{g._cache_kwarg: Cache(layers=self.layers)},
                         use_cache=True, logits_to_keep=1).logits[:, -1]
        self.forwards += 1
        self.logits, self.position = logits.float(), self.position + 1
        return out
