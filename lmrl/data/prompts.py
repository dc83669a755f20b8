"""Prompt datasets: rows with a prompt column plus any other columns, and a resumable sampler.

A row is a dict. Its prompt is a string, or a chat conversation: a list of {"role", "content"}
messages (encoded with the tokenizer's chat template, see `lmrl.models.prompt_encoding.encode_prompts`).
Every other column (e.g. `answer`) is kept and passed to reward functions by name.

The sampler's order is a pure function of (seed, position): epoch e is the permutation drawn from a
generator seeded with (seed, e), and the step-th batch of size b is positions [s*b, (s+1)*b) of the
concatenated epochs. A resumed run that knows its step (or the number of prompts consumed) draws
exactly the prompts the interrupted run would have drawn, without replaying anything.

Every row is checked before a model loads, with a one-line error naming where it came from
(`lmrl.data.row_checks`, re-exported here: `check_rows`, `BadRow`, `CheckedRows`).

Importing this module does not import torch (the CLI checks data first); `PromptSampler` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lmrl.data.images import ImageInputs, resolve_image_paths
from lmrl.data.row_checks import (
    _LENGTH_BATCH,
    ON_BAD_ROW,
    BadRow,
    CheckedRows,
    PromptLength,
    RequiredColumns,
    _bad_rows_message,
    _row_problem,
    _too_long,
    check_rows,
)
from lmrl.errors import DataError

FILE_FORMATS = (".jsonl", ".json", ".parquet")
# Distinct seeds must not share epochs: with `seed + epoch`, seed=1 would replay epoch 1 of seed=0.
_EPOCH_STRIDE = 1_000_003


def _looks_like_file(source: str) -> bool:
    return (
        source.endswith(FILE_FORMATS)
        or os.path.exists(source)
        or source.startswith(("/", ".", "~"))
        or source.count("/") > 1
    )


def _read_saved(path: Path, label: str, split: str, field: str) -> tuple[list[Any], list[str]]:
    """The rows of a directory `datasets.Dataset.save_to_disk` (or a DatasetDict's) wrote, and where each is."""
    dataset, label = _load_saved(path, label, split, field)
    return list(dataset), [f"{label} row {i}" for i in range(len(dataset))]


def _load_saved(path: Path, label: str, split: str, field: str) -> tuple[Any, str]:
    """The `datasets.Dataset` a save_to_disk directory holds (a DatasetDict gives `split`), and its label."""
    from datasets import load_from_disk

    try:
        dataset = load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - one line naming the directory
        raise DataError(f"{field}: {label}: cannot load the saved dataset: {type(e).__name__}: {e}") from e
    if isinstance(dataset, dict):  # a DatasetDict
        if split not in dataset:
            raise DataError(f"{field}: {label}: a saved DatasetDict without a {split!r} split; its splits: "
                            f"{', '.join(dataset)}")
        dataset, label = dataset[split], f"{label}:{split}"
    return dataset, label


def _read_jsonl(path: Path, label: str, field: str) -> tuple[list[Any], list[str]]:
    rows, where = [], []
    line_no = 0
    try:
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{field}: {label} line {line_no}: not valid JSON ({err.msg})") from err
                where.append(f"{label} line {line_no}")
    except UnicodeDecodeError as err:
        raise DataError(f"{field}: {label} line {line_no + 1}: not UTF-8 text") from err
    return rows, where


def _read_json(path: Path, label: str, field: str) -> tuple[list[Any], list[str]]:
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise DataError(f"{field}: {label} line {err.lineno}: not valid JSON ({err.msg})") from err
    except UnicodeDecodeError as err:
        raise DataError(f"{field}: {label}: not UTF-8 text") from err
    # Either a list of row objects, or a {column: [values]} table (what pandas' to_json writes).
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise DataError(f"{field}: {label}: columns have different lengths {sorted(lengths)}")
        names = list(data)
        rows = [dict(zip(names, values)) for values in zip(*data.values())]
        return rows, [f"{label} row {i}" for i in range(len(rows))]
    if not isinstance(data, list):
        raise DataError(
            f"{field}: {label}: expected a list of objects or a {{column: [values]}} object, "
            f"got {type(data).__name__}"
        )
    return data, [f"{label} item {i}" for i in range(len(data))]


def _read_parquet(path: Path, label: str, field: str) -> tuple[list[Any], list[str]]:
    import pyarrow as pa  # a dependency of `datasets`
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"{field}: {label}: not a readable parquet file ({reason})") from err
    return rows, [f"{label} row {i}" for i in range(len(rows))]


