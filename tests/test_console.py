"""The live console written to a file or pipe: whole lines, whatever their length."""

from __future__ import annotations

import subprocess
import sys


def test_long_lines_stay_whole_in_a_pipe():
    line = "lmrl grpo on tiny-addition: 4000 prompts, output in /tmp/" + "x" * 120 + ", resumed at step 2"
    code = ("from lmrl.logging.console import Console\n"
            "c = Console(total_steps=1)\n"
            f"c.print({line!r})\n"
            "c.print('[bold]styled[/] ' + 'y' * 150)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "", "COLUMNS": "80", "TERM": "dumb"}).stdout
    assert out.splitlines() == [line, "styled " + "y" * 150]
