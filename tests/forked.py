"""Commands run as children forked from a zygote: a process that has imported lmrl (torch, transformers) and run
nothing else. Each child is a real process (its own cwd, environment, output, exit code, signals) running the
same code as `lmrl ...` or `python script.py`, without the interpreter's 3 s of start-up: the documentation's
pages and the bad-inputs table run hundreds of commands."""

from __future__ import annotations

import os
import pickle
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A process that has imported lmrl and run nothing: each command of a page is a child forked from it. (Not from
# the test's own process: after other tests ran torch there, a forked child can crash in torch's thread pool.)
ZYGOTE = r"""
import os, pickle, signal, sys, types
import lmrl.build, lmrl.cli  # torch and transformers: imported once, shared by every child
# and what a run imports as it starts: the trainer, transformers' Llama (which imports torch._dynamo and DTensor),
# the tokenizer's auto class, the task, the report. A child that imported these itself took 1.5-3 s more (the pages
# and the bad-inputs table ran 2.7x slower). Imports only: no torch op runs in the zygote.
import lmrl.trainer, lmrl.reward_trainer, lmrl.data.tasks, lmrl.report, transformers.models.llama.modeling_llama
import transformers.models.auto.tokenization_auto
import gc, importlib
for name in sys.argv[1:]:  # what some tests' children import besides (VLLM below)
    importlib.import_module(name)
gc.freeze()  # the imports' objects are never collected: a child's collections skip them (vLLM's start-up runs 6)

def as_main(source, name, path0=""):
    module = types.ModuleType("__main__")
    module.__file__ = name
    sys.modules["__main__"] = module
    sys.path.insert(0, path0)
    exec(compile(source, name, "exec"), module.__dict__)
    return 0

def child(kind, payload, cwd, env, files):
    code = 1
    try:
        for fd, path in enumerate(files):  # first: a started child's output is a FIFO the test waits to open
            f = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.stdin, sys.stdout, sys.stderr = (open(0, closefd=False), open(1, "w", closefd=False),
                                             open(2, "w", closefd=False))
        if kind == "cli":
            sys.argv = ["lmrl", *payload]
            code = lmrl.cli.main(payload) or 0
        elif kind == "script":  # as `python PATH ARGS...`: sys.path[0] is the script's folder
            sys.argv = list(payload)
            with open(payload[0], "rb") as f:
                source = f.read()
            code = as_main(source, payload[0], os.path.dirname(os.path.realpath(payload[0])))
        else:
            sys.argv = [payload[1], *payload[2:]]
            code = as_main(payload[0], payload[1])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:  # sys.exit("message"): printed, as Python does
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

requests, replies = os.fdopen(0, "rb"), os.fdopen(1, "wb")
running = set()  # the children forked: each runs while the test goes on, and is reaped when the test asks
while True:
    try:
        kind, payload, cwd, env, files = pickle.load(requests)
    except EOFError:
        break
    if kind == "wait":  # payload: the pid of a child the test saw end; its exit code
        reply = os.waitstatus_to_exitcode(os.waitpid(payload, 0)[1])
        running.discard(payload)
    else:  # a child; its pid
        reply = os.fork()
        if reply == 0:
            if kind.startswith("setsid "):  # a session of its own, as Popen's start_new_session gives
                os.setsid()
            child(kind.removeprefix("setsid "), payload, cwd, env, files)
        running.add(reply)
    pickle.dump(reply, replies)
    replies.flush()
for pid in running:  # the test's process is gone: so is what it started
    os.kill(pid, signal.SIGKILL)
os._exit(0)  # not the interpreter's shutdown: it reports what was frozen as leaked (nanobind, in vLLM's Triton)
"""
_zygotes: dict[tuple[str, ...], subprocess.Popen] = {}  # this process's, one per set of imports
_zygotes_lock = threading.Lock()

# vLLM's engine, imported by the zygote of children that start one (`imports=VLLM`): a child forked from it starts
# its first engine in 3.7 s, against 6.4 s from the plain zygote. Only those: a child that would not import vLLM
# should not run with what its import sets up (its logging, platform detection, registries).
VLLM = ("vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker",
        "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama", "vllm.v1.sample.sampler",
        "vllm.v1.attention.backends.cpu_attn")


def forked(kind: str, payload, cwd: Path, timeout: float, what: str, env: dict[str, str],
           stdin: str = "", imports: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """A child forked from the zygote (ZYGOTE): `kind` "cli" runs `lmrl.cli.main(payload)`, "main" runs the
    source `payload[0]` as `__main__` (named `payload[1]`, argv `payload[1:]`, sys.path[0] the cwd), "script" the
    file `payload[0]` as `python payload[0] payload[1:]...` does; in `cwd`, with the environment `env`, stdin
    `stdin`, stdout and stderr captured. Like subprocess.run, without the interpreter's start-up. The environment
    is the child's os.environ: what torch or lmrl read from it at import time is the zygote's (the first call's).
    The child ends with os._exit: atexit handlers and the interpreter's shutdown do not run, so what only a
    process's normal exit shows (a hang joining children, a message at shutdown) needs a fresh process. `imports`:
    modules the zygote imports besides, e.g. VLLM (a zygote of its own)."""
    zygote = _zygote(env, imports)
    with tempfile.TemporaryDirectory() as io_dir:
        files = [Path(io_dir) / name for name in ("in", "out", "err")]
        files[0].write_text(stdin)
        files[1].touch()
        files[2].touch()
        pid = _ask(zygote, (kind, payload, str(cwd), env, [str(f) for f in files]))
        code = _exit_code(zygote, pid, timeout)
        if code is None:
            os.kill(pid, signal.SIGKILL)
            _exit_code(zygote, pid, None)
            raise subprocess.TimeoutExpired(what, timeout)
        return subprocess.CompletedProcess(what, code, files[1].read_text(errors="replace"),
                                           files[2].read_text(errors="replace"))


def _zygote(env: dict[str, str], imports: tuple[str, ...]) -> subprocess.Popen:
    """This process's zygote of these imports, started with `env` if it is not running. Threads share it: it
    forks and answers at once, and a child's end is seen here (`_exit_code`), not waited for there."""
    with _zygotes_lock:
        zygote = _zygotes.get(imports)
        if zygote is None or zygote.poll() is not None:
            zygote = _zygotes[imports] = subprocess.Popen([sys.executable, "-c", ZYGOTE, *imports],
                                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                          env={**env, "PYTHONPATH": str(ROOT)})
            zygote.lock = threading.Lock()  # one request and its answer at a time
        return zygote


def _ask(zygote: subprocess.Popen, request: tuple):
    with zygote.lock:
        pickle.dump(request, zygote.stdin)
        zygote.stdin.flush()
        return pickle.load(zygote.stdout)


def _exit_code(zygote: subprocess.Popen, pid: int, timeout: float | None) -> int | None:
    """The exit code of the zygote's child `pid` once it ends (a pidfd says when: the child is the zygote's, so
    only the zygote can reap it), or None if it still runs after `timeout` seconds (None: no limit)."""
    pidfd = os.pidfd_open(pid)
    try:
        ended = select.select([pidfd], [], [], timeout)[0]
    finally:
        os.close(pidfd)
    return _ask(zygote, ("wait", pid, None, None, None)) if ended else None


class Started:
    """A forked child that runs while the test goes on (`start`): what `subprocess.Popen(..., stdout=PIPE,
    stderr=PIPE, text=True)` gives. Its pid is a real process's (signals reach it; /proc has it); its output is
    read as it writes it; `poll`, `wait`, `terminate`, `kill` and `returncode` as Popen's."""

    def __init__(self, zygote: subprocess.Popen, pid: int, out: Path, err: Path, io_dir: str | None, what: str) -> None:
        self._zygote, self.pid, self.args, self.returncode = zygote, pid, what, None
        self.stdout = open(out, errors="replace")  # noqa: SIM115 - open while the child runs (FIFOs the child
        self.stderr = open(err, errors="replace")  # noqa: SIM115 - has opened, or the files `output=` names)
        if io_dir:
            shutil.rmtree(io_dir)

    def poll(self) -> int | None:
        return self._reaped(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._reaped(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _reaped(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self.returncode = _exit_code(self._zygote, self.pid, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its whole output once it ends (read as it comes, so that a full pipe never stops it), as Popen's."""
        said: dict[str, str] = {}
        readers = [threading.Thread(target=lambda name, f: said.update({name: f.read()}), args=(name, f), daemon=True)
                   for name, f in (("out", self.stdout), ("err", self.stderr))]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join(timeout)
        return said.get("out", ""), said.get("err", "")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(*args: str, cwd: Path | str, env: dict[str, str] | None = None, imports: tuple[str, ...] = (),
          start_new_session: bool = False, output: Path | None = None) -> Started:
    """`lmrl ARGS...` in `cwd` as a forked child that runs while the test goes on (a server, a run a test signals):
    what `subprocess.Popen([sys.executable, "-m", "lmrl.cli", *args], cwd=cwd, env=env, stdout=PIPE, stderr=PIPE,
    text=True, start_new_session=...)` gives, without the interpreter's start-up. Wait for it (or the test's end
    kills it). `output`: its stdout and stderr go to the files OUTPUT.stdout and OUTPUT.stderr instead (a long run
    nobody reads while it runs)."""
    return _start("cli", list(args), shlex.join(["lmrl", *args]), cwd, env, imports, start_new_session, output)


def _start(kind: str, payload, what: str, cwd: Path | str, env: dict[str, str] | None, imports: tuple[str, ...],
           start_new_session: bool, output: Path | None = None) -> Started:
    """A started child (`start`); its stdout and stderr FIFOs, or with `output` the files OUTPUT.stdout and
    OUTPUT.stderr (nothing to read while it runs, nothing to block it)."""
    env = dict(os.environ) if env is None else env
    zygote = _zygote(env, imports)
    if output:
        io_dir, out, err = None, Path(f"{output}.stdout"), Path(f"{output}.stderr")
        out.touch()
        err.touch()
    else:
        io_dir = tempfile.mkdtemp(prefix="lmrl-started-")
        out, err = Path(io_dir) / "out", Path(io_dir) / "err"
        os.mkfifo(out)
        os.mkfifo(err)
    kind = f"setsid {kind}" if start_new_session else kind
    pid = _ask(zygote, (kind, payload, str(cwd), env, [os.devnull, str(out), str(err)]))
    return Started(zygote, pid, out, err, io_dir, what)


def lmrl(*args: str, cwd: Path | str, timeout: float = 240, env: dict[str, str] | None = None,
         stdin: str = "", imports: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`lmrl ARGS...` in `cwd` as a forked child: what `subprocess.run([sys.executable, "-m", "lmrl.cli", *args],
    cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` gives (env None: this process's
    environment), without the interpreter's start-up; `imports` as `forked` takes them."""
    return forked("cli", list(args), Path(cwd), timeout, shlex.join(["lmrl", *args]),
                  dict(os.environ) if env is None else env, stdin, imports)


def script(path: Path | str, *args: str, cwd: Path | str, timeout: float = 240, env: dict[str, str] | None = None,
           stdin: str = "", imports: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`python PATH ARGS...` in `cwd` as a forked child (PATH relative to `cwd`, or absolute), like `lmrl` above."""
    return forked("script", [str(path), *args], Path(cwd), timeout, shlex.join(["python", str(path), *args]),
                  dict(os.environ) if env is None else env, stdin, imports)


# torchrun itself (`torch.distributed.run.main`) in a forked child, its ranks forked from it (torchrun's own
# `--start-method fork --run-path`, with tests/torchrun_rank.py as the rank): torchrun's elastic agent, rendezvous,
# gloo process group, signals and exit codes, without three interpreters each importing torch and transformers
# (5.8 s a launch of two ranks here, 0.6 s forked). `lmrl train --nproc` (tests/test_distributed.py) still runs
# the real command, its ranks `python -m lmrl.cli`.
TORCHRUN = "import sys\nfrom torch.distributed.run import main\nmain(sys.argv[1:])\n"
RANK = str(ROOT / "tests" / "torchrun_rank.py")


def torchrun(*args: str, cwd: Path | str, nproc: int = 2, timeout: float = 300, env: dict[str, str] | None = None,
             launcher: tuple[str, ...] = ("--standalone",), imports: tuple[str, ...] = (),
             before: str = "") -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node NPROC -m lmrl ARGS...` in `cwd`, as `subprocess.run` gives it, its
    ranks forked (above). `launcher` replaces `--standalone` (the rendezvous of several launchers); ARGS starting
    with `--driver` run tests/dist_driver.py instead of lmrl. `before`: Python source the launcher runs first (what
    `subprocess.run`'s `preexec_fn` would do: a resource limit its ranks inherit)."""
    argv = _torchrun_argv(launcher, nproc, args)
    return forked("main", [before + TORCHRUN, "torchrun", *argv], Path(cwd), timeout, shlex.join(["torchrun", *argv]),
                  dict(os.environ) if env is None else env, imports=imports)


def start_torchrun(*args: str, cwd: Path | str, launcher: tuple[str, ...], output: Path, nproc: int = 1,
                   env: dict[str, str] | None = None, start_new_session: bool = False) -> Started:
    """`torchrun LAUNCHER --nproc_per_node NPROC -m lmrl ARGS...` in `cwd`, as `start` runs `lmrl`: a launcher that
    runs while the test goes on, e.g. one node's of a job of several (`launcher`: its rendezvous), its ranks forked
    (above); its stdout and stderr written to OUTPUT.stdout and OUTPUT.stderr."""
    argv = _torchrun_argv(launcher, nproc, args)
    return _start("main", [TORCHRUN, "torchrun", *argv], shlex.join(["torchrun", *argv]), cwd, env, (),
                  start_new_session, output)


def _torchrun_argv(launcher: tuple[str, ...], nproc: int, args: tuple[str, ...]) -> list[str]:
    return [*launcher, f"--nproc_per_node={nproc}", "--start-method", "fork", "--run-path", RANK, *args]