def open_stream(source: str, split: str = "train", field: str = "data.path") -> Any:
    """A local file, a saved dataset directory or a hub dataset as a `datasets.IterableDataset`, read lazily."""
    import datasets

    path = Path(source).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
            raise DataError(f"{field}: {source}: is a directory, expected a {'/'.join(FILE_FORMATS)} file or a "
                            "dataset saved with datasets' save_to_disk")
        return _load_saved(path, source, split, field)[0].to_iterable_dataset()  # memory-mapped, not read
    if not _looks_like_file(source):
        return datasets.load_dataset(source, split=split, streaming=True)
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    if not path.is_file():
        raise DataError(f"{field}: {source}: file not found")
    if path.suffix not in builders:
        raise DataError(f"{field}: {source}: unsupported extension {path.suffix!r}, expected a "
                        f"{'/'.join(FILE_FORMATS)} file")
    stream = datasets.load_dataset(builders[path.suffix], data_files=str(path), split="train", streaming=True)
    return stream.map(lambda row: resolve_image_paths(row, path.parent))  # image paths: relative to the file


def _read_hub(name: str, split: str, subset: str | None) -> list[dict[str, Any]]:
    import datasets

    return datasets.load_dataset(name, subset, split=split).to_list()


class PromptDataset(Sequence):
    """A checked list of rows, each with a prompt column; indexable and sized.

    Every row is checked on construction (see `check_rows`, fail mode): a bad row raises a one-line
    `DataError` naming it and counting the others.

    Args:
        rows: the rows (dicts); copied.
        prompt_column: the column that holds the prompt.
        name: how errors and logs name the dataset (a file's path, or e.g. "train_dataset").
        where: where each row came from (e.g. "train.jsonl line 12"); default "NAME index N".
        field: the config field the rows came from, which starts error messages (e.g. "data.path").
        skipped: rows left out before construction (`load_prompts(on_bad_row="skip")`), kept to report.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        prompt_column: str = "prompt",
        name: str = "dataset",
        *,
        where: Sequence[str] | None = None,
        field: str | None = None,
        skipped: Sequence[BadRow] = (),
    ):
        checked = check_rows(rows, prompt_column=prompt_column, field=field, name=name, where=where)
        self._keep(checked.rows, prompt_column, name, checked.where, skipped)

    @classmethod
    def _of_checked(cls, checked: CheckedRows, prompt_column: str, name: str) -> PromptDataset:
        """A dataset of rows `check_rows` has passed: a large file is not checked twice."""
        dataset = cls.__new__(cls)
        dataset._keep(checked.rows, prompt_column, name, checked.where, checked.skipped)
        return dataset

    def _keep(
        self,
        rows: Sequence[Mapping[str, Any]],
        prompt_column: str,
        name: str,
        where: list[str],
        skipped: Sequence[BadRow],
    ) -> None:
        self.rows = [dict(r) for r in rows]
        self.prompt_column = prompt_column
        self.name = name
        self.skipped = list(skipped)
        self._where = where
        columns: dict[str, None] = {}
        for row in self.rows:
            columns.update(dict.fromkeys(row))
        self._columns = list(columns)

    def where(self, index: int) -> str:
        """Where row `index` came from: "FILE line N", "FILE item N", "FILE row N" or "NAME index N"."""
        return self._where[index]

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
        import torch  # here, not at the top: checking data must not wait for torch

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


def is_stream(source: Any) -> bool:
    """Rows that can only be read in order: a `datasets.IterableDataset`, a generator, any iterable without
    a length (a list, a `datasets.Dataset` or a dict of columns is not)."""
    return (hasattr(source, "__iter__") and not hasattr(source, "__len__")
            and not isinstance(source, (str, bytes, Mapping)))


class PromptStream:
    """Prompt rows read in order from a stream as training asks for them, never held whole.

    The stream is the order: position k is the k-th good row of epoch 0, then of epoch 1 (the stream is
    read again, after `set_epoch(e)` when it has one, as a shuffled `datasets.IterableDataset` does), and
    so on, so a resumed run that knows its position reads the rows the stopped run would have read by
    reading past the earlier ones. Shuffle the stream itself (`IterableDataset.shuffle(seed, buffer_size)`)
    for a shuffled order. Rows are checked as they are read, in chunks, with the checks `check_rows` makes;
    `peek` checks the first ones before a model loads.

    Args:
        source: the stream (anything `is_stream` accepts). A one-pass iterable (a generator) cannot start
            a second epoch: reading past its end is a `DataError`.
        prompt_column, required_columns, prompt_length, max_prompt_length, on_bad_row, images: as in `check_rows`;
            with "skip" bad rows are left out and counted (`skipped`, `first_skipped`).
        name: how errors name the stream and its rows ("train_dataset", "train_dataset row 600").
    """

    def __init__(
        self,
        source: Any,
        *,
        prompt_column: str = "prompt",
        required_columns: RequiredColumns | None = None,
        prompt_length: PromptLength | None = None,
        max_prompt_length: int | None = None,
        on_bad_row: Literal["fail", "skip"] = "fail",
        images: ImageInputs | None = None,
        name: str = "train_dataset",
    ):
        if on_bad_row not in ON_BAD_ROW:
            raise ValueError(f"on_bad_row: must be one of {', '.join(ON_BAD_ROW)}, got {on_bad_row!r}")
        self.source, self.name, self.on_bad_row = source, name, on_bad_row
        self.prompt_column, self.required_columns = prompt_column, required_columns
        self.prompt_length, self.max_prompt_length = prompt_length, max_prompt_length
        self.images = images
        self.one_pass = iter(source) is source
        self.skipped = 0  # bad rows left out so far (on_bad_row="skip")
        self.first_skipped: BadRow | None = None
        self._epoch, self._read = 0, 0  # epoch being read, rows read of it (bad ones included)
        self._rows: Iterator[Any] = iter(source)
        self._buffer: list[Mapping[str, Any]] = []  # checked rows read ahead of the position
        self._position = 0  # the position of _buffer[0]
        self._good_in_epoch = 0

    def peek(self, count: int) -> list[Mapping[str, Any]]:
        """The first `count` rows (fewer when the first epoch is shorter), checked; reads ahead, consumes nothing."""
        self._fill(count, wrap=False)
        return list(self._buffer[:count])

    def rows_at(self, position: int, count: int) -> list[Mapping[str, Any]]:
        """The rows at positions [position, position + count). Positions only move forward."""
        if position < self._position:
            raise ValueError(f"position: a stream is read forward; {position} is behind {self._position}")
        self._fill(position - self._position + count, wrap=True)
        ahead = position - self._position
        out = self._buffer[ahead : ahead + count]
        del self._buffer[: ahead + count]
        self._position = position + count
        return out

    def batch(self, index: int, size: int) -> list[Mapping[str, Any]]:
        """The `index`-th batch (0-based) of `size` rows: positions [index * size, (index + 1) * size)."""
        return self.rows_at(index * size, size)

    def _fill(self, count: int, wrap: bool) -> None:
        while len(self._buffer) < count:
            chunk = []
            for row in self._rows:
                chunk.append(row)
                if len(chunk) == min(_LENGTH_BATCH, count - len(self._buffer)):
                    break
            if chunk:
                self._buffer.extend(self._checked(chunk))
                continue
            if not wrap:  # the first epoch is shorter than asked for
                if not self._buffer:
                    raise DataError(f"{self.name}: the stream has no rows")
                return
            self._next_epoch()

    def _next_epoch(self) -> None:
        if self._good_in_epoch == 0:
            raise DataError(f"{self.name}: the stream has no {'good ' if self._read else ''}rows"
                            + (f" ({self.skipped} left out as bad)" if self.skipped else ""))
        if self.one_pass:
            raise DataError(f"{self.name}: the stream ended after {self._read} rows and cannot be read again (a "
                            "generator); pass one that can (a datasets.IterableDataset, or a class whose __iter__ "
                            "starts over), or fewer train.steps")
        self._epoch += 1
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(self._epoch)
        self._rows, self._read, self._good_in_epoch = iter(self.source), 0, 0

    def _checked(self, chunk: list[Any]) -> list[Mapping[str, Any]]:
        start, self._read = self._read, self._read + len(chunk)
        where = [f"{self.name} row {start + i}" + (f" (epoch {self._epoch})" if self._epoch else "")
                 for i in range(len(chunk))]
        bad = [(i, p) for i, row in enumerate(chunk)
               if (p := _row_problem(row, self.prompt_column, self.required_columns, self.images)) is not None]
        good = [i for i in range(len(chunk)) if i not in dict(bad)]
        if self.prompt_length is not None and good:
            too_long = _too_long(chunk, good, self.prompt_column, self.prompt_length, self.max_prompt_length)
            good = [i for i in good if i not in dict(too_long)]
            bad = sorted(bad + too_long)
        if bad and self.on_bad_row == "fail":
            # `kept` counts this chunk's good rows, not the stream's: never "every row is bad" here
            raise DataError(_bad_rows_message(self.name, [BadRow(where[i], p) for i, p in bad], len(good) or 1))
        if bad:
            self.skipped += len(bad)
            self.first_skipped = self.first_skipped or BadRow(where[bad[0][0]], bad[0][1])
        self._good_in_epoch += len(good)
        return [chunk[i] for i in good]


def read_rows(
    source: str | os.PathLike | Sequence[Any],
    split: str = "train",
    subset: str | None = None,
    *,
    field: str | None = None,
    name: str | None = None,
) -> tuple[list[Any], list[str], str]:
    """The rows of a file, a saved dataset, a hub dataset or a list, where each came from, and the source's name
    (what `load_prompts` reads; `lmrl.data.pairs` reads preference pairs the same way). Rows are not checked."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        field = field or "data.path"
        if isinstance(source, os.PathLike) or _looks_like_file(text):
            path = Path(text).expanduser()
            saved = path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json"))
            if path.is_dir() and not saved:
                raise DataError(f"{field}: {text}: is a directory, expected a {'/'.join(FILE_FORMATS)} file "
                                "or a dataset saved with datasets' save_to_disk")
            if saved:
                rows, where = _read_saved(path, text, split, field)
                name = text
            elif not path.is_file():
                raise DataError(f"{field}: {text}: file not found")
            else:
                readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
                if path.suffix not in readers:
                    raise DataError(
                        f"{field}: {text}: unsupported extension {path.suffix!r}, "
                        f"expected a {'/'.join(FILE_FORMATS)} file"
                    )
                rows, where = readers[path.suffix](path, text, field)
                rows = [resolve_image_paths(row, path.parent) for row in rows]  # relative to the file
                name = text
        else:
            name = f"{text}:{split}"
            rows = _read_hub(text, split, subset)
            where = [f"{name} row {i}" for i in range(len(rows))]
    elif isinstance(source, Sequence):
        rows, name = list(source), name or field or "dataset"
        where = [f"{name} index {i}" for i in range(len(rows))]
    else:
        raise TypeError(
            f"source: expected a path, a hub dataset name or a list of dicts, got {type(source).__name__}"
        )
    return rows, where, name


