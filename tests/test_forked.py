"""tests/forked.py's stand-in `python`: what the suite starts through it (benchmarks' own commands, the RLHF loop's,
agent programs) runs as the real interpreter runs it: the same output and exit code, signals and descriptors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forked

BARE = ()  # a zygote that imports nothing: these programs need nothing


@pytest.fixture(scope="module")
def stand_in() -> str:
    return forked.python(BARE)


SCRIPT = ("import os, sys\nprint(sys.argv, repr(sys.path[0]), os.getcwd(), os.environ.get('ONLY_HERE'))\n"
          "print(__file__ if '__file__' in dir() else None, __name__)\nsys.exit(int(sys.argv[-1]))\n")


@pytest.mark.parametrize("args", [
    ["-c", SCRIPT, "a", "3"],
    ["-u", "-B", "-W", "ignore", "-c", SCRIPT, "0"],
    ["-IS", "-c", "import sys; print(sys.stdin.read().upper())"],
    ["script.py", "b", "4"],
    ["-m", "script", "c", "0"],
    ["-m", "json.tool"],
    ["-c", "raise ValueError('boom')"],
    ["-c", "import sys; sys.exit('a message')"],
], ids=["-c", "options", "stdin", "script", "-m", "-m stdlib", "exception", "exit message"])
def test_a_program_prints_and_exits_as_under_python(stand_in, tmp_path, args):
    (tmp_path / "script.py").write_text(SCRIPT)
    runs = [subprocess.run([python, *args], cwd=tmp_path, input='{"a": [1, 2]}', capture_output=True, text=True,
                           env={**os.environ, "ONLY_HERE": "yes"}, timeout=60) for python in (sys.executable, stand_in)]
    real, stood = runs
    assert (stood.returncode, stood.stdout) == (real.returncode, real.stdout)
    assert stood.stderr.splitlines()[-1:] == real.stderr.splitlines()[-1:]  # a traceback's last line, or the message


def test_an_option_python_has_and_the_stand_in_does_not_is_one_line(stand_in):
    done = subprocess.run([stand_in, "-O", "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr == "python (the stand-in of tests/forked.py): it does not take -O\n"


def test_the_program_has_the_stand_ins_descriptors_and_starts_stand_ins(stand_in):
    read, write = os.pipe()
    code = (f"import os, sys; os.write({write}, b'through the descriptor'); print(sys.executable)")
    done = subprocess.run([stand_in, "-c", code], pass_fds=(write,), capture_output=True, text=True, timeout=60)
    os.close(write)
    with os.fdopen(read, "rb") as r:
        assert r.read() == b"through the descriptor"
    assert done.returncode == 0 and done.stdout.strip() == stand_in  # what it starts with `python` is forked too


def test_a_signal_to_the_stand_in_reaches_the_program_and_the_stand_in_ends_as_it_does(stand_in):
    caught = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
              "print('ready', flush=True)\ntime.sleep(60)\n")
    for code, ended in ((caught, 7), ("import time\nprint('ready', flush=True)\ntime.sleep(60)\n", -signal.SIGTERM)):
        proc = subprocess.Popen([stand_in, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        proc.terminate()
        assert proc.wait(30) == ended  # its handler's exit code, or the signal that ended it


def test_a_stand_in_killed_takes_its_program_along(stand_in):
    proc = subprocess.Popen([stand_in, "-c", "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n"],
                            stdout=subprocess.PIPE, text=True)
    program = int(proc.stdout.readline())
    assert program != proc.pid
    proc.kill()
    proc.wait(30)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{program}").exists() and time.monotonic() < deadline:  # killed, then reaped by its parent
        time.sleep(0.01)
    assert not Path(f"/proc/{program}").exists()
