"""Render the pages' figures from the benchmark result files (benchmarks/results/*.json).

    python scripts/figures.py            # rewrite every figure region and value of README.md and docs/
    python scripts/figures.py --check    # list the regions that differ from their result files; exit 1 if any

A page shows a recorded table between two markers (blank lines around the content, so that Markdown sees
a table):

    <!-- figure: generation-tiny.epyc-avx2 -->

    (generated: the command, machine, date and versions, then the table)

    <!-- /figure -->

and a figure quoted in prose as `<!-- value: NAME.MACHINE KEY -->2.20x<!-- /value -->`, where KEY is one
of the file's `values`, `date`, `machine`, or `range:COLUMN[:TEXT]` (the smallest to the largest value of
that column, as the column writes it; with TEXT, over the rows that have a cell containing it). Everything between the markers is generated: edit the result file (or rerun its benchmark with
`--record`) and run this script, never the page.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MACHINES = ROOT / "docs" / "performance.md"
FIGURE = re.compile(r"^([ \t]*)<!-- figure: (\S+)( table)? -->\n.*?<!-- /figure -->", re.S | re.M)
VALUE = re.compile(r"<!-- value: (\S+) (.+?) -->(.*?)<!-- /value -->", re.S)
MARKER = re.compile(r"<!-- (figure|value):")


def pages(root: Path = ROOT) -> list[Path]:
    """The pages figures go on: README.md, docs/*.md and benchmarks/README.md (not the hidden pages a test of the docs
    writes into docs/ for a while: another test worker may be running it)."""
    docs = sorted(p for p in (root / "docs").glob("*.md") if not p.name.startswith("."))
    return [root / "README.md", *docs, root / "benchmarks" / "README.md"]


def shown(path: Path) -> Path:
    """A path as a message names it: from the repository's root when it is inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def load(name: str, results: Path = RESULTS) -> dict:
    path = results / f"{name}.json"
    if not path.is_file():
        raise KeyError(f"no result file {shown(path)}")
    return json.loads(path.read_text())


def cell(column: dict, value, row: dict | None = None) -> str:
    """A value as its column writes it; the format may also name other keys of the row ("{:.2f} s of {total}")."""
    if value is None or value == "":
        return ""
    try:
        return column["format"].format(value, **(row or {}))
    except (ValueError, TypeError, KeyError, IndexError):  # e.g. a typed-in string kept by a merge (recording.py)
        return str(value)


def caption(result: dict, page: Path) -> str:
    link = os.path.relpath(MACHINES, page.parent).replace(os.sep, "/") + "#machines"
    made = [f"commit {result['commit']}"] if result.get("commit") and not result.get("source") else []
    made += [f"{k} {v}" for k, v in result.get("versions", {}).items() if k != "python"]
    commands = [result["command"]] if isinstance(result["command"], str) else result["command"]
    quoted = [f"`{c}`" for c in commands]
    text = (", ".join(quoted[:-1]) + " and " * (len(quoted) > 1) + quoted[-1] + f" on [{result['machine']}]({link}), {result['date']}"
            + (f" ({', '.join(made)})" if made else "") + ".")
    if result.get("source"):
        text = text[:-1] + f"; {result['source']}."
    if result.get("note"):
        text += f" {result['note']}"
    return text


def table(result: dict) -> str:
    columns = result["columns"]
    lines = ["| " + " | ".join(c["key"] if c["header"] is None else c["header"] for c in columns) + " |",
             "|" + "---|" * len(columns)]
    above: dict[str, str] = {}
    for row in result["rows"]:
        cells = []
        grouped = True  # a merged cell is left blank only inside the group of the merged cells to its left
        for c in columns:
            text = cell(c, row.get(c["key"]), row)
            grouped = grouped and bool(c.get("merge")) and above.get(c["key"]) == text
            cells.append("" if grouped else text)
            above[c["key"]] = text
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_of(result: dict) -> tuple:
    return str(result["command"]), result["machine"], result["date"]


def figure(name: str, result: dict, page: Path, table_only: bool = False) -> str:
    """A region: the caption (command, machine, date, versions, note) and the table of `result` (the file NAME);
    `table_only` where a region above on the same page has already given the caption of the same run (one run,
    several tables)."""
    if table_only:
        return f"<!-- figure: {name} table -->\n\n{table(result)}\n\n<!-- /figure -->"
    return f"<!-- figure: {name} -->\n\n{caption(result, page)}\n\n{table(result)}\n\n<!-- /figure -->"


def value(name: str, key: str, results: Path = RESULTS) -> str:
    result = load(name, results)
    if key in ("date", "machine"):
        return result[key]
    if key.startswith("range:"):
        _, column_key, *among = key.split(":", 2)
        column = next((c for c in result["columns"] if c["key"] == column_key), None)
        if column is None:
            raise KeyError(f"{name} has no column {column_key}")
        rows = [row for row in result["rows"] if not among or any(among[0] in str(v) for v in row.values())]
        numbers = [row[column_key] for row in rows if isinstance(row.get(column_key), (int, float))]
        if not numbers:
            raise KeyError(f"{name} has no numbers in column {column_key}" + (f" of rows with {among[0]}" if among else ""))
        alone = {**column, "format": re.sub(r"\s*\(?\{[A-Za-z_][^}]*\}.*$", "", column["format"])}  # its own number
        low, high = cell(alone, min(numbers)), cell(alone, max(numbers))
        unit = re.search(r"[^\d.]*$", low).group(0)
        return low if low == high else f"{low.removesuffix(unit) if high.endswith(unit) else low}-{high}"
    if key not in result["values"]:
        raise KeyError(f"{name} has no value {key} (it has: {', '.join(result['values']) or 'none'})")
    return result["values"][key]


def render(text: str, page: Path, results: Path = RESULTS) -> tuple[str, list[str]]:
    """The page with every region regenerated, and what could not be (a missing file, column or value)."""
    problems: list[str] = []

    def line_of(match: re.Match) -> str:
        return f"{shown(page)}:{text.count(chr(10), 0, match.start()) + 1}"

    captioned: set[tuple] = set()

    def one_figure(match: re.Match) -> str:
        indent, name, table_only = match.groups()
        try:
            result = load(name, results)
            if table_only and run_of(result) not in captioned:
                raise KeyError(f"{name}: a table-only figure needs a full figure of the same run above it")
            captioned.add(run_of(result))
            region = figure(name, result, page, table_only=bool(table_only))
            return "\n".join(indent + line if line else line for line in region.splitlines())  # e.g. in a list item
        except KeyError as e:
            problems.append(f"{line_of(match)}: {e.args[0]}")
            return match.group(0)

    def one_value(match: re.Match) -> str:
        try:
            return f"<!-- value: {match.group(1)} {match.group(2)} -->{value(match.group(1), match.group(2), results)}<!-- /value -->"
        except KeyError as e:
            problems.append(f"{line_of(match)}: {e.args[0]}")
            return match.group(0)

    fresh = VALUE.sub(one_value, FIGURE.sub(one_figure, text))
    if len(MARKER.findall(text)) != len(FIGURE.findall(text)) + len(VALUE.findall(text)):
        problems.append(f"{shown(page)}: a figure or value marker "
                        "without its closing marker, or written another way than scripts/figures.py reads")
    return fresh, problems


def stale(text: str, page: Path, results: Path = RESULTS) -> list[str]:
    """Where the page's copy differs from its result file: `page:line: NAME differs from its result file`."""
    fresh, problems = render(text, page, results)
    if fresh == text:
        return problems
    old, new = text.splitlines(), fresh.splitlines()
    first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    name = re.findall(r"<!-- (?:figure|value): (\S+)", "\n".join(old[: first + 1]))
    where = shown(page)
    return [*problems, f"{where}:{first + 1}: {name[-1] if name else 'a figure'} differs from its result file "
                       "(run python scripts/figures.py)"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; list stale figures, exit 1 if any")
    args = parser.parse_args(argv)
    problems: list[str] = []
    for page in pages():
        text = page.read_text()
        if args.check:
            problems += stale(text, page)
            continue
        fresh, found = render(text, page)
        problems += found
        if fresh != text:
            page.write_text(fresh)
            print(f"updated {page.relative_to(ROOT)}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
