"""Prompt datasets: rows with a prompt column plus any other columns, and a resumable sampler.

A row is a dict. Its prompt is a string, or a chat conversation: a list of {"role", "content"}
messages (encoded with the tokenizer's chat template, see `lmrl.models.loading.encode_prompts`).
Every other column (e.g. `answer`) is kept and passed to reward functions by name.

The sampler's order is a pure function of (seed, position): epoch e is the permutation drawn from a
generator seeded with (seed, e), and the step-th batch of size b is positions [s*b, (s+1)*b) of the
concatenated epochs. A resumed run that knows its step (or the number of prompts consumed) draws
exactly the prompts the interrupted run would have drawn, without replaying anything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FILE_FORMATS = (".jsonl", ".json", ".parquet")

# Distinct seeds must not share epochs: with `seed + epoch`, seed=1 would replay epoch 1 of seed=0.
_EPOCH_STRIDE = 1_000_003


def _is_message_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


def _looks_like_file(source: str) -> bool:
    return (
        source.endswith(FILE_FORMATS)
        or os.path.exists(source)
        or source.startswith(("/", ".", "~"))
        or source.count("/") > 1
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"dataset {str(path)!r}: line {line_no} is not valid JSON: {err.msg}"
                ) from err
            if not isinstance(row, dict):
                raise ValueError(
                    f"dataset {str(path)!r}: line {line_no} is a {type(row).__name__}, not an object"
                )
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"dataset {str(path)!r}: not valid JSON: {err.msg} (line {err.lineno})") from err
    # Either a list of row objects, or a {column: [values]} table (what pandas' to_json writes).
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise ValueError(f"dataset {str(path)!r}: columns have different lengths {sorted(lengths)}")
        names = list(data)
        return [dict(zip(names, values)) for values in zip(*data.values())]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(
            f"dataset {str(path)!r}: expected a list of objects or a {{column: [values]}} object"
        )
    return data


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # a dependency of `datasets`

    return pq.read_table(path).to_pylist()


def _read_hub(name: str, split: str, subset: str | None) -> list[dict[str, Any]]:
    import datasets

    return datasets.load_dataset(name, subset, split=split).to_list()


class PromptDataset(Sequence):
    """A validated list of rows, each with a prompt column; indexable and sized.

    Args:
        rows: the rows (dicts); kept as given.
        prompt_column: the column that holds the prompt.
        name: how errors and logs name the dataset.
    """

    def __init__(
        self, rows: Sequence[Mapping[str, Any]], prompt_column: str = "prompt", name: str = "<in-memory>"
    ):
        if len(rows) == 0:
            raise ValueError(f"dataset {name!r} has no rows")
        columns: dict[str, None] = {}
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise ValueError(
                    f"dataset {name!r}: row {i} is a {type(row).__name__}, not a dict of columns"
                )
            columns.update(dict.fromkeys(row))
            if prompt_column not in row:
                raise ValueError(
                    f"dataset {name!r}: row {i} has no prompt column {prompt_column!r}; "
                    f"columns present: {list(row)} (set data.prompt_column)"
                )
            prompt = row[prompt_column]
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError(f"dataset {name!r}: row {i} has an empty prompt")
            elif isinstance(prompt, list) and not prompt:
                raise ValueError(f"dataset {name!r}: row {i} has an empty list of messages as prompt")
            elif not _is_message_list(prompt):
                raise ValueError(
                    f"dataset {name!r}: row {i}: prompt must be a string or a list of "
                    f"{{'role', 'content'}} messages, got {type(prompt).__name__}"
                )
        self.rows = [dict(r) for r in rows]
        self.prompt_column = prompt_column
        self.name = name
        self._columns = list(columns)

    @property
    def columns(self) -> list[str]:
        """Every column seen in any row, in first-seen order."""
        return list(self._columns)

    @property
    def prompts(self) -> list[Any]:
        """The prompt of every row, in order."""
        return [r[self.prompt_column] for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.rows[i] for i in range(*index.indices(len(self)))]
        return self.rows[index]

    def __repr__(self) -> str:
        return f"PromptDataset({self.name!r}, rows={len(self)}, columns={self._columns})"

    def batch(self, step: int, batch_size: int, seed: int, shuffle: bool = True) -> list[dict[str, Any]]:
        """The rows of the `step`-th batch (0-based) of a (seed, shuffle) order; see `PromptSampler`."""
        sampler = PromptSampler(len(self), seed=seed, shuffle=shuffle)
        return [self.rows[i] for i in sampler.indices(step, batch_size)]

    def batches(
        self, batch_size: int, seed: int, start_step: int = 0, shuffle: bool = True
    ) -> Iterator[list[dict[str, Any]]]:
        """Batches of rows forever (epochs follow each other), starting at `start_step` to resume."""
        sampler = PromptSampler(len(self), seed=seed, shuffle=shuffle)
        step = start_step
        while True:
            yield [self.rows[i] for i in sampler.indices(step, batch_size)]
            step += 1


@dataclass(frozen=True)
class PromptSampler:
    """Row indices as a pure function of (seed, position): the seam for exact resume.

    The stream of indices is epoch 0's permutation, then epoch 1's, and so on; epoch e is
    `torch.randperm(n)` under a generator seeded from (seed, e) (the identity when `shuffle` is
    False). So each epoch visits every row exactly once, and a batch may straddle two epochs:
    no row is dropped and the batch size never changes.

    Args:
        n: number of rows.
        seed: non-negative integer seed.
        shuffle: permute each epoch (True) or keep file order (False).
    """

    n: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n: the sampler needs at least one row, got {self.n}")
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of range(n) used by epoch `epoch`."""
        if not self.shuffle:
            return list(range(self.n))
        gen = torch.Generator().manual_seed(self.seed * _EPOCH_STRIDE + epoch)
        return torch.randperm(self.n, generator=gen).tolist()

    def indices_at(self, position: int, count: int) -> list[int]:
        """Indices of stream positions [position, position + count): use it to resume by prompts consumed."""
        if position < 0 or count < 0:
            raise ValueError(f"position, count: must be >= 0, got {position}, {count}")
        out: list[int] = []
        epoch, offset = divmod(position, self.n)
        while len(out) < count:
            order = self.epoch_order(epoch)
            out.extend(order[offset : offset + count - len(out)])
            epoch, offset = epoch + 1, 0
        return out

    def indices(self, step: int, batch_size: int) -> list[int]:
        """Indices of the `step`-th batch (0-based) of `batch_size` rows."""
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        return self.indices_at(step * batch_size, batch_size)

    def epoch_of(self, step: int, batch_size: int) -> int:
        """The epoch in which the `step`-th batch starts."""
        return step * batch_size // self.n


