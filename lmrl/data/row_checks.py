"""Row checks of prompt datasets: what makes a row bad, and the one-line error that names it.

Every row is checked before a model loads (`check_rows`: the row is an object, its prompt is a
non-blank string or chat messages, the columns rewards need are there, the prompt fits
`rollout.max_prompt_length`), and an error says where the row came from: `FILE line N` for JSONL
(the file's real line, blank lines counted), `FILE item N` for a JSON list, `FILE row N` for a JSON
column table, a parquet file or a hub split, `NAME index N` for rows in memory (all 0-based but
JSONL lines). A bad row stops the run with one line naming the first bad row in full and counting
the others (`on_bad_row="fail"`), or is left out and listed (`"skip"`). `lmrl.data.prompts` reads
and streams rows and `lmrl.data.pairs` preference pairs; both check them here.

Importing this module does not import torch (the CLI checks data first).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from lmrl.data.images import ImageInputs, image_problem, row_images
from lmrl.errors import DataError

ON_BAD_ROW = ("fail", "skip")

# prompts per call of a `prompt_length` function: enough for a fast tokenizer to batch, few enough to bound memory
_LENGTH_BATCH = 1024
# bad rows an error names after the first one; the rest are only counted
_OTHERS_NAMED = 3

PromptLength = Callable[[list[Any]], Sequence[int]]
"""Token counts of a batch of prompts (strings or message lists), one int per prompt, in order."""


class BadRow(NamedTuple):
    """A row that failed a check: where it came from (e.g. "train.jsonl line 600") and what is wrong."""

    where: str
    problem: str


@dataclass(frozen=True)
class CheckedRows:
    """What `check_rows` kept and what it left out.

    Attributes:
        rows: the rows that passed every check, in their order (the caller's objects, not copies).
        where: where each kept row came from, parallel to `rows`.
        skipped: the rows left out, in their order (always empty with `on_bad_row="fail"`).
    """

    rows: list[Mapping[str, Any]]
    where: list[str]
    skipped: list[BadRow]


@runtime_checkable
class LocatedRows(Protocol):
    """Rows that know their prompt column, their name and where each came from: a `PromptDataset`
    (a protocol, so that this module need not import `lmrl.data.prompts`, which imports it)."""

    rows: list[Mapping[str, Any]]
    prompt_column: str
    name: str

    def where(self, index: int) -> str: ...


def _short_repr(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _prompt_problem(prompt: Any) -> str | None:
    """What is wrong with a prompt, or None: a non-blank string, or messages with some non-blank content (a
    string, or a list of text and image parts: `lmrl.data.images`; an image part counts as content)."""
    if isinstance(prompt, str):
        if not prompt:
            return "prompt is empty"
        return "prompt is only whitespace" if prompt.isspace() else None
    if not isinstance(prompt, (list, tuple)):
        return (
            "prompt must be a string or a list of {'role', 'content'} messages, "
            f"got {type(prompt).__name__}"
        )
    if not prompt:
        return "prompt is an empty list of messages"
    for k, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"prompt message {k} is a {type(message).__name__}, not a {{'role', 'content'}} object"
        missing = [key for key in ("role", "content") if key not in message]
        if missing:
            return f"prompt message {k} has no {' or '.join(map(repr, missing))}"
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role.strip():
            return f"prompt message {k}: role must be a non-empty string, got {_short_repr(role)}"
        if isinstance(content, list):
            problem = _parts_problem(content)
            if problem is not None:
                return f"prompt message {k} {problem}"
        elif not isinstance(content, str):
            return f"prompt message {k}: content must be a string, got {type(content).__name__}"
    if not any(_has_content(m["content"]) for m in prompt):
        return "prompt messages have no content (every one is empty or whitespace)"
    return None


def _parts_problem(parts: list[Any]) -> str | None:
    """What is wrong with a message's content parts (after "prompt message K"), or None."""
    if not parts:
        return "has an empty list of content parts"
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and not isinstance(part.get("text"), str):
            return f"part {j}: a text part needs a string 'text', got {type(part.get('text')).__name__}"
        if kind not in ("text", "image"):
            return f"part {j}: expected {{'type': 'text', 'text': ...}} or {{'type': 'image'}}, got {_short_repr(part)}"
    return None


def _has_content(content: str | list[Mapping[str, Any]]) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    return any(part["type"] == "image" or part["text"].strip() for part in content)


def _needed_by(rewards: Sequence[str] | str) -> str:
    names = [rewards] if isinstance(rewards, str) else list(rewards)
    if not names:
        return ""
    return f" (needed by reward{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))})"


RequiredColumns = Mapping[str, Sequence[str]] | Callable[[Mapping[str, Any]], Mapping[str, Sequence[str]] | str]
"""column -> names of the reward functions reading it, for every row; or a function of one row giving that
row's (with reward recipes, those of the row's recipe), or one line saying why the row cannot be scored."""


def _row_problem(
    row: Any, prompt_column: str, required_columns: RequiredColumns | None, images: ImageInputs | None = None
) -> str | None:
    """The first thing wrong with a row (shape, then prompt, then images, then required columns), or None."""
    if not isinstance(row, Mapping):
        return f"row is a {type(row).__name__}, not an object of columns"
    if prompt_column not in row:
        present = list(row)
        shown = f"{present[:10]}"[:-1] + ", ...]" if len(present) > 10 else f"{present}"
        return f"no prompt column {prompt_column!r}; columns present: {shown} (set data.prompt_column)"
    problem = _prompt_problem(row[prompt_column])
    if problem is None and images is not None:
        problem = image_problem(row, prompt_column, images)
    if problem is not None:
        return problem
    needed = required_columns(row) if callable(required_columns) else required_columns
    if isinstance(needed, str):
        return needed
    for column, rewards in (needed or {}).items():
        if row.get(column) is None:
            state = "missing" if column not in row else "None"
            return f"column {column!r}{_needed_by(rewards)} is {state}"
    return None


def _too_long(
    rows: Sequence[Mapping[str, Any]],
    indices: list[int],
    prompt_column: str,
    prompt_length: PromptLength,
    max_prompt_length: int,
    images: ImageInputs | None = None,
) -> list[tuple[int, str]]:
    """(index, problem) of the rows among `indices` whose prompt has more than `max_prompt_length` tokens (its
    images' tokens counted, as the processor expands them, where `images` says how), or that `prompt_length`
    refuses (a ValueError: e.g. a list of messages and a tokenizer without a chat template)."""
    counted = images.image_tokens if images is not None else None
    out = []
    for start in range(0, len(indices), _LENGTH_BATCH):
        chunk = indices[start : start + _LENGTH_BATCH]
        try:
            lengths: list[int | str] = list(prompt_length([rows[i][prompt_column] for i in chunk]))
        except ValueError:  # measure each row alone: the rows it refuses are bad rows, named by their location
            lengths = [_length_or_problem(prompt_length, rows[i][prompt_column]) for i in chunk]
        if len(lengths) != len(chunk):
            raise ValueError(f"prompt_length: returned {len(lengths)} lengths for {len(chunk)} prompts")
        for i, n in zip(chunk, lengths):
            shown = row_images(rows[i]) if counted is not None and not isinstance(n, str) else []
            n = n + counted(shown) if shown else n
            if shown and n <= max_prompt_length and images.measured is not None:
                images.measured(n)
            if isinstance(n, str) or n > max_prompt_length:
                what = " with its images" if shown else ""
                out.append((i, n if isinstance(n, str) else
                            f"prompt is {n} tokens{what}, longer than rollout.max_prompt_length={max_prompt_length}"))
    return out


def _length_or_problem(prompt_length: PromptLength, prompt: Any) -> int | str:
    try:
        return next(iter(prompt_length([prompt])))
    except ValueError as e:
        return str(e).replace("prompt 0 ", "prompt ", 1)


def _located(field: str | None, where: str) -> str:
    """`where` behind the config field it came from, unless `where` already starts with that name."""
    if not field or where == field or where.startswith(field + " "):
        return where
    return f"{field}: {where}"


def _after_source(where: str, first: str) -> str:
    """`where` without the source it shares with `first`: "train.jsonl line 40" -> "line 40"."""
    source = first.rsplit(" ", 2)[0] + " "
    return where[len(source) :] if first.count(" ") >= 2 and where.startswith(source) else where


def _bad_rows_message(field: str | None, bad: list[BadRow], kept: int) -> str:
    """One line: the first bad row in full, then how many others and where the first few are."""
    first, others = bad[0], bad[1:]
    msg = f"{_located(field, first.where)}: {first.problem}"
    if others:
        named = [_after_source(b.where, first.where) for b in others[:_OTHERS_NAMED]]
        more = ", ..." if len(others) > _OTHERS_NAMED else ""
        msg += f" ({len(others)} other bad row{'s' if len(others) > 1 else ''}: {', '.join(named)}{more})"
    if kept == 0:
        return msg + "; every row is bad, so there is nothing to train on"
    them = "them" if others else "it"
    return msg + f"; fix {them}, or set data.on_bad_row=skip to leave {them} out"


def check_rows(
    rows: Sequence[Any] | LocatedRows,
    *,
    prompt_column: str | None = None,
    required_columns: RequiredColumns | None = None,
    prompt_length: PromptLength | None = None,
    max_prompt_length: int | None = None,
    on_bad_row: Literal["fail", "skip"] = "fail",
    images: ImageInputs | None = None,
    field: str | None = None,
    name: str | None = None,
    where: Sequence[str] | None = None,
) -> CheckedRows:
    """Check every row of a prompt dataset, so bad input stops the run (or is left out) before training.

    Each row must be a mapping with the prompt column; the prompt a string that is not empty or only
    whitespace, or a non-empty list of {"role": str, "content": str or [text and image parts]} messages
    of which at least one has non-blank content; with `images`, its `image` / `images` open and match the
    prompt's placeholders, and a text-only model gets none (`lmrl.data.images.image_problem`); each of
    `required_columns` present and not None; and, with `prompt_length`, at most `max_prompt_length`
    tokens long. A row's first problem is reported.

    Args:
        rows: the rows, or a `PromptDataset` (its prompt column, name and row locations are used).
        prompt_column: the column holding the prompt (default: the dataset's, else "prompt").
        required_columns: column -> names of the reward functions that read it, e.g.
            {"answer": ["math"]}; the names go into the message. Or a function of one row giving
            that row's columns, or one line saying what is wrong with the row
            (`lmrl.rewards.RewardRecipes.row_columns`: the columns of the row's recipe).
        prompt_length: token counts of a *list* of prompts (called with up to 1024 prompts at a
            time, only for rows that passed the other checks), e.g.
            `lambda ps: [len(ids) for ids in encode_prompts(tok, ps, 10**9)]`.
        max_prompt_length: the longest prompt in tokens (`rollout.max_prompt_length`); needed
            with `prompt_length`.
        on_bad_row: "fail" raises on any bad row; "skip" leaves bad rows out and lists them in
            `CheckedRows.skipped` (the caller warns once with the count).
        images: what the model takes besides text (its image token, or None for a text-only model);
            None: images are not checked (the model is not known yet; `lmrl.build` checks them).
        field: the config field or argument the rows came from ("data.path", "data.eval_path",
            "train_dataset", ...); it starts the error message.
        name: how row locations name in-memory rows ("NAME index N"; default: `field`, else
            "dataset"); ignored when `where` is given or `rows` is a `PromptDataset`.
        where: where each row came from (e.g. "train.jsonl line 12"), parallel to `rows`.

    Returns:
        The kept rows with their locations, and the skipped ones.

    Raises:
        DataError: there are no rows; a row is bad and `on_bad_row` is "fail"; or every row is bad.
            One line, e.g. `data.path: train.jsonl line 600: prompt is 812 tokens, longer than
            rollout.max_prompt_length=512 (3 other bad rows: line 12, line 40, line 77); fix them,
            or set data.on_bad_row=skip to leave them out`.
        ValueError: a bad argument (`on_bad_row`, `where` of the wrong length, `prompt_length`
            without `max_prompt_length` or returning the wrong number of lengths).
    """
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row: must be one of {', '.join(ON_BAD_ROW)}, got {on_bad_row!r}")
    if prompt_length is not None and max_prompt_length is None:
        raise ValueError("max_prompt_length: needed to check prompt lengths")
    if isinstance(rows, LocatedRows):
        prompt_column = prompt_column or rows.prompt_column
        name = rows.name
        where = where if where is not None else [rows.where(i) for i in range(len(rows))]
        rows = rows.rows
    prompt_column = prompt_column or "prompt"
    name = name or field or "dataset"
    if where is None:
        where = [f"{name} index {i}" for i in range(len(rows))]
    elif len(where) != len(rows):
        raise ValueError(f"where: {len(where)} locations for {len(rows)} rows")
    if len(rows) == 0:
        raise DataError(f"{_located(field, name)} has no rows")

    bad: list[tuple[int, str]] = []
    good: list[int] = []
    for i, row in enumerate(rows):
        problem = _row_problem(row, prompt_column, required_columns, images)
        if problem is None:
            good.append(i)
        else:
            bad.append((i, problem))
    if prompt_length is not None and good:
        too_long = _too_long(rows, good, prompt_column, prompt_length, max_prompt_length, images)
        if too_long:
            dropped = {i for i, _ in too_long}
            good = [i for i in good if i not in dropped]
            bad = sorted(bad + too_long)

    skipped = [BadRow(where[i], problem) for i, problem in bad]
    if skipped and (on_bad_row == "fail" or not good):
        raise DataError(_bad_rows_message(field, skipped, len(good)))
    return CheckedRows(rows=[rows[i] for i in good], where=[where[i] for i in good], skipped=skipped)
