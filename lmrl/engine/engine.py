"""The decode loop: rows join when there is room and leave the step they end (continuous batching).

    engine = DecodeEngine(model, params, eos=[2])
    engine.add([Request(prompt, max_new, owner, key) for ...])     # prefill: each distinct prompt once
    while len(engine):
        for ended in engine.step():                          # sample, check, leave, feed forward
            ...

A training batch is many requests added at once (the `n` completions of a prompt share its prefill and its keys);
a server adds requests as they arrive. Each `step`:

1. samples one token per row from its logits (`lmrl.engine.sampling`, on the device, from the row's own random
   stream: what a row samples does not depend on the rows beside it) and records it with its log-prob;
2. learns which rows ended: the host knows when a row reaches its `max_new` (it counts steps); EOS and stop strings
   need the tokens, which the host reads only every `check_every` steps (1 on a CPU, where reading is free; on a
   GPU a read waits for the device, so rows run a few steps past their end and are cut back to it);
3. hands back the rows that ended; they leave the cache (`KVCache.keep`) once a quarter of the rows have ended
   (`COMPACT_FRACTION`), stepping on ignored until then;
4. feeds the other rows' tokens through the model, one new key per row, for the next logits: module by module
   (`LlamaStep`) for the Llama / Qwen2 / Qwen3 models it reproduces, through the model's own forward (`ModelStep`) for every
   other (`step_path`).

The engine knows token ids only: the caller decodes texts, and stop strings come in as a `stops` callable.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from lmrl.engine.cache import KVCache, PrefillLayer
from lmrl.engine.llama import LlamaStep
from lmrl.engine.llama import supports as llama_supports
from lmrl.engine.model_step import ModelStep, cache_keyword
from lmrl.engine.sampling import sample
from lmrl.models.shared_prompt import full_attention
from lmrl.models.vision import batch_media, mrope_positions

# Steps between the host's reads of the sampled tokens on a GPU (each read waits for the device).
CHECK_EVERY_GPU = 8
# Rows that ended leave the cache (their slots compacted) once they are this fraction of the rows in it, or sooner
# when one reaches its max_new or new rows join; until then they step on, their tokens ignored: compacting copies the
# cache, so doing it for every row that ends costs more than it saves.
COMPACT_FRACTION = 0.25


@dataclass(slots=True)
class Request:
    """One row to decode: its prompt's token ids, its most new tokens, whatever the caller tells rows apart by, and
    its random stream (`lmrl.engine.sampling.row_keys`)."""

    prompt: list[int]
    max_new: int
    owner: Any
    key: int = 0
    media: Any = None  # a vision-language prompt's processor outputs (`lmrl.models.vision.Media`), prefilled with it
    sampled: list[int] | None = None  # a row going on from tokens it sampled before (the prompt's end): stop strings


@dataclass(slots=True)
class Ended:
    """A row the step ended: its sampled tokens and their log-probs, and why it ended."""

    owner: Any
    tokens: list[int] | None  # None: copied into the engine's `sink` instead
    logprobs: list[float] | None
    finished: bool  # EOS or a stop string; False: it reached its max_new
    length: int = 0  # tokens kept


@dataclass(slots=True)
class _Row:
    owner: Any
    max_new: int
    prompt_len: int  # real prompt tokens: the row's first response token sits at this position
    last: int  # the cache step at which the row samples its max_new-th token
    end: int | None = None  # tokens kept, once an EOS or a stop string ended it
    key: int = -1  # its index in the stop checker
    done: bool = False  # handed back; it steps on (ignored) until the cache is compacted


def bucket_of(rows: int, slots: int) -> int:
    """The row slots a fixed-shape step runs for `rows` rows in flight in a cache of `slots`: all of them, or the power
    of two at or above `rows` once that is at most half of them (a few graphs per call, the tail of a call cheaper)."""
    bucket = 1 << max(rows - 1, 0).bit_length()
    return bucket if 2 * bucket <= slots else slots


def step_path(model: nn.Module) -> tuple[bool, str]:
    """Whether `model` steps module by module (`LlamaStep`, shared-prompt attention: the Llama / Qwen2 / Qwen3 models it
    reproduces exactly) or through its own forward (`ModelStep`), and why."""
    if not full_attention(model):
        return False, "its own forward: the model has sliding-window layers"
    if not llama_supports(model):
        return False, f"its own forward: {type(model).__name__} (module by module: Llama / Qwen2 / Qwen3, no hooks on layers)"
    return True, "module by module, each prompt's keys shared by its rows"


class DecodeEngine:
    """Continuous-batching decode of any causal LM (`step_path` picks its step).

    Args:
        model: the causal LM, in eval mode, run under `torch.inference_mode()` by the caller; its weights are read
            when the engine is built (build a new engine after they change).
        params: temperature, top_k, top_p of every row (`lmrl.rollout.SamplingParams` or alike).
        eos: token ids that end a row (empty: rows run to their max_new).
        banned: `[k]` token ids never sampled (image placeholders), or None.
        stops: `stops(keys, tokens)` -> for each row key, the index in its new tokens of the token that completed a
            stop string, or None; `new_key()` gives a row its key. None: no stop strings.
        rows: about how many rows a step runs (oneDNN's weight layout); check_every: steps between the host's reads
            of sampled tokens (None: 1 on a CPU, `CHECK_EVERY_GPU` elsewhere).
        fixed: steps of fixed shapes (`_fixed_step`), replayed as CUDA graphs where `graphs` (None: on CUDA);
            elsewhere they run eagerly (tests check that they sample what the other steps sample).
    """

    def __init__(self, model: nn.Module, params: Any, eos: list[int], banned: torch.Tensor | None = None,
                 stops: Any = None, rows: int = 64, check_every: int | None = None, pad_token_id: int = 0,
                 fixed: bool = False, graphs: bool | None = None) -> None:
        self.model, self.params, self.banned, self.stops = model, params, banned, stops
        self.device = next(model.parameters()).device
        self.eos = set(eos)
        self._eos_tensor = torch.tensor(sorted(self.eos), dtype=torch.long, device=self.device)
        self._next_last: int | None = None  # the earliest step a row in flight reaches its max_new
        self._longest_prompt = 0
        self._work: dict = {}  # sampling's [b, V] buffers, reused step to step
        self.sink: tuple[torch.Tensor, torch.Tensor] | None = None  # see `collect_into`
        self._done = 0  # rows handed back but still in the cache
        lean, self.path = step_path(model)
        self._step_rows = rows
        self.step_fn = LlamaStep(model, rows) if lean else ModelStep(model)
        self.cache: KVCache | None = None  # made at the first prefill, which shows the keys' shape
        self._reserved: tuple[int, int, int, int] | None = None  # `reserve`'s sizes, until the cache is made
        self.num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self.check_every = check_every or (1 if self.device.type == "cpu" else CHECK_EVERY_GPU)
        self.pad_token_id = pad_token_id
        self.rows: list[_Row] = []
        self.logits: torch.Tensor | None = None  # [b, V] float32, each row's next-token logits
        self.start: torch.Tensor | None = None  # [b] each row's first response position: position = start + length
        self.keys: torch.Tensor | None = None  # [b] int64 each row's random stream
        self.forwards = 0  # prefills and steps run: what a test counts
        self.reads = 0  # times the host read the sampled tokens: what a test counts
        self._since_read = 0
        self._cache_kwarg = cache_keyword(model)
        self.fixed = fixed
        # capture the fixed-shape step (`_fixed_step`); None: on CUDA
        self.graphs = fixed and (self.device.type == "cuda" if graphs is None else graphs)
        self.note: str | None = None  # why capturing failed, when it did
        self.captures = 0  # graphs captured: what a test counts
        self._graphs: dict[int, tuple | None] = {}  # bucket -> (graph, its logits), or None: warmed up
        self._storage = -1  # the cache's `rebuilds` the graphs read
        self._inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # the fixed-shape step's token / position

    def __len__(self) -> int:
        """Rows in flight (not counting those that ended and wait for the next compaction)."""
        return len(self.rows) - self._done

    @property
    def rebuilds(self) -> int:
        return self.cache.rebuilds if self.cache is not None else 0

    def collect_into(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Copy each ended row's tokens and log-probs into row `owner` of these `[N, W]` tensors on the device (owners
        are row numbers), instead of handing them back as lists: a training batch reads them once at the end. What
        lies past a row's length there is undefined."""
        self.sink = (tokens, logprobs)

    def reserve(self, prompts: int, prompt_len: int, rows: int, new: int) -> None:
        """Room for all a caller will add (`prompts` distinct prompts of up to `prompt_len` tokens, `rows` rows of up to
        `new` tokens at once), allocated once and exactly: a training batch knows its sizes."""
        if self.cache is None:
            self._reserved = (prompts, prompt_len, rows, new)
        else:
            self.cache.reserve(prompts, prompt_len, rows, new, slack=False)

    def add(self, requests: list[Request]) -> None:
        """Prefill the distinct prompts of `requests` (one forward; a prompt with images, `Request.media`, is told
        apart by its bundle) and put their rows in the batch; their first token is sampled by the next `step`."""
        if not requests:
            return
        if self._done:  # the room of rows that ended, before new rows take room
            self._compact(None)
        distinct: list[Request] = []  # the first request of each distinct prompt
        index: dict = {}
        local = []  # each request's distinct prompt
        for r in requests:
            if (key := (tuple(r.prompt), id(r.media))) not in index:
                index[key] = len(distinct)
                distinct.append(r)
            local.append(index[key])
        lengths = [len(r.prompt) for r in distinct]
        logits, keys, values, next_position = self._prefill(distinct)
        local_t = torch.tensor(local, device=self.device)
        logits = logits.index_select(0, local_t)  # [r, V]
        if self.cache is None:
            self.cache = self.step_fn.new_cache(self.device, keys[0], fixed=self.fixed)
            if self._reserved is not None:
                self.cache.reserve(*self._reserved, slack=False)
        cache = self.cache
        if not self.step_fn.shares_prompts:  # each row its own copy of its prompt's keys
            keys = [k.index_select(0, local_t) for k in keys]
            values = [v.index_select(0, local_t) for v in values]
            lengths, local = [lengths[i] for i in local], list(range(len(requests)))
        cache.reserve(len(lengths), max(lengths), len(requests), max(r.max_new for r in requests))
        slots = cache.add_prompts([k.to(cache.dtype) for k in keys], [v.to(cache.dtype) for v in values], lengths)
        cache.add_rows([slots[i] for i in local])
        for r, i in zip(requests, local):
            stop_key = self.stops.new_key(r.sampled or ()) if self.stops else -1
            self.rows.append(_Row(r.owner, r.max_new, lengths[i], cache.steps + r.max_new - 1, key=stop_key))
        start = next_position.index_select(0, local_t)
        keys = torch.tensor([r.key for r in requests], dtype=torch.long, device=self.device)
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.start = start if self.start is None else torch.cat([self.start, start])
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys])
        self._rows_changed()

    @property
    def settled(self) -> bool:
        """The host has read every token sampled so far: each row's end is known (`abort` may run)."""
        return self._since_read == 0

    def abort(self) -> list[Ended]:
        """Hand back every row in flight as it stands, its tokens so far (`finished` False), and empty the engine: the
        rows go on elsewhere, e.g. from their next token under new weights (partial rollouts, `HFGenerator.stream`).
        Call it between steps where the engine is `settled`."""
        live = [i for i, row in enumerate(self.rows) if not row.done]
        out = []
        if live:
            lengths = self.cache.row_length
            index = torch.tensor(live, device=self.device)
            width = max(lengths[i] for i in live)
            tokens = self.cache.tokens.index_select(0, index)[:, :width].tolist()
            logprobs = self.cache.logprobs.index_select(0, index)[:, :width].tolist()
            out = [Ended(self.rows[i].owner, t[: lengths[i]], lp[: lengths[i]], False, lengths[i])
                   for i, t, lp in zip(live, tokens, logprobs)]
        if self.rows:
            self.rows, self.logits, self.start, self.keys, self._done = [], None, None, None, 0
            self.cache.keep([])
            self._rows_changed()
        return out

    def sampled(self) -> dict[Any, int]:
        """Each row in flight's tokens sampled so far, by owner (the next one is sampled from logits already computed)."""
        return {row.owner: n for row, n in zip(self.rows, self.cache.row_length) if not row.done} if self.rows else {}

    def reload(self) -> None:
        """The model's weights changed in place: the steps read them again, and the rows in flight go on from the
        keys and values cached so far and the next logits, which the earlier weights computed (partial rollouts that
        keep the cache, `HFGenerator.stream`)."""
        if isinstance(self.step_fn, LlamaStep):  # q / k / v were concatenated from the earlier weights
            kernels = self.step_fn.kernels
            self.step_fn = LlamaStep(self.model, self._step_rows)
            self.step_fn.kernels = kernels  # chosen with the cache, which stays
        self._graphs = {}  # what a graph reads may have been remade

    def _prefill(self, prompts: list[Request]) -> tuple[torch.Tensor, list, list, torch.Tensor]:
        """One forward over the (left-padded) prompts of `prompts` with their images: `[U, V]` float32 logits at each
        one's last token, per layer `[U, K, P, D]` keys and values (left-padded), `[U]` each one's next position
        (its length; after images, Qwen2-VL's largest 3D position + 1)."""
        width = max(len(r.prompt) for r in prompts)
        ids = torch.tensor([[self.pad_token_id] * (width - len(r.prompt)) + list(r.prompt) for r in prompts])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in prompts])
        ids, mask = ids.to(self.device), mask.to(self.device)
        position_ids, next_position = (mask.cumsum(1) - 1).clamp(min=0), mask.sum(1)
        extra = {}
        if any(r.media is not None for r in prompts):
            extra = batch_media([r.media for r in prompts], self.device)
            rope = mrope_positions(self.model, ids, mask, extra)
            if rope is not None:  # 3-D positions; text goes on after each prompt's largest one
                position_ids, next_position = rope, rope.amax(dim=(0, 2)) + 1
        prefill = Cache(layers=[PrefillLayer(width) for _ in range(self.num_layers)])
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                         **{self._cache_kwarg: prefill}, use_cache=True, logits_to_keep=1, **extra)
        self.forwards += 1
        keys = [layer.keys for layer in prefill.layers]
        values = [layer.values for layer in prefill.layers]
        return out.logits[:, -1].float(), keys, values, next_position

    def _compact(self, token: torch.Tensor | None) -> torch.Tensor | None:
        """Drop the rows that ended from the cache and the batch; `[b]` this step's tokens of the rows kept."""
        order = self.cache.keep([i for i, row in enumerate(self.rows) if not row.done])
        index = torch.tensor(order, device=self.device)
        self.rows = [self.rows[i] for i in order]
        self.start, self.keys = self.start.index_select(0, index), self.keys.index_select(0, index)
        if self.logits is not None and token is None:  # between steps (a join): the next logits of the rows kept
            self.logits = self.logits.index_select(0, index)
        self._done = 0
        self._rows_changed()
        return None if token is None else token.index_select(0, index)

    def _rows_changed(self) -> None:
        """What the host derives from the rows in flight, once per change of them (not per step)."""
        self._next_last = min((row.last for row in self.rows), default=None)
        self._longest_prompt = max((row.prompt_len for row in self.rows), default=0)

    def step(self) -> list[Ended]:
        """Sample each row's next token; hand back the rows that ended, feed the others' tokens forward."""
        cache = self.cache
        token, logprob = sample(self.logits, self.params, self.keys, cache.length_tensor, self.banned,
                                self._work)  # [b], [b]
        cache.record(token, logprob)
        self._since_read += 1
        at_max = cache.steps >= self._next_last
        found = self._read(token) if self._since_read >= self.check_every or at_max else False
        out = []
        if found or at_max:
            ended = [i for i, row in enumerate(self.rows)
                     if not row.done and (row.end is not None or row.last <= cache.steps)]
            out = self._hand_back(ended) if ended else []  # none: a row that ended earlier reached its max_new
            for i in ended:
                self.rows[i].done = True
            self._done += len(ended)
            if self._done == len(self.rows):
                self.rows, self.logits, self.start, self.keys, self._done = [], None, None, None, 0
                cache.keep([])
                return out
            if self._done >= COMPACT_FRACTION * len(self.rows) or at_max:  # at_max: a row has no columns left
                token = self._compact(token)
        position = self.start + cache.length_tensor
        if self.fixed:
            self.logits = self._fixed_step(token, position).float()
        else:
            self.logits = self.step_fn(token, position, cache, self._longest_prompt + cache.longest + 1).float()
        cache.advance()
        self.forwards += 1
        return out

    def _fixed_step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The step with the same shapes for every step of a bucket: the first B row slots of the cache step (B the
        cache's slots, or the power of two at or above the rows in flight once they fit in half as many; the slots
        past the rows on padding) over the whole capacity, from buffers that stay put until the cache grows. On CUDA
        a bucket's first step runs eagerly (the warm-up), its next is captured as a CUDA graph, and the rest replay
        it (one launch for the whole step); a capture that fails says why once and the same steps run eagerly."""
        cache, b = self.cache, token.shape[0]
        _, pc, rc, nc = cache.capacity
        bucket = bucket_of(b, rc)
        if self._inputs is None or self._inputs[0].shape[0] != rc:
            self._inputs = tuple(torch.zeros(rc, dtype=torch.long, device=self.device) for _ in range(2))
        tokens, positions = (x[:bucket] for x in self._inputs)
        tokens.fill_(self.pad_token_id)
        tokens[:b] = token
        positions.zero_()
        positions[:b] = position
        if self._storage != cache.rebuilds:  # the stores were remade: every graph reads the old ones
            self._graphs, self._storage = {}, cache.rebuilds
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph[0].replay()
            return graph[1][:b]
        logits = self.step_fn(tokens, positions, cache, pc + nc + 1)
        if self.graphs and bucket in self._graphs:  # warmed up: record the next
            self._capture(bucket, tokens, positions, pc + nc + 1)
        else:
            self._graphs[bucket] = None
        return logits[:b]

    def _capture(self, bucket: int, tokens: torch.Tensor, positions: torch.Tensor, length: int) -> None:
        """Record a bucket's fixed-shape step (recording runs nothing: the cache stays as the eager step left it)."""
        try:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                logits = self.step_fn(tokens, positions, self.cache, length)
        except Exception as e:  # noqa: BLE001 - any failure falls back to the same step, eager
            self.graphs = False
            self.note = f"CUDA graph capture failed, decoding eagerly: {type(e).__name__}: {e}"
            warnings.warn(self.note, RuntimeWarning, stacklevel=4)
            return
        self._graphs[bucket] = (graph, logits)
        self.captures += 1

    def _read(self, token: torch.Tensor) -> bool:
        """The host reads the tokens sampled since its last read and marks where EOS or a stop string ended a row;
        whether one did. One synchronisation."""
        self.reads += 1
        width, self._since_read = self._since_read, 0
        if self.stops is None and not self.eos:  # rows end at their max_new only, which the host counts
            return False
        cache, b = self.cache, len(self.rows)
        count = cache.length_tensor + 1  # [b] tokens each row has sampled
        if width == 1:
            window, valid = token[:, None], None  # [b, 1]
        else:  # each row's last `width` columns, fewer for a row that joined since
            columns = count[:, None] - width + torch.arange(width, device=self.device)  # [b, w]
            window = cache.tokens[:b].gather(1, columns.clamp(min=0))
            valid = columns >= 0
        if self.stops is not None:
            return self._read_stops(window.tolist(), valid, count)
        hits = torch.isin(window, self._eos_tensor)
        if valid is not None:
            hits &= valid
        if not bool(hits.any()):
            return False
        rows = hits.any(1).nonzero().squeeze(1)
        ends = (count.index_select(0, rows) - width + hits.index_select(0, rows).int().argmax(1) + 1).tolist()
        found = False
        for i, end in zip(rows.tolist(), ends):
            if not self.rows[i].done:  # a row handed back samples on until the compaction, ignored
                self.rows[i].end, found = end, True
        return found

    def _read_stops(self, window: list[list[int]], valid: torch.Tensor | None, count: torch.Tensor) -> bool:
        """`_read` with stop strings: the window's tokens go through the stop checker on the host, EOS with them."""
        width = len(window[0]) if window else 0
        counts = count.tolist() if valid is not None else None
        live, news = [], []
        for i, (row, tokens) in enumerate(zip(self.rows, window)):
            if row.done:
                continue
            first = 0 if counts is None else max(0, width - counts[i])  # columns before the row's first are not its
            live.append(i)
            news.append(tokens[first:])
        eos_at = [next((j for j, t in enumerate(new) if t in self.eos), None) for new in news]
        cut = [new if j is None else new[: j + 1] for new, j in zip(news, eos_at)]
        stop_at = self.stops([self.rows[i].key for i in live], cut)
        found = False
        for i, new, e, st in zip(live, news, eos_at, stop_at):
            hits = [j for j in (e, st) if j is not None]
            if hits:
                sampled = self.cache.steps - self.cache.row_born[i] + 1
                self.rows[i].end = sampled - len(new) + min(hits) + 1
                found = True
        return found

    def _hand_back(self, ended: list[int]) -> list[Ended]:
        """The ended rows' tokens and log-probs, cut at their end."""
        rows = [self.rows[i] for i in ended]
        cache = self.cache
        ends = [row.end if row.end is not None else row.max_new for row in rows]
        width = max(ends)
        index = torch.tensor(ended, device=self.device)
        if self.sink is not None:
            owners = torch.tensor([row.owner for row in rows], device=self.device)
            for out, buffer in zip(self.sink, (cache.tokens, cache.logprobs)):
                out.index_copy_(0, owners, buffer.index_select(0, index)[:, : out.shape[1]])
            return [Ended(row.owner, None, None, row.end is not None, end) for row, end in zip(rows, ends)]
        tokens = cache.tokens.index_select(0, index)[:, :width].tolist()
        logprobs = cache.logprobs.index_select(0, index)[:, :width].tolist()
        return [Ended(row.owner, t[:end], lp[:end], row.end is not None, end)
                for row, end, t, lp in zip(rows, ends, tokens, logprobs)]
