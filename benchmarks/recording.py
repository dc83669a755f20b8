"""Benchmark results as files: the one place the figures in README.md and docs/ come from.

A benchmark run with `--record` writes `benchmarks/results/NAME.MACHINE.json`: what it measured (a table of
rows, with each column's header and format), the command that measured it, the machine (by its name in the
table of docs/performance.md#machines), the date, the commit and the versions. `python scripts/figures.py`
renders every `<!-- figure: NAME.MACHINE -->` region of the pages from these files, and the test suite fails
when a page's copy differs from its file. Rerunning a benchmark with `--record` on the same machine replaces
its file; `make figures` then refreshes every page that shows it.

    from recording import Column, record
    record("generation-tiny", [Column("model"), Column("ratio", "x hf", "{:.2f}x")], rows)

A table that several runs fill (one row per run, or some columns from one kind of run and the rest from
another) is recorded with `merge_on=KEY`: where the file already exists, a row of this run replaces the cells
it has in the file's row with the same KEY (or is added at the end); every other row and cell stays. The file
then lists every command that wrote to it, this one last (an earlier command that differs from it only by
`--record [NAME]` counts as this one); its note gains this run's note unless the note is already in it; its
date, commit and versions are this run's; a typed-in file's `source` becomes "partly ...". A column no row
has a value for is left out. Commands are not dropped otherwise: when a rerun with other settings replaces
all of an older run's cells, edit the older command out of the file (or delete the file first).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Column:
    """One column of a result table: the row key, its header on the page and how a value is written
    (a `str.format` pattern, which may name other keys of the row; `merge`: a cell equal to the one above is left blank, as in a grouped table)."""

    key: str
    header: str | None = None
    format: str = "{}"
    merge: bool = False


def cpu_flags() -> tuple[str, set[str]]:
    """The CPU's model name and its flags, from /proc/cpuinfo ("", {} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor(), set()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("model name", ""), set(fields.get("flags", "").split())


def machine_name() -> str:
    """This machine's name in docs/performance.md#machines, told by its GPU or its CPU's features.
    LMRL_MACHINE names it where these rules do not (a new machine also needs its row in that table)."""
    if os.environ.get("LMRL_MACHINE"):
        return os.environ["LMRL_MACHINE"]
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name().lower().replace("nvidia ", "").split()[0]
    except ImportError:
        pass
    model, flags = cpu_flags()
    if "amx_bf16" in flags:
        return "xeon-amx"
    if "avx512_bf16" in flags:
        return "avx512bf16"
    if "AMD EPYC" in model and "avx2" in flags and "avx512f" not in flags:
        return "epyc-avx2"
    return "unknown"


def commit() -> str:
    """The checkout's short commit, with "+changes" when its code (lmrl/, the benchmarks) differs from it ("" outside
    a git checkout)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "lmrl", "benchmarks/*.py")  # the code
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+changes" if head and dirty else "")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "trl", "vllm"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            out[name] = str(module.__version__)
    return out


def command_line() -> str:
    """How this process was started, as a command to paste: `python benchmarks/NAME.py ARGS`."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(ROOT):
        script = script.relative_to(ROOT)
    return shlex.join(["python", str(script), *sys.argv[1:]])


def record(name: str, columns: list[Column], rows: list[dict], *, values: dict[str, str] | None = None,
           note: str = "", out_dir: Path | None = None, merge_on: str | None = None) -> Path:
    """Write one result file and return its path. `rows` are dicts keyed by the columns' keys; `values`
    are named figures quoted in prose (already written, e.g. "2.20x"); `note` is a sentence the page shows
    under the command (what the rows are, the settings the command does not show). `merge_on`: a row key;
    merge into the file already there instead of replacing it (the module docstring says how)."""
    machine = machine_name()
    out_dir = out_dir or Path(os.environ.get("LMRL_RESULTS_DIR") or RESULTS)
    path = out_dir / f"{name}.{machine}.json"
    result = {
        "name": name,
        "command": command_line(),
        "machine": machine,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "commit": commit(),
        "versions": versions(),
        "note": note,
        "columns": [asdict(c) for c in columns],
        "rows": rows,
        "values": values or {},
    }
    if merge_on is not None and path.is_file():
        result = merged(json.loads(path.read_text()), result, merge_on)
    elif merge_on is not None:
        result["columns"] = [c for c in result["columns"] if any(_has(row, c["key"]) for row in rows)]
    missing = {c["key"] for c in result["columns"]} - set().union(*result["rows"]) if result["rows"] else set()
    if missing:
        raise ValueError(f"record {name}: no row has the column(s) {sorted(missing)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"recorded {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
          + (" (unknown machine: set LMRL_MACHINE to its name in docs/performance.md#machines)"
             if machine == "unknown" else ""))
    return path


def merged(old: dict, new: dict, key: str) -> dict:
    """`new` (a result about to be written) merged into `old` (the file's): rows matched on `key`, the new
    cells over the old; the columns in `new`'s order (the old file's definition where this run wrote no cell of
    a column), then old columns `new` does not name; the columns no row has left out; the commands of both."""
    rows = [dict(row) for row in old["rows"]]
    index = {row.get(key): row for row in rows}
    for row in new["rows"]:
        if row.get(key) in index:
            index[row.get(key)].update(row)
        else:
            rows.append(dict(row))
            index[row.get(key)] = rows[-1]
    written = {c["key"] for c in new["columns"] if any(_has(row, c["key"]) for row in new["rows"])}
    old_columns = {c["key"]: c for c in old["columns"]}
    columns = [c if c["key"] in written or c["key"] not in old_columns else old_columns[c["key"]]
               for c in new["columns"]]
    columns += [c for c in old["columns"] if c["key"] not in {n["key"] for n in new["columns"]}]
    columns = [c for c in columns if any(_has(row, c["key"]) for row in rows)]
    commands = [old["command"]] if isinstance(old["command"], str) else list(old["command"])
    commands = [c for c in commands if _without_record(c) != _without_record(new["command"])] + [new["command"]]
    note = old.get("note", "")
    if new["note"] and new["note"] not in note:
        note = f"{note} {new['note']}".strip()
    result = {**new, "command": commands[0] if len(commands) == 1 else commands, "note": note, "columns": columns,
              "rows": rows, "values": {**old.get("values", {}), **new["values"]}}
    if old.get("source"):
        result["source"] = old["source"] if old["source"].startswith("partly ") else f"partly {old['source']}"
    return result


def _has(row: dict, key: str) -> bool:
    return row.get(key) not in (None, "")


def _without_record(command: str) -> list[str]:
    """A command's words less `--record [NAME]`: a rerun of a listed command with --record is the same run."""
    words = shlex.split(command)
    if "--record" in words:
        at = words.index("--record")
        del words[at : at + (2 if at + 1 < len(words) and not words[at + 1].startswith("-") else 1)]
    return words


def lmrl_train_rows(out: Path, *args: str) -> list[dict]:
    """`lmrl train ARGS` into `out` in a subprocess (overwriting it, no console, no samples): the rows of its
    metrics.jsonl; on failure the command and the last line it printed."""
    import subprocess

    cmd = [sys.executable, "-m", "lmrl.cli", "train", f"train.output_dir={out}", "train.overwrite=true",
           "log.console=false", "log.samples_every=0", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
