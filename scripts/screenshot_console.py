"""A PNG of what a command leaves on a terminal (for docs/): run it with colours on, keep what stays on the
screen, render that with rich as an SVG terminal window, and screenshot it in headless Chromium.

    .venv/bin/python scripts/screenshot_console.py --last 36 docs/console.png -- lmrl train train.steps=200

lmrl's progress bar is transient (a terminal redraws it in place and erases it when the run ends); captured
through a pipe each redraw is a line of its own, so its lines are left out. Needs Chromium (Debian: apt-get
install chromium). Only the command's stdout is drawn.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.text import Text

PROGRESS = re.compile(r"^train .* \d+/\d+ steps .* eta ")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def screen(output: str) -> list[str]:
    """The lines that stay on a terminal: `output`'s lines (colour codes kept) less the progress bar's redraws."""
    lines = [line.rsplit("\r", 1)[-1] for line in output.replace("\r\n", "\n").split("\n")]
    # a line holding only cursor codes (hide / show the cursor, erase) is not on the screen
    lines = [line for line in lines if ANSI.sub("", line) or not ANSI.search(line)]
    lines = [re.sub(r"\x1b\[[0-9;?]*[A-LN-Za-z]", "", line) for line in lines]  # cursor codes out, colours kept
    kept = [line for line in lines if not PROGRESS.match(ANSI.sub("", line))]
    while kept and not ANSI.sub("", kept[-1]).strip():
        kept.pop()
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("--width", type=int, default=100, help="terminal columns")
    parser.add_argument("--last", type=int, default=40, help="draw only the last this many lines")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": str(args.width), "TERM": "xterm-256color"}
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = screen(out.stdout)[-args.last:]
    with open(os.devnull, "w") as sink:  # record only: nothing reaches this terminal
        console = Console(record=True, width=args.width, file=sink, force_terminal=True)
        console.print(Text.from_ansi("\n".join(lines)))
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("scripts/screenshot_console.py: needs chromium on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        svg = Path(tmp) / "console.svg"
        svg.write_text(console.export_svg(title="$ " + " ".join(command)))
        height = 60 + 25 * len(lines)
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp}/profile", "--hide-scrollbars", f"--window-size={args.width * 12 + 40},{height}",
                        f"--screenshot={Path(args.out).resolve()}", svg.as_uri()], capture_output=True, timeout=120, check=True)
    print(f"wrote {args.out} ({len(lines)} lines of `{' '.join(command)}`, exit {out.returncode})")


if __name__ == "__main__":
    main()
