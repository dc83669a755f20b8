"""The engine's KV cache: every key / value head stored once, a prompt's keys once for all the rows that share it.

Two stores per layer, each of fixed capacity, grown (copied once, with slack) only when a join needs more room:

    prompt_keys / prompt_values  [Uc, K, Pc, D]  one slot per distinct prompt in flight, right-aligned: a prompt of
                                                 m tokens fills columns Pc - m .. Pc - 1 (left padding before it)
    row_keys / row_values        [Rc, K, Nc, D]  one slot per row (completion), response column j its j-th token

K key / value heads (never repeated for grouped-query attention), D head size. Rows in flight take slots
0 .. b - 1 and prompts 0 .. U - 1: a row that leaves gives its slot to the last row (only that row moves), a prompt
whose last row left gives its slot to the last prompt. What attention reads of a row is its prompt's m live columns
and its own response so far, `length[r] + 1` columns with the new one: the C kernel reads exactly that; the PyTorch
path reads the longest of them rounded up to `BLOCK` columns, under a mask.

`joined=True` is the layout of steps through the model's own forward (`lmrl.engine.model_step`), whose attention
takes one `[b, K, columns, D]` tensor per layer: each row has a prompt slot of its own (its prompt's keys copied to
it), and the two stores of a layer are views of one `[Rc, K, Pc + Nc, D]` buffer, so that row r's prompt and
response are one contiguous span of its slot (`sequence_keys[i][r, :, Pc - m : Pc + length]`).

The host keeps each row's prompt and the step it joined at as Python ints, so it knows every length without asking
the device (a decode step stays free of host synchronisation), and a step costs the host no work per row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicLayer

# The PyTorch attention path reads prompt and response columns in multiples of this many (fewer distinct shapes).
BLOCK = 16
# Room a grown store keeps beyond what the rows in flight and the joining ones need, as a fraction of it.
SLACK = 0.25


def _round_up(n: int, block: int = BLOCK) -> int:
    return -(-n // block) * block


def fill_holes(keep: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Slots 0 .. len(keep) - 1 after only the slots `keep` (in order) stay: each slot below the new count whose
    tenant left takes a kept tenant from above it (only those move). Returns (the old slot of each new slot's tenant,
    the slots moved from, the slots moved to)."""
    b, kept = len(keep), set(keep)
    moving = [i for i in keep if i >= b]
    holes = [i for i in range(b) if i not in kept]
    order = list(range(b))
    for hole, old in zip(holes, moving):
        order[hole] = old
    return order, moving, holes


class StepRows(NamedTuple):
    """The rows a decode step runs: `[r]` slot indices, response lengths and prompt slots, `[u]` prompt lengths, and
    the prompt and response columns it reads."""

    index: torch.Tensor
    length: torch.Tensor
    prompt: torch.Tensor
    prompt_length: torch.Tensor
    prompt_columns: int
    response_columns: int