def load_prompts(
    source: str | os.PathLike | Sequence[Mapping[str, Any]],
    split: str = "train",
    prompt_column: str = "prompt",
    subset: str | None = None,
    max_rows: int | None = None,
    *,
    field: str | None = None,
    name: str | None = None,
    on_bad_row: Literal["fail", "skip"] = "fail",
    required_columns: RequiredColumns | None = None,
    prompt_length: PromptLength | None = None,
    max_prompt_length: int | None = None,
    images: ImageInputs | None = None,
) -> PromptDataset:
    """Load a prompt dataset from a file, a list of dicts, or (only when asked) the Hugging Face hub.

    Every row (of the first `max_rows`) is checked with `check_rows` before this returns; pass the
    reward functions' columns and a prompt-length function to check those too, all in one pass, so
    one error counts every bad row.

    Args:
        source: a local `.jsonl` (one object per line), `.json` (a list of objects, or a
            {column: [values]} object) or `.parquet` file; a list of dicts; or a hub dataset name
            such as "openai/gsm8k", downloaded with `datasets.load_dataset`.
        split: the split of a hub dataset; a local file is a single split and ignores it.
        prompt_column: the column holding the prompt (a string or a list of messages).
        subset: the configuration of a hub dataset (e.g. "main" for gsm8k).
        max_rows: keep only the first `max_rows` rows (quick runs); later rows are not checked.
        field: the config field or argument that named the source, which starts error messages:
            default "data.path" for a file or hub name, none for a list (pass e.g. "data.eval_path",
            "train_dataset").
        name: how row locations name a list's rows ("NAME index N"; default `field`, else "dataset").
        on_bad_row, required_columns, prompt_length, max_prompt_length, images: as in `check_rows`; with
            "skip" the bad rows are left out and listed in the dataset's `skipped`.

    Returns:
        A `PromptDataset` that keeps every column and where each row came from (`where(i)`).

    Raises:
        DataError: one line naming the source: the file does not exist, is a directory, has an
            unsupported extension, is not valid JSON (with its line) or has no rows; or rows are bad
            (see `check_rows`).
    """
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows: must be >= 1, got {max_rows}")
    rows, where, name = read_rows(source, split, subset, field=field, name=name)
    field = field or ("data.path" if isinstance(source, (str, os.PathLike)) else None)
    if max_rows is not None:
        rows, where = rows[:max_rows], where[:max_rows]
    checked = check_rows(
        rows,
        prompt_column=prompt_column,
        required_columns=required_columns,
        prompt_length=prompt_length,
        max_prompt_length=max_prompt_length,
        on_bad_row=on_bad_row,
        images=images,
        field=field,
        name=name,
        where=where,
    )
    return PromptDataset._of_checked(checked, prompt_column, name)
