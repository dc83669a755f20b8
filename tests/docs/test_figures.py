"""Every figure names its machine and date (issue 30). The machines are listed once, in the `## Machines`
table of docs/performance.md; a paragraph of README.md, docs/*.md or benchmarks/README.md that names one of
them (outside fenced code) also links the table and gives a date, YYYY-MM-DD. Vague names for a machine
("this project's 2-core CPU", "the current machine") are refused, and every link to the table names a
machine that is in it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE_PAGE = ROOT / "docs" / "performance.md"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
VAGUE = ("current machine", "this project's machine", "this project's 2-core", "this 2-core")

sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "benchmarks")]
import figures  # noqa: E402
import recording  # noqa: E402

COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]*#machines)\)")


def pages() -> list[Path]:
    return figures.pages()  # the hidden pages test_examples.py writes into docs/ for a while left out


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
        flat = " ".join(COMMENT.sub("", para).split()).replace("\u2019", "'")  # markers name machines too
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


# Figures come from one place: benchmarks/results/*.json, written by the benchmarks' --record and rendered into
# the pages' `<!-- figure: ... -->` regions by scripts/figures.py.

COMMANDS = ("python benchmarks/", "lmrl ", "make ", "torchrun ", "bash examples/")  # what a recorded figure's command may be
RESULT_KEYS = {"name", "command", "machine", "date", "commit", "versions", "note", "columns", "rows", "values"}


@pytest.mark.parametrize("page", figures.pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_figures_on_the_page_are_their_result_files(page: Path):
    assert figures.stale(page.read_text(), page) == []


def test_every_result_file_names_its_machine_date_and_command_and_is_shown():
    machines = machine_names(TABLE_PAGE.read_text())
    shown = "\n".join(page.read_text() for page in figures.pages())
    files = sorted(figures.RESULTS.glob("*.json"))
    assert files
    for path in files:
        result = json.loads(path.read_text())
        assert set(result) >= RESULT_KEYS, (path.name, RESULT_KEYS - set(result))
        assert path.name == f"{result['name']}.{result['machine']}.json", path.name
        assert result["machine"] in machines, (path.name, result["machine"])
        assert DATE.fullmatch(result["date"]), (path.name, result["date"])
        commands = [result["command"]] if isinstance(result["command"], str) else result["command"]
        assert all(c.startswith(COMMANDS) for c in commands), (path.name, commands)
        assert result["rows"] or result["values"], path.name
        assert re.search(rf"<!-- (figure|value): {re.escape(path.stem)}[ -]", shown), f"{path.name} is on no page"


def test_a_figure_edited_on_the_page_fails_naming_its_line(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/generation.py", "--threads", "2"])
    monkeypatch.setenv("LMRL_MACHINE", "epyc-avx2")
    columns = [recording.Column("model", merge=True), recording.Column("mode"),
               recording.Column("ratio", "lmrl / hf", "{:.2f}x")]
    rows = [{"model": "tiny", "mode": "eos", "ratio": 2.0}, {"model": "tiny", "mode": "no-eos", "ratio": 2.314},
            {"model": "110M", "mode": "eos", "ratio": 1.3}]
    recording.record("gen", columns, rows, values={"best": "2.31x"}, out_dir=tmp_path)
    page = ROOT / "docs" / "example.md"
    text = ("# Generation\n\nlmrl is <!-- value: gen.epyc-avx2 range:ratio:tiny --><!-- /value --> faster "
            "(best <!-- value: gen.epyc-avx2 best --><!-- /value -->):\n\n<!-- figure: gen.epyc-avx2 -->\n<!-- /figure -->\n")
    fresh, problems = figures.render(text, page, tmp_path)
    assert problems == []
    assert "lmrl is <!-- value: gen.epyc-avx2 range:ratio:tiny -->2.00-2.31x<!-- /value --> faster" in fresh
    assert figures.value("gen.epyc-avx2", "range:ratio", tmp_path) == "1.30-2.31x"
    assert figures.value("gen.epyc-avx2", "range:ratio:110M", tmp_path) == "1.30x"
    assert figures.value("gen.epyc-avx2", "date", tmp_path) == json.loads((tmp_path / "gen.epyc-avx2.json").read_text())["date"]
    assert "(best <!-- value: gen.epyc-avx2 best -->2.31x<!-- /value -->)" in fresh
    assert "`python benchmarks/generation.py --threads 2` on [epyc-avx2](performance.md#machines), 20" in fresh
    assert "| model | mode | lmrl / hf |\n|---|---|---|\n| tiny | eos | 2.00x |\n|  | no-eos | 2.31x |\n| 110M | eos | 1.30x |" in fresh
    assert figure_problems(fresh, ["epyc-avx2"]) == []
    listed, _ = figures.render("- an item\n\n  <!-- figure: gen.epyc-avx2 -->\n  <!-- /figure -->\n", page, tmp_path)
    assert "\n  | model | mode | lmrl / hf |\n" in listed and "\n\n  <!-- /figure -->\n" in listed  # inside the item
    assert figures.stale(fresh, page, tmp_path) == []

    edited = fresh.replace("| 2.31x |", "| 2.41x |")
    line = edited.splitlines().index("|  | no-eos | 2.41x |") + 1
    assert figures.stale(edited, page, tmp_path) == [
        f"docs/example.md:{line}: gen.epyc-avx2 differs from its result file (run python scripts/figures.py)"]
    assert figures.stale(edited.replace("->2.31x<", "->2.3x<"), page, tmp_path)[0].startswith("docs/example.md:3: ")
    unclosed = figures.render("Best: <!-- value: gen.epyc-avx2 best -->2.31x.\n", page, tmp_path)[1]
    assert unclosed == ["docs/example.md: a figure or value marker without its closing marker, or written another way "
                        "than scripts/figures.py reads"]
    assert figures.value("gen.epyc-avx2", "range:ratio:110M", tmp_path) == "1.30x"
    missing = text.replace("gen.epyc-avx2 -->\n", "gen.xeon-amx -->\n")
    assert figures.stale(missing, page, tmp_path)[0] == (
        f"docs/example.md:5: no result file {tmp_path / 'gen.xeon-amx.json'}")


def test_a_benchmark_records_its_table(tmp_path: Path, monkeypatch):
    """generation.py --record, on a few tokens (in this process: its main, as the command line runs it): the
    file names the command, and renders."""
    import generation
    import torch

    args = ["--preset", "tiny", "--prompts", "2", "--n", "2", "--max-new-tokens", "4", "--repeats", "1",
            "--modes", "no-eos", "--threads", "1", "--record", "gen-smoke"]
    monkeypatch.setenv("LMRL_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("LMRL_MACHINE", "epyc-avx2")
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "generation.py"), *args])
    threads = torch.get_num_threads()
    try:
        generation.main()
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "gen-smoke.epyc-avx2.json").read_text())
    assert result["command"] == "python benchmarks/generation.py " + " ".join(args)
    assert [row["mode"] for row in result["rows"]] == ["no-eos"]
    assert result["rows"][0]["lmrl"] > 0 and result["rows"][0]["x_lmrl"] > 0
    assert "torch" in result["versions"]
    assert "| `model.generate` tok/s |" in figures.table(result)


def test_runs_that_fill_one_table_merge_on_a_key(tmp_path: Path, monkeypatch):
    """record(merge_on=...): a second run fills its own columns of the rows with the same key, adds its new rows,
    and the file lists both commands; the columns keep the caller's order, a column nobody wrote is left out."""
    monkeypatch.setenv("LMRL_MACHINE", "epyc-avx2")
    columns = [recording.Column("preset"), recording.Column("gain", "75 s: gain", "+{:.1f}"),
               recording.Column("steps_gain", "150 steps: gain", "+{:.1f}"), recording.Column("s_step", "s/step", "{:.2f}")]
    monkeypatch.setattr(sys, "argv", ["benchmarks/preset_gains.py"])
    recording.record("gains", columns, [{"preset": "grpo", "gain": 29.25, "s_step": 0.093}], note="75 s runs.",
                     out_dir=tmp_path, merge_on="preset")
    first = json.loads((tmp_path / "gains.epyc-avx2.json").read_text())
    assert [c["key"] for c in first["columns"]] == ["preset", "gain", "s_step"]  # no steps_gain yet
    for extra in ([], ["--record"], ["--record", "gains"]):  # the same run thrice: its command and note once
        monkeypatch.setattr(sys, "argv", ["benchmarks/preset_gains.py", "--steps", "150", *extra])
        recording.record("gains", columns, [{"preset": "grpo", "steps_gain": 22.8}, {"preset": "ppo", "steps_gain": 23.6}],
                         note="150-step column: no time limit.", out_dir=tmp_path, merge_on="preset")
    result = json.loads((tmp_path / "gains.epyc-avx2.json").read_text())
    assert result["command"] == ["python benchmarks/preset_gains.py", "python benchmarks/preset_gains.py --steps 150 --record gains"]
    assert result["note"] == "75 s runs. 150-step column: no time limit."
    assert figures.table(result) == ("| preset | 75 s: gain | 150 steps: gain | s/step |\n|---|---|---|---|\n"
                                     "| grpo | +29.2 | +22.8 | 0.09 |\n| ppo |  | +23.6 |  |")

    # into a typed-in file: its string cells stay where this run wrote none, and its source becomes "partly ..."
    typed = {**first, "source": "typed in", "columns": [{**c, "format": "{}"} for c in first["columns"]],
             "rows": [{"preset": "grpo", "gain": "+29.3", "s_step": "0.09"}]}
    (tmp_path / "gains.epyc-avx2.json").write_text(json.dumps(typed))
    recording.record("gains", columns, [{"preset": "grpo", "steps_gain": 22.8}], out_dir=tmp_path, merge_on="preset")
    result = json.loads((tmp_path / "gains.epyc-avx2.json").read_text())
    assert result["source"] == "partly typed in"
    assert figures.table(result).splitlines()[-1] == "| grpo | +29.3 | +22.8 | 0.09 |"


