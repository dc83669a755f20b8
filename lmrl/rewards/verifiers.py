"""Built-in verifiable rewards: math answers, exact match, format / regex checks, length penalties.

Each is a small factory returning a reward function `fn(prompts, completions, **kwargs)` whose
`__name__` is the name its metrics are logged under. A completion is a string, or for a chat prompt
the assistant message `[{"role": "assistant", "content": text}]`: both are read as their text. Model outputs are untrusted: nothing here
evals or execs them; math answers are parsed by math-verify (a LaTeX / sympy parser).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmrl.rewards.core import completion_text
from lmrl.rewards.math_verifier import MathVerifyWorker, verify_answer
from lmrl.rewards.shaping import overlong_penalty

DEFAULT_ANSWER_COLUMNS = ("answer", "solution")
THINK_ANSWER_PATTERN = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__name__ = fn.__qualname__ = name
    return fn


def _pick_column(kwargs: dict[str, Any], column: str | None, candidates: Sequence[str], who: str) -> list[Any]:
    if column is not None:
        if column not in kwargs:
            raise ValueError(f"{who}: column {column!r} not found; available: {sorted(kwargs)}")
        return kwargs[column]
    for name in candidates:
        if name in kwargs:
            return kwargs[name]
    raise ValueError(f"{who}: no ground-truth column (looked for {list(candidates)}); available: {sorted(kwargs)}")


def math_reward(
    column: str | None = None,
    *,
    require_anchor: bool = True,
    timeout_seconds: int = 5,
    isolate: bool = True,
    name: str = "math",
) -> Callable[..., list[float | None]]:
    """Reward 1.0 when the completion's final answer equals the ground truth mathematically, else 0.0.

    The completion's answer is the last `\\boxed{...}`, a GSM8K `#### X` line, an
    `<answer>X</answer>` block or a "The answer is X" line; the ground truth is read the same way (a
    GSM8K solution ending in "#### 72" gives 72; a bare "72" or "\\frac{1}{2}" is used as is). Both
    are parsed and compared by math-verify (`parse`, `verify`), so 0.5 == \\frac{1}{2} and
    1,000 == 1000. math-verify only pattern-matches and builds sympy expressions: nothing the model
    wrote is executed.

    Args:
        column: the ground-truth column; None tries "answer", then "solution".
        require_anchor: when True (default) a completion with no final-answer marker scores 0;
            when False math-verify searches the whole text (rewarding the last number written).
        timeout_seconds: math-verify's own parse / verify timeouts.
        isolate: check answers in a worker process (default) that is killed and restarted when an
            answer overruns its deadline (3 * timeout_seconds + 2 s; it then scores 0.0). In-process
            checking (`isolate=False`) is faster to start but an adversarial answer can freeze
            the whole process, and off the main thread it runs without timeouts.
        name: metric name.

    Returns:
        A reward function (with the worker as its `worker` attribute, or None); a sample whose
        ground truth is missing or unparseable gets None.
    """
    worker = MathVerifyWorker(timeout_seconds) if isolate else None
    if not isolate:
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" off the main thread

    def fn(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        golds = _pick_column(kwargs, column, DEFAULT_ANSWER_COLUMNS, name)
        completions = [completion_text(c) for c in completions]
        if worker is not None:
            return [worker(g, c, require_anchor=require_anchor) for c, g in zip(completions, golds, strict=True)]
        return [
            verify_answer(g, c, require_anchor=require_anchor, timeout_seconds=timeout_seconds)
            for c, g in zip(completions, golds, strict=True)
        ]

    fn.worker = worker  # type: ignore[attr-defined]
    fn.columns = [] if column is None else [column]  # type: ignore[attr-defined]  # see required_columns
    return _named(fn, name)


def _normalize_ws(text: str) -> str:
    return " ".join(str(text).split())


def exact_match_reward(
    column: str | None = None,
    *,
    extract: str | None = None,
    case_sensitive: bool = True,
    name: str = "exact_match",
) -> Callable[..., list[float | None]]:
    """Reward 1.0 when the completion equals the ground truth after whitespace normalisation, else 0.0.

    Whitespace is stripped at both ends and collapsed to single spaces on both sides.

    Args:
        column: the ground-truth column; None tries "answer", then "solution".
        extract: optional regex; when given, only its first group (or whole match) of the
            completion is compared, and a completion without a match scores 0.
        case_sensitive: compare case-sensitively (default) or not.
        name: metric name.

    Returns:
        A reward function; a sample whose ground truth is None gets None.
    """
    pattern = re.compile(extract, re.DOTALL) if extract is not None else None

    def fn(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        golds = _pick_column(kwargs, column, DEFAULT_ANSWER_COLUMNS, name)
        out: list[float | None] = []
        for completion, gold in zip(map(completion_text, completions), golds, strict=True):
            if gold is None:
                out.append(None)
                continue
            text = completion
            if pattern is not None:
                m = pattern.search(completion)
                if m is None:
                    out.append(0.0)
                    continue
                text = m.group(1) if m.groups() else m.group(0)
            a, b = _normalize_ws(text), _normalize_ws(gold)
            if not case_sensitive:
                a, b = a.casefold(), b.casefold()
            out.append(1.0 if a == b else 0.0)
        return out

    fn.columns = [] if column is None else [column]  # type: ignore[attr-defined]  # see required_columns
    return _named(fn, name)


def regex_reward(
    pattern: str, *, mode: str = "search", flags: int = re.DOTALL, name: str = "regex"
) -> Callable[..., list[float]]:
    """Reward 1.0 when the completion matches `pattern`, else 0.0.

    Args:
        pattern: a Python regular expression.
        mode: "search" (anywhere), "match" (at the start) or "fullmatch" (the whole completion).
        flags: re flags; DOTALL by default so that `.` spans lines.
        name: metric name.
    """
    if mode not in ("search", "match", "fullmatch"):
        raise ValueError(f"mode: expected 'search', 'match' or 'fullmatch', got {mode!r}")
    try:
        compiled = re.compile(pattern, flags)
    except re.error as e:
        raise ValueError(f"pattern: invalid regular expression {pattern!r}: {e}") from None
    match = getattr(compiled, mode)

    def fn(prompts: list[Any], completions: list[str], **kwargs: Any) -> list[float]:
        return [1.0 if match(completion_text(c)) else 0.0 for c in completions]

    return _named(fn, name)


def format_reward(pattern: str = THINK_ANSWER_PATTERN, *, name: str = "format") -> Callable[..., list[float]]:
    """Reward 1.0 for completions in the `<think>...</think><answer>...</answer>` format (or `pattern`).

    The default pattern (DeepSeek-R1 style) must match the whole completion; whitespace between
    and around the blocks is allowed.
    """
    return regex_reward(pattern, mode="fullmatch", name=name)


def length_penalty_reward(
    max_length: int,
    cache_length: int = 0,
    *,
    unit: str = "tokens",
    name: str = "length",
) -> Callable[..., list[float]]:
    """DAPO's soft overlong penalty as a reward function: 0 up to max_length - cache_length, then
    falling linearly to -1 at max_length, -1 beyond (see `shaping.overlong_penalty`).

    Args:
        max_length: L_max.
        cache_length: L_cache, the width of the soft band (0 = hard -1 beyond max_length).
        unit: "tokens" (length of the `completion_ids` argument, which lmrl passes) or "chars".
        name: metric name.
    """
    if unit not in ("tokens", "chars"):
        raise ValueError(f"unit: expected 'tokens' or 'chars', got {unit!r}")
    overlong_penalty(torch.zeros(1), max_length, cache_length)  # validate the arguments now

    def fn(prompts: list[Any], completions: list[str], **kwargs: Any) -> list[float]:
        if unit == "tokens":
            if kwargs.get("completion_ids") is None:
                raise ValueError(f"{name}: unit='tokens' needs the completion_ids argument; use unit='chars'")
            lengths = [len(ids) for ids in kwargs["completion_ids"]]
        else:
            lengths = [len(completion_text(c)) for c in completions]
        return overlong_penalty(torch.tensor(lengths), max_length, cache_length).tolist()

    return _named(fn, name)