class KVCache:
    """The keys and values of an engine's rows and their prompts (see the module docstring).

    Args:
        num_layers, kv_heads, head_dim: the model's decoder shape.
        dtype: the stores' dtype (float32 for a 16-bit model on a CPU: attention in float32, as transformers'
            kernels accumulate).
        device: where the stores live.
        zeroed: fill new stores with zeros (the PyTorch path multiplies masked columns' values by a zero weight,
            and NaN * 0 is NaN); the C kernel never reads a column it did not write, so it skips the fill.
        joined: one prompt slot per row, both stores views of one buffer (see the module docstring).
        fixed: steps of fixed shapes (`step_rows`), which a GPU can replay as a CUDA graph.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 zeroed: bool = True, joined: bool = False, fixed: bool = False):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.zeroed, self.joined, self.fixed = dtype, device, zeroed, joined, fixed
        self._every: StepRows | None = None  # fixed: every slot's row tensors, in buffers made once per `reserve`
        self.prompt_keys: list[torch.Tensor] = []
        self.prompt_values: list[torch.Tensor] = []
        self.row_keys: list[torch.Tensor] = []
        self.row_values: list[torch.Tensor] = []
        self.sequence_keys: list[torch.Tensor] = []  # joined: [Rc, K, Pc + Nc, D], the two stores' common buffer
        self.sequence_values: list[torch.Tensor] = []
        self.tokens = self.logprobs = None  # [Rc, Nc] each row's sampled tokens and their log-probs
        self.prompt_length: list[int] = []  # [U] live columns of each prompt slot
        self.prompt_rows: list[int] = []  # [U] rows in flight per prompt
        self.row_prompt: list[int] = []  # [b]
        self.row_born: list[int] = []  # [b] the value of `steps` when the row joined
        self.steps = 0  # `advance` calls so far: a row's response holds steps - born tokens
        self.rebuilds = 0  # times the stores were grown
        self.version = 0  # bumped whenever rows, prompts or buffers change: views and kernels' checks follow it
        self._slots: tuple | None = None  # (version, `slots()`)
        self._sync()

    @property
    def rows(self) -> int:
        return len(self.row_prompt)

    @property
    def row_length(self) -> list[int]:
        """[b] response tokens whose keys are stored, per row."""
        return [self.steps - born for born in self.row_born]

    @property
    def longest(self) -> int:
        """The longest response stored (0 without rows)."""
        return self.steps - self.first_born if self.row_born else 0

    @property
    def capacity(self) -> tuple[int, int, int, int]:
        """(prompt slots, prompt columns, row slots, response columns)."""
        if not self.prompt_keys:
            return 0, 0, 0, 0
        (uc, _, pc, _), (rc, _, nc, _) = self.prompt_keys[0].shape, self.row_keys[0].shape
        return uc, pc, rc, nc

    def reserve(self, prompts: int, prompt_len: int, rows: int, new: int, slack: bool = True) -> None:
        """Room for `prompts` more prompts of up to `prompt_len` tokens and `rows` more rows of up to `new` response
        tokens, beside those in flight (their response room kept): the stores grow, with `SLACK` (unless `slack` is
        False: a caller that knows all it will add), when it is not there."""
        uc, pc, rc, nc = self.capacity
        need_u, need_r = len(self.prompt_length) + prompts, self.rows + rows
        if self.joined:  # a prompt slot per row
            need_u = need_r = max(need_u, need_r)
        need_p = max([prompt_len, *self.prompt_length])
        need_n = max(new, nc if self.rows else 0)
        if need_u <= uc and need_p <= pc and need_r <= rc and need_n <= nc:
            return
        extra = (lambda need: max(int(SLACK * need), 4)) if slack else (lambda need: 0)  # noqa: E731
        grow = lambda need, have: have if need <= have else need + extra(need)  # noqa: E731
        # exactly what is asked (a span the PyTorch path reads stops at the capacity): a store's first write faults in
        # its pages, which on a CPU costs more than a short decode's arithmetic
        uc, pc, rc, nc = grow(need_u, uc), grow(need_p, pc), grow(need_r, rc), grow(need_n, nc)
        b = self.rows
        if self.joined:
            self._grow_joined(rc, pc, nc, b)
        else:
            self._grow(uc, pc, rc, nc, b)
        tokens = torch.empty((rc, nc), dtype=torch.long, device=self.device)
        logprobs = torch.empty((rc, nc), dtype=torch.float32, device=self.device)
        if self.tokens is not None and b:
            tokens[:b, : self.tokens.shape[1]] = self.tokens[:b]
            logprobs[:b, : self.logprobs.shape[1]] = self.logprobs[:b]
        self.tokens, self.logprobs = tokens, logprobs
        self.rebuilds += 1
        if self.fixed:
            zeros = lambda n: torch.zeros(n, dtype=torch.long, device=self.device)  # noqa: E731
            self._every = StepRows(torch.arange(rc, device=self.device), zeros(rc), zeros(rc), zeros(uc), pc, nc)
        self._sync()

    def _grow(self, uc: int, pc: int, rc: int, nc: int, b: int) -> None:
        """`reserve`'s new stores: `[uc, K, pc, D]` prompts (right-aligned, so the old columns end at the new last
        one) and `[rc, K, nc, D]` rows (response columns from 0), the live ones copied."""
        u, old_pc = len(self.prompt_length), self.capacity[1]
        for store, shape, live, width in ((self.prompt_keys, (uc, pc), u, old_pc), (self.prompt_values, (uc, pc), u, old_pc),
                                          (self.row_keys, (rc, nc), b, None), (self.row_values, (rc, nc), b, None)):
            for i in range(self.num_layers):
                new_buffer = (torch.zeros if self.zeroed else torch.empty)(
                    (shape[0], self.kv_heads, shape[1], self.head_dim), dtype=self.dtype, device=self.device)
                if store and live:
                    old = store[i]
                    if width is None:
                        new_buffer[:live, :, : old.shape[2]] = old[:live]
                    else:
                        new_buffer[:live, :, shape[1] - width:] = old[:live]
                if len(store) < self.num_layers:
                    store.append(new_buffer)
                else:
                    store[i] = new_buffer

    def _grow_joined(self, rc: int, pc: int, nc: int, b: int) -> None:
        """`reserve` of a joined cache: new `[rc, K, pc + nc, D]` buffers, the rows' prompts right-aligned before
        column pc and their responses after it, as they were."""
        _, old_pc, _, old_nc = self.capacity
        stores = ((self.sequence_keys, self.prompt_keys, self.row_keys),
                  (self.sequence_values, self.prompt_values, self.row_values))
        for joined, prompts, rows in stores:
            if not joined:
                for store in (joined, prompts, rows):
                    store.extend([None] * self.num_layers)
            for i in range(self.num_layers):
                buffer = (torch.zeros if self.zeroed else torch.empty)(
                    (rc, self.kv_heads, pc + nc, self.head_dim), dtype=self.dtype, device=self.device)
                if b:
                    buffer[:b, :, pc - old_pc: pc + old_nc] = joined[i][:b]
                joined[i], prompts[i], rows[i] = buffer, buffer[:, :, :pc], buffer[:, :, pc:]

    def zero_unread(self) -> None:
        """Zeros in every column no row's attention covers (before each prompt, past each response, the unused
        slots), once, before the PyTorch path reads a store allocated without the fill (`zeroed`)."""
        if self.zeroed or not self.prompt_keys:
            return
        uc, pc, rc, nc = self.capacity
        starts = torch.full((uc,), pc, dtype=torch.long, device=self.device)
        starts[: len(self.prompt_length)] -= self.prompt_length_tensor
        before = torch.arange(pc, device=self.device)[None] < starts[:, None]  # [Uc, Pc]
        lengths = torch.zeros(rc, dtype=torch.long, device=self.device)
        lengths[: self.rows] = self.length_tensor
        past = torch.arange(nc, device=self.device)[None] >= lengths[:, None]  # [Rc, Nc]
        for store in (*self.prompt_keys, *self.prompt_values):
            store.masked_fill_(before[:, None, :, None], 0)
        for store in (*self.row_keys, *self.row_values):
            store.masked_fill_(past[:, None, :, None], 0)
        self.zeroed = True

    def add_prompts(self, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int]) -> list[int]:
        """Store a prefill's prompts: per layer `[U', K, P', D]` keys and values, left-padded (prompt i's real tokens
        in its last `lengths[i]` columns). Returns their slots. `reserve` made room."""
        start, width = len(self.prompt_length), keys[0].shape[2]
        pc = self.capacity[1]
        for i in range(self.num_layers):
            self.prompt_keys[i][start: start + len(lengths), :, pc - width:] = keys[i]
            self.prompt_values[i][start: start + len(lengths), :, pc - width:] = values[i]
        self.prompt_length += lengths
        self.prompt_rows += [0] * len(lengths)
        self._sync()
        return list(range(start, start + len(lengths)))

    def add_rows(self, prompt_slots: list[int]) -> None:
        """New rows (response empty) after those in flight, row i of prompt slot `prompt_slots[i]`."""
        for u in prompt_slots:
            self.prompt_rows[u] += 1
        self.row_prompt += prompt_slots
        self.row_born += [self.steps] * len(prompt_slots)
        self._sync()

    def record(self, token: torch.Tensor, logprob: torch.Tensor) -> None:
        """Each row's sampled `[b]` token and log-prob, at its response column `length` (fed to the next step)."""
        self.tokens[self.row_index, self.length_tensor] = token
        self.logprobs[self.row_index, self.length_tensor] = logprob

    def advance(self) -> None:
        """Every row's key and value of its last recorded token are stored: each response one longer."""
        self.steps += 1
        self.length_tensor += 1

    def keep(self, keep: list[int]) -> list[int]:
        """Only rows `keep` (indices, in order) stay: each slot of a row that left, below the new row count, takes a
        row from above it; prompts left without rows give their slots up the same way. Returns the old index of each
        row slot's row."""
        order, moving, holes = fill_holes(keep)
        if moving:  # joined: a row's prompt moves with it (its prompt slot is its row slot)
            stores = [*self.sequence_keys, *self.sequence_values] if self.joined else [*self.row_keys, *self.row_values]
            self._move([*stores, self.tokens, self.logprobs], moving, holes)
        kept = set(keep)
        for i in range(self.rows):
            if i not in kept:
                self.prompt_rows[self.row_prompt[i]] -= 1
        self.row_prompt = [self.row_prompt[i] for i in order]
        self.row_born = [self.row_born[i] for i in order]
        # prompts without rows: the last prompts in use move into their slots
        prompt_order, moving, holes = fill_holes([u for u, n in enumerate(self.prompt_rows) if n > 0])
        if moving and not self.joined:
            self._move([*self.prompt_keys, *self.prompt_values], moving, holes)
        where = {old: new for new, old in enumerate(prompt_order)}
        self.prompt_length = [self.prompt_length[u] for u in prompt_order]
        self.prompt_rows = [self.prompt_rows[u] for u in prompt_order]
        self.row_prompt = [where[u] for u in self.row_prompt]
        self._sync()
        return order

    def spans(self, block: int = BLOCK) -> tuple[int, int]:
        """(prompt columns, response columns) the PyTorch attention paths read this step: the longest live prompt,
        and the longest response with the token this step adds, each rounded up to `block` (at most the capacity)."""
        _, pc, _, nc = self.capacity
        return (min(_round_up(max(self.prompt_length, default=1), block), pc),
                min(_round_up(self.longest + 1, block), nc))

    def _move(self, buffers: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for buffer in buffers:
            buffer.index_copy_(0, dst_t, buffer.index_select(0, src_t))

    def _sync(self) -> None:
        """The device's copies of the host's row and prompt lists (fixed: written into `step_rows`' buffers, of
        which they are the first b and U entries; the slots past them hold 0)."""
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        self.row_index = torch.arange(self.rows, device=self.device)  # [b], where `record` writes
        self.prompt_tensor, self.length_tensor = as_tensor(self.row_prompt), as_tensor(self.row_length)
        self.first_born = min(self.row_born, default=self.steps)
        self.prompt_length_tensor = as_tensor(self.prompt_length)
        if self._every is not None:
            b, u = self.rows, len(self.prompt_length)
            views = []
            for buffer, live, count in ((self._every.length, self.length_tensor, b),
                                        (self._every.prompt, self.prompt_tensor, b),
                                        (self._every.prompt_length, self.prompt_length_tensor, u)):
                buffer.zero_()
                buffer[:count] = live
                views.append(buffer[:count])
            self.length_tensor, self.prompt_tensor, self.prompt_length_tensor = views
        self.version += 1

    def step_rows(self, count: int, block: int = BLOCK) -> StepRows:
        """What a step of `count` rows reads of them: those in flight and the spans (rounded up to `block`); fixed,
        the first `count` slots (the rows past those in flight are padding: prompt slot 0, response length 0) and the
        whole capacity, the same shapes every step of a bucket, views of the same buffers."""
        if self._every is not None:
            every = self._every
            return every._replace(index=every.index[:count], length=every.length[:count], prompt=every.prompt[:count])
        return StepRows(self.row_index, self.length_tensor, self.prompt_tensor, self.prompt_length_tensor,
                        *self.spans(block))

    def slots(self) -> tuple[int, bool, torch.Tensor]:
        """The PyTorch path's layout of rows by prompt: S (the most rows of one prompt), whether row r sits in slot r,
        and `[b]` each row's slot, prompt * S + its rank among its prompt's rows. Computed once per change of rows."""
        if self._slots is None or self._slots[0] != self.version:
            per_prompt = max(self.prompt_rows, default=1) or 1
            rank, seen = [], [0] * len(self.prompt_length)
            for u in self.row_prompt:
                rank.append(seen[u])
                seen[u] += 1
            slot = [u * per_prompt + k for u, k in zip(self.row_prompt, rank)]
            identity = slot == list(range(len(self.prompt_length) * per_prompt))
            self._slots = (self.version, (per_prompt, identity, torch.tensor(slot, dtype=torch.long, device=self.device)))
        return self._slots[1]


class PrefillLayer(DynamicLayer):
    """A KV-cache layer for a prefill that keeps every key (a sliding window is the mask's), writing into a buffer
    sized for it.

    transformers' `DynamicLayer` concatenates the whole cache at every call; this one writes in place and returns
    views of the filled prefix. Buffers are `[B, capacity, K, D]` (sequence before heads) and the views
    `[B, K, L, D]`: each row's filled prefix is one contiguous block, which CPU attention reads about as fast as a
    contiguous tensor.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.key_buffer = key_states.new_empty((b, self.capacity, h, d))
        self.value_buffer = value_states.new_empty((b, self.capacity, value_states.shape[1], value_states.shape[3]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens for a capacity of {self.capacity}")
        self.key_buffer[:, self.length: end] = key_states.transpose(1, 2)
        self.value_buffer[:, self.length: end] = value_states.transpose(1, 2)
        self.length = end
        self._set_views()
        return self.keys, self.values

    def _set_views(self) -> None:
        self.keys = self.key_buffer[:, : self.length].transpose(1, 2)  # [B, K, L, D]
        self.values = self.value_buffer[:, : self.length].transpose(1, 2)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        # index_select also repeats rows: this is how a prompt's cache is copied to its n completions
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, indices)
            self.value_buffer = self.value_buffer.index_select(0, indices)
            self._set_views()