MEASURED = re.compile(r"\b\d+\.\d+x\b|tok/s")  # a speed-up ratio or a rate: what a benchmark measures


def hand_typed_figure_rows(text: str) -> list[int]:
    """Line numbers of table rows outside figure regions (and code) that hold a measured ratio or rate."""
    rows, region, fence = [], False, False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = not fence
        region = (region or "<!-- figure: " in stripped) and "<!-- /figure -->" not in stripped
        if not (region or fence) and stripped.startswith("|") and (MEASURED.search(stripped) or numeric_row(stripped)):
            rows.append(number)
    return rows


def numeric_row(row: str) -> bool:
    """Three cells or more that are numbers, one with decimals: a row of results (accuracies, seconds)."""
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    return sum(bool(re.match(r"\**[+-]?\d+(\.\d+)?", cell)) for cell in cells) >= 3 and bool(re.search(r"\d\.\d", row))


@pytest.mark.parametrize("page", figures.pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_of_measurements_are_figure_regions(page: Path):
    """A table of speed-ups or rates is a benchmark's: it comes from a result file, not typed into the page."""
    assert hand_typed_figure_rows(page.read_text()) == []


def test_a_hand_typed_table_of_measurements_is_caught():
    text = "# P\n\n| model | ratio |\n|---|---|\n| tiny | 2.04x |\n\n<!-- figure: x -->\n\n| tiny | 2.04x |\n\n<!-- /figure -->\n"
    assert hand_typed_figure_rows(text) == [5]
    learning = "| backend | step 100 | step 150 | s/step |\n|---|---|---|---|\n| `lmrl` | 49.4 / 51.4 | 55.4 / 54.2 | 0.10-0.17 |\n"
    assert hand_typed_figure_rows(learning) == [3]
    settings = "| field | default | meaning |\n|---|---|---|\n| `algorithm.clip_low` | 0.2 | the clip, 0.2 to 0.28 |\n"
    assert hand_typed_figure_rows(settings) == []
