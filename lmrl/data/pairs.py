"""Preference pairs for reward-model training: `chosen` / `rejected`, an optional `prompt` and `margin`.

The row formats TRL's RewardTrainer takes:

    {"prompt": "2+2=", "chosen": "4", "rejected": "5"}                           explicit prompt, text
    {"chosen": "2+2=4", "rejected": "2+2=5"}                                     implicit prompt, text
    {"prompt": [{"role": "user", "content": "2+2?"}],
     "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}         explicit prompt, chat
    {"chosen": [user, assistant "4"], "rejected": [user, assistant "5"]}         implicit prompt, chat

An implicit prompt is what the two sides share, as TRL extracts it: the longest common prefix of the two
strings (a space just before the first difference stays with the completions), or the messages both
conversations start with, after which each side must be one assistant message. A `margin` column (a number)
is how much the chosen side should win by (`lmrl.algorithms.bradley_terry_loss`).

A pair is rendered and tokenized exactly as `RewardModelScorer` scores a (prompt, completion)
(`lmrl.rewards.reward_model.encode_scored`), so the model learns on the very token ids it is later asked
to score. Unlike TRL, no EOS is appended to text pairs: the scorer does not append one either.

Bad rows are found before a model loads (`load_pairs`) and name the file, row and field in one line; a pair
longer than `max_length` tokens is found once the tokenizer is there (`encode_pairs`) and is left out and
counted, refused, or cut from the left as the scorer cuts it (`on_too_long`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lmrl.data.prompts import read_rows
from lmrl.data.row_checks import ON_BAD_ROW, BadRow, _bad_rows_message, _short_repr
from lmrl.errors import DataError
from lmrl.rewards.reward_model import encode_scored

ON_TOO_LONG = ("skip", "fail", "truncate")


@dataclass(frozen=True)
class Pair:
    """One preference pair: a prompt (a string or chat messages), the two completions, the optional margin and
    where the row came from ("pairs.jsonl line 3")."""

    prompt: str | list[dict[str, str]]
    chosen: str
    rejected: str
    margin: float | None
    where: str


@dataclass
class Pairs:
    """Checked pairs and the rows left out (`on_bad_row="skip"`)."""

    pairs: list[Pair]
    skipped: list[BadRow] = field(default_factory=list)
    name: str = "dataset"

    def __len__(self) -> int:
        return len(self.pairs)


@dataclass
class EncodedPairs:
    """Pairs as token ids (`encode_pairs`), in order, and how many were too long.

    Attributes:
        chosen: token ids of each pair's prompt + chosen completion.
        rejected: token ids of each pair's prompt + rejected completion.
        margins: each pair's margin (0.0 where the data has none).
        has_margin: the data had a margin column.
        where: where each pair came from.
        too_long: pairs left out as longer than `max_length` (`on_too_long="skip"`).
        truncated: pairs cut to `max_length` (`on_too_long="truncate"`).
    """

    chosen: list[list[int]]
    rejected: list[list[int]]
    margins: list[float]
    has_margin: bool
    where: list[str]
    too_long: int = 0
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.chosen)

    def subset(self, indices: Sequence[int]) -> EncodedPairs:
        return EncodedPairs([self.chosen[i] for i in indices], [self.rejected[i] for i in indices],
                            [self.margins[i] for i in indices], self.has_margin, [self.where[i] for i in indices])


def _is_messages(value: Any) -> bool:
    return (isinstance(value, list) and len(value) > 0
            and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value))


def _common_text_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    if 0 < n < min(len(a), len(b)) and a[n - 1] == " ":  # as TRL: the space before the difference is the answer's
        n -= 1
    return n


def _one_assistant(messages: list, side: str) -> str:
    """The content of `messages` when it is one assistant message, else a problem raised as ValueError."""
    if len(messages) != 1 or messages[0].get("role") != "assistant":
        roles = ", ".join(str(m.get("role")) for m in messages) or "none"
        raise ValueError(f"{side}: after the prompt, expected one assistant message, got {len(messages)} "
                         f"({roles})")
    return messages[0]["content"]


def _split_row(row: Mapping[str, Any], prompt_column: str) -> tuple[Any, str, str]:
    """(prompt, chosen, rejected) of a row, or ValueError naming the field and what is wrong."""
    for side in ("chosen", "rejected"):
        if row.get(side) is None:
            raise ValueError(f"missing {side!r}")
        value = row[side]
        if not (isinstance(value, str) or _is_messages(value)):
            raise ValueError(f"{side}: expected a string or a list of {{role, content}} messages, got "
                             f"{_short_repr(value)}")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get(prompt_column)
    if prompt is not None:  # explicit prompt
        if isinstance(prompt, str):
            if not (isinstance(chosen, str) and isinstance(rejected, str)):
                raise ValueError(f"{prompt_column} is text, so chosen and rejected must be text too")
            return prompt, chosen, rejected
        if not _is_messages(prompt):
            raise ValueError(f"{prompt_column}: expected a string or a list of {{role, content}} messages, got "
                             f"{_short_repr(prompt)}")
        sides = [c if isinstance(c, str) else _one_assistant(c, name)
                 for c, name in ((chosen, "chosen"), (rejected, "rejected"))]
        return prompt, sides[0], sides[1]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ValueError("chosen and rejected: one is text and the other chat messages")
    if isinstance(chosen, str):  # implicit prompt: the common prefix
        n = _common_text_prefix(chosen, rejected)
        return chosen[:n], chosen[n:], rejected[n:]
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise ValueError("chosen and rejected share no first message, so there is no prompt; give a prompt column")
    return list(chosen[:n]), _one_assistant(chosen[n:], "chosen"), _one_assistant(rejected[n:], "rejected")


def _pair_of(row: Any, where: str, prompt_column: str, margin_column: str) -> Pair:
    if not isinstance(row, Mapping):
        raise ValueError(f"expected an object with chosen and rejected, got {_short_repr(row)}")
    prompt, chosen, rejected = _split_row(row, prompt_column)
    if not chosen.strip():
        raise ValueError("chosen: the completion is empty")
    if not rejected.strip():
        raise ValueError("rejected: the completion is empty")
    if chosen == rejected:
        raise ValueError("chosen == rejected: a pair needs two different completions")
    margin = row.get(margin_column)
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not math.isfinite(margin)):
        raise ValueError(f"{margin_column}: expected a finite number, got {_short_repr(margin)}")
    return Pair(prompt, chosen, rejected, None if margin is None else float(margin), where)


def load_pairs(
    source: str | os.PathLike | Sequence[Mapping[str, Any]],
    *,
    split: str = "train",
    prompt_column: str = "prompt",
    margin_column: str = "margin",
    on_bad_row: Literal["fail", "skip"] = "fail",
    field: str | None = None,
    name: str | None = None,
) -> Pairs:
    """Read and check preference pairs from a `.jsonl`, `.json` or `.parquet` file, a saved dataset, a hub dataset
    or a list of dicts.

    Args:
        source: where the rows are (as `lmrl.data.load_prompts` takes them).
        split: the split of a hub or saved dataset.
        prompt_column: the explicit prompt's column; a row without it has an implicit prompt.
        margin_column: the optional per-pair margin's column.
        on_bad_row: "fail" raises on the first bad row (counting the others); "skip" leaves bad rows out.
        field: the config field that named the source, which starts error messages ("data.path").
        name: how a list's rows are named ("NAME index N").

    Raises:
        DataError: one line naming the file, row and field: a missing side, a side that is not text or
            messages, an empty side, chosen == rejected, a margin that is not a number; or no rows at all.
    """
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row: must be one of {', '.join(ON_BAD_ROW)}, got {on_bad_row!r}")
    rows, where, name = read_rows(source, split, field=field, name=name)
    field = field or ("data.path" if isinstance(source, (str, os.PathLike)) else None)
    if not rows:
        raise DataError(f"{field + ': ' if field else ''}{name} has no rows")
    pairs, bad = [], []
    for row, at in zip(rows, where, strict=True):
        try:
            pairs.append(_pair_of(row, at, prompt_column, margin_column))
        except ValueError as e:
            bad.append(BadRow(at, str(e)))
    if bad and (on_bad_row == "fail" or not pairs):
        raise DataError(_bad_rows_message(field, bad, len(pairs)))
    return Pairs(pairs, bad, name)


def encode_pairs(
    pairs: Sequence[Pair],
    tokenizer: Any,
    max_length: int | None,
    on_too_long: Literal["skip", "fail", "truncate"] = "skip",
    field: str = "data.path",
) -> EncodedPairs:
    """Token ids of each pair's two sides, exactly as `RewardModelScorer` encodes them.

    Args:
        pairs: checked pairs (`load_pairs`).
        tokenizer: the reward model's tokenizer.
        max_length: the longest side in tokens; None is no limit.
        on_too_long: a pair with a side longer than `max_length`: "skip" leaves it out (counted in
            `too_long`), "fail" raises, "truncate" keeps each side's last `max_length` tokens as the scorer
            does with the same `max_length` (the prompt's start is lost, the completion kept).
        field: the config field the pairs came from, which starts an error.

    Raises:
        DataError: a pair is too long and `on_too_long` is "fail", or every pair is.
    """
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(f"on_too_long: must be one of {', '.join(ON_TOO_LONG)}, got {on_too_long!r}")
    limit = max_length if on_too_long == "truncate" else None
    out = EncodedPairs([], [], [], any(p.margin is not None for p in pairs), [])
    long: list[BadRow] = []
    for p in pairs:
        full = [encode_scored(tokenizer, p.prompt, side) for side in (p.chosen, p.rejected)]
        longest = max(len(ids) for ids in full)
        if max_length is not None and longest > max_length:
            if on_too_long != "truncate":
                long.append(BadRow(p.where, f"the pair is {longest} tokens, longer than data.max_length={max_length}"))
                continue
            out.truncated += 1
            full = [ids[-limit:] for ids in full]
        out.chosen.append(full[0])
        out.rejected.append(full[1])
        out.margins.append(p.margin or 0.0)
        out.where.append(p.where)
    out.too_long = len(long)
    if long and (on_too_long == "fail" or not out.chosen):
        first, others = long[0], long[1:]
        msg = f"{field}: {first.where}: {first.problem}"
        if others:
            msg += f" ({len(others)} other pair{'s' if len(others) > 1 else ''} too long)"
        if not out.chosen:
            msg += "; every pair is too long"
        raise DataError(msg + "; raise data.max_length, or set data.on_too_long=skip to leave them out "
                        "or data.on_too_long=truncate to keep their last tokens")
    return out
