"""Every figure names its machine and date (issue 30). The machines are listed once, in the `## Machines`
table of docs/performance.md; a paragraph of README.md, docs/*.md or benchmarks/README.md that names one of
them (outside fenced code) also links the table and gives a date, YYYY-MM-DD. Vague names for a machine
("this project's 2-core CPU", "the current machine") are refused, and every link to the table names a
machine that is in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE_PAGE = ROOT / "docs" / "performance.md"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
VAGUE = ("current machine", "this project's machine", "this project's 2-core", "this 2-core")
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]*#machines)\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def machine_names(text: str) -> list[str]:
    """The first column of the table under `## Machines` (backticks dropped), header and rule left out."""
    section = re.search(r"^## Machines\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        return []
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    return [row.split("|")[1].strip().strip("`") for row in rows[2:]]


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each blank-line-separated paragraph outside fenced code blocks."""
    out: list[tuple[int, str]] = []
    lines: list[str] = []
    start = 0
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence:
            if stripped.startswith(fence) and stripped.strip(fence[0]) == "":
                fence = ""
            continue
        opener = re.match(r"(`{3,}|~{3,})", stripped)
        if opener or not stripped:
            if lines:
                out.append((start, "\n".join(lines)))
            lines = []
            fence = opener.group(1) if opener else ""
            continue
        if not lines:
            start = number
        lines.append(line)
    if lines:
        out.append((start, "\n".join(lines)))
    return out


def figure_problems(text: str, machines: list[str], page: str = "page") -> list[str]:
    """What is wrong in `text` (a page): a paragraph naming a machine without a date or without a link to
    the machine table, a vague name for a machine, a link to the table whose text names no machine."""
    named = [re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])") for name in machines]
    problems = []
    for line, para in paragraphs(text):
        flat = " ".join(para.split()).replace("\u2019", "'")
        used = [name for name, pattern in zip(machines, named) if pattern.search(flat)]
        if used and not DATE.search(flat):
            problems.append(f"{page}:{line}: names {', '.join(used)} without a date (YYYY-MM-DD)")
        is_the_table = flat.startswith("| name |")  # the machine table names machines without linking itself
        if used and not LINK.search(flat) and not is_the_table:
            problems.append(f"{page}:{line}: names {', '.join(used)} without linking the machine table")
        for phrase in VAGUE:
            if phrase in flat.lower():
                problems.append(f"{page}:{line}: '{phrase}': name the machine (docs/performance.md#machines)")
        for label, _target in LINK.findall(flat):
            if label.strip("`") not in machines:
                problems.append(f"{page}:{line}: link '{label}' to the machine table names no machine in it")
    return problems


def test_machine_table_lists_machines():
    names = machine_names(TABLE_PAGE.read_text())
    assert len(names) >= 3, names
    assert len(set(names)) == len(names), names
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9-]*", n) for n in names), names


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_figures_name_machine_and_date(page: Path):
    machines = machine_names(TABLE_PAGE.read_text())
    assert figure_problems(page.read_text(), machines, str(page.relative_to(ROOT))) == []


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_machine_links_reach_the_table(page: Path):
    """A link to the table, relative to its page, is docs/performance.md#machines."""
    for _label, target in LINK.findall(page.read_text()):
        path = target.split("#")[0]
        assert (page.parent / path).resolve() == TABLE_PAGE if path else page == TABLE_PAGE, (page, target)


def test_checker_catches_a_machine_without_a_date():
    machines = ["xeon-amx", "epyc-avx2"]
    good = "Timed on [xeon-amx](performance.md#machines), 2026-11-25:\n\n```text\nepyc-avx2 in code\n```\n"
    assert figure_problems(good, machines) == []
    broken = good + "\nThe same run on [epyc-avx2](performance.md#machines) took 1.2 s.\n"
    assert figure_problems(broken, machines) == ["page:7: names epyc-avx2 without a date (YYYY-MM-DD)"]
    assert figure_problems("On `xeon-amx` (2026-11-25): 1.3x.", machines) == [
        "page:1: names xeon-amx without linking the machine table"]
    assert figure_problems("On this 2-core machine: 1.3x (2026-11-25).", machines) == [
        "page:1: 'this 2-core': name the machine (docs/performance.md#machines)"]
    assert figure_problems("On [epyc](performance.md#machines), 2026-11-25: 1.3x.", machines) == [
        "page:1: link 'epyc' to the machine table names no machine in it"]