def load_prompts(
    source: str | os.PathLike | Sequence[Mapping[str, Any]],
    split: str = "train",
    prompt_column: str = "prompt",
    subset: str | None = None,
    max_rows: int | None = None,
) -> PromptDataset:
    """Load a prompt dataset from a file, a list of dicts, or (only when asked) the Hugging Face hub.

    Args:
        source: a local `.jsonl` (one object per line), `.json` (a list of objects, or a
            {column: [values]} object) or `.parquet` file; a list of dicts; or a hub dataset name
            such as "openai/gsm8k", downloaded with `datasets.load_dataset`.
        split: the split of a hub dataset; a local file is a single split and ignores it.
        prompt_column: the column holding the prompt (a string or a list of messages).
        subset: the configuration of a hub dataset (e.g. "main" for gsm8k).
        max_rows: keep only the first `max_rows` rows (quick runs).

    Returns:
        A `PromptDataset` that keeps every column.

    Raises:
        ValueError: the file does not exist or has an unsupported extension, the dataset has no
            rows, the prompt column is missing, or a row's prompt is not a string or a list of messages.
    """
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows: must be >= 1, got {max_rows}")
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if isinstance(source, os.PathLike) or _looks_like_file(text):
            path = Path(text).expanduser()
            if not path.is_file():
                raise ValueError(f"data.source: file not found: {text!r}")
            readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
            if path.suffix not in readers:
                raise ValueError(
                    f"data.source: {text!r} has an unsupported extension; use one of {list(FILE_FORMATS)}"
                )
            rows, name = readers[path.suffix](path), text
        else:
            rows, name = _read_hub(text, split, subset), f"{text}:{split}"
    elif isinstance(source, Sequence):
        rows, name = list(source), "<in-memory>"
    else:
        raise TypeError(
            f"source: expected a path, a hub dataset name or a list of dicts, got {type(source).__name__}"
        )
    if max_rows is not None:
        rows = rows[:max_rows]
    return PromptDataset(rows, prompt_column=prompt_column, name=name)
