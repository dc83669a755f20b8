"""Every error line a page quotes is one lmrl prints: it matches one of lmrl's message templates (its string and
f-string literals, each `{...}` any value: a page's example values may differ from a test's), or it is a line the
bad-inputs table (tests/test_bad_inputs.py) asserts for a real run. A reworded message leaves the page's line
matching nothing, and this test names the page and line."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from tests.docs.examples import ROOT, pages

MIN_TEXT = 12  # characters a string literal needs to count as a message template
MIN_F_TEXT = 7  # characters of fixed text, in one piece, an f-string needs ("{name} index {i}")
GREEDY_TEXT = 25  # an f-string with this much fixed text may end in a value of any length (a list: "a, b, c")
PREFIX = "lmrl: error: "
STEP_AND_RANK = r"(rank \d+: )?(step \d+: )?"  # put before a message by the run's loop and under torchrun


@functools.cache
def templates() -> list[re.Pattern]:
    """lmrl's string literals as patterns (and argparse's, whose lines the CLI prints): an f-string's `{...}` and a
    `%s` match any value."""
    import argparse

    out = []
    for path in [*(ROOT / "lmrl").rglob("*.py"), Path(argparse.__file__)]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                fixed = [v.value for v in node.values if isinstance(v, ast.Constant)]
                if max(map(len, fixed), default=0) >= MIN_F_TEXT:  # not `f"{key}: {message} (got {value})"`
                    last = len(node.values) - 1 if sum(map(len, fixed)) >= GREEDY_TEXT else -1
                    out.append("".join(re.escape(v.value) if isinstance(v, ast.Constant) else "(.+)" if i == last
                                       else "(.+?)" for i, v in enumerate(node.values)))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= MIN_TEXT:
                out.append(re.sub(r"%(\\\(\w+\\\))?[sdr]", "(.+?)", re.escape(node.value)))
    return [re.compile(t, re.S) for t in out]


@functools.cache
def table_lines() -> list[str]:
    from tests.test_bad_inputs import BAD

    return [b.line.replace("{url}", "http://127.0.0.1:PORT") for b in BAD.values()]


def is_printed(line: str) -> bool:
    """Whether lmrl prints `line`: every word of it lies in a match of lmrl's message templates or of a line the
    bad-inputs table asserts (a message is often two templates joined: `data.path: f.jsonl line 5: ` + the
    row's problem). A page's `...` and `<...>` stand for parts left out."""
    line = PREFIX + line  # some templates hold the prefix (the CLI's own lines)
    known = len(PREFIX) + len(re.match(STEP_AND_RANK, line[len(PREFIX):]).group(0))
    covered = [True] * known + [False] * (len(line) - known)
    for hole in re.finditer(r"\.\.\.|<[^>]+>", line):
        covered[hole.start():hole.end()] = [True] * (hole.end() - hole.start())
    for pattern in [*templates(), *(re.compile(re.escape(known)) for known in table_lines())]:
        for m in pattern.finditer(line):
            if m.end() - m.start() >= MIN_TEXT:
                covered[m.start():m.end()] = [True] * (m.end() - m.start())
    bare = "".join(" " if done else ch for ch, done in zip(line, covered))
    return not re.search(r"[A-Za-z]{2,}", bare)


def quoted_lines() -> list[tuple[str, str]]:
    """(page:line, the quoted line without its `lmrl: error: `): spans and text lines that start with it, and the
    second column of the bad-inputs page's tables (console blocks aside: test_examples runs them)."""
    out = []
    for page in pages():
        transcript = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            where = f"{page.relative_to(ROOT)}:{n}"
            if line.startswith("```"):  # a console block's lines are compared with a real run's (test_examples)
                transcript = line == "```console"
            if transcript:
                continue
            spans = re.findall(r"`([^`]+)`", line)
            if page.name == "bad-inputs.md" and line.startswith("| ") and not line.startswith("| ---"):
                cells = line.strip("|").split(" | ")
                spans = re.findall(r"`([^`]+)`", cells[1]) if len(cells) > 1 and cells[0].strip() != "input" else []
                out += [(where, s.removeprefix("lmrl: error: ")) for s in spans if " " in s]
                continue
            out += [(where, s.removeprefix("lmrl: error: ")) for s in spans if s.startswith("lmrl: error: ")]
            if line.startswith("lmrl: error: "):
                out.append((where, line.removeprefix("lmrl: error: ")))
    return out


def test_every_error_line_a_page_quotes_is_one_lmrl_prints():
    quoted = quoted_lines()
    assert len(quoted) >= 90
    stale = [f"{where}: {line}" for where, line in quoted if not is_printed(line)]
    assert not stale, "\n".join(stale)


def test_a_reworded_line_is_caught():
    real = "train.resume: runs/a/checkpoint-3 is not a complete checkpoint (no COMPLETE file in it)"
    assert is_printed(real)
    assert not is_printed(real.replace("is not a complete", "is an incomplete"))
    assert not is_printed("rollout.group_size: needs two or more for the grpo advantage (got 1)")
