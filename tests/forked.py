"""Commands run as children forked from a zygote: a process that has imported lmrl (torch, transformers) and run
nothing else. Each child is a real process (its own cwd, environment, output, exit code, signals) running the
same code as `lmrl ...` or `python script.py`, without the interpreter's 3 s of start-up: the documentation's
pages and the bad-inputs table run hundreds of commands. And stand-ins for `python` and `lmrl` (`stand_in`): what a
benchmark, a shell script or lmrl itself starts with them runs as such a child too."""

from __future__ import annotations

import os
import pickle
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A process that has imported lmrl and run nothing: each command of a page is a child forked from it. (Not from
# the test's own process: after other tests ran torch there, a forked child can crash in torch's thread pool.)
ZYGOTE = r"""
import ctypes, fcntl, io, marshal, os, pickle, select, shutil, signal, socket, sys, types
import gc, importlib
STAND_INS, listener = sys.argv[1], socket.socket(fileno=int(sys.argv[2]))  # see stand_in() below
for name in sys.argv[3:]:  # LMRL, VLLM, or a program's own (AGENT): imports only, no torch op runs here
    importlib.import_module(name)
gc.freeze()  # the imports' objects are never collected: a child's collections skip them (vLLM's start-up runs 6)
requests, replies = os.fdopen(0, "rb"), os.fdopen(1, "wb")
pickle.dump("ready", replies)  # what a stand-in's program would otherwise count as its own start-up
replies.flush()

def as_main(source, name, path0, file=True):
    module = types.ModuleType("__main__")
    if file:
        module.__file__ = name
    sys.modules["__main__"] = module
    if path0 is not None:
        sys.path.insert(0, path0)
    exec(compile(source, name, "exec"), module.__dict__)
    return 0

def script(argv, safe=False):  # as `python PATH ARGS...`: sys.path[0] is its folder (not with -P, -I), __file__ whole
    sys.argv = list(argv)
    with open(argv[0], "rb") as f:
        source = f.read()
    return as_main(source, os.path.abspath(argv[0]), None if safe else os.path.dirname(os.path.realpath(argv[0])))

FLAGS = set("BEIPqsSu")  # python's options without a value it takes, alone or together (-IS); not -O, -i, -b ...

def options(argv):  # the options `python ARGV...` starts with (those without a value, joined) and what follows
    taken, i = "", 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-", "-c", "-m"):
        if argv[i] in ("-W", "-X"):
            i += 1
        elif argv[i][1] not in "WX":
            if not set(argv[i][1:]) <= FLAGS:
                raise SystemExit(f"python (the stand-in of tests/forked.py): it does not take {argv[i]}")
            taken += argv[i][1:]
        i += 1
    return taken, argv[i:]

def python(argv, taken, env):  # `python` after its options: -c CODE, -m MODULE or a script, ARGS after them
    safe = "I" in taken or "P" in taken or env.get("PYTHONSAFEPATH")  # no sys.path[0]
    path = "" if "I" in taken or "E" in taken else env.get("PYTHONPATH", "")
    for entry in reversed([p for p in path.split(os.pathsep) if p and p not in sys.path]):
        sys.path.insert(0, entry)  # as it is read at start-up (after sys.path[0], inserted below)
    if argv[:1] == ["-c"]:
        sys.argv = ["-c", *argv[2:]]
        return as_main(argv[1], "<string>", None if safe else "", file=False)
    if argv[:1] == ["-m"]:
        import runpy, warnings
        sys.argv = ["-m", *argv[2:]]
        if not safe:
            sys.path.insert(0, os.getcwd())
        # a module the zygote imported (lmrl.cli) is run again as __main__, as a fresh `python -m` runs it: not
        # "found in sys.modules after import of package", a warning only the zygote's imports would give
        warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
        runpy._run_module_as_main(argv[1])  # what `python -m` calls
        return 0
    if not argv or argv[0] == "-":
        raise SystemExit("python (the stand-in of tests/forked.py): it runs no program from stdin")
    return script(argv, safe)

def child(kind, payload, cwd, env, files):
    code = 1
    try:
        words = kind.split()  # [setsid] [stand-in] cli | script | main | python
        if "setsid" in words:  # a session of its own, as Popen's start_new_session gives
            os.setsid()
        for fd, path in enumerate(files):  # first: a started child's output is a FIFO the test waits to open
            f = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if "stand-in" in words:  # the `python` this child starts is a stand-in too; multiprocessing's, real
            import multiprocessing.spawn
            multiprocessing.spawn.set_executable(sys.executable)  # (it reads sys.executable once, imported)
            sys.executable = os.path.join(STAND_INS, "python")
        taken, argv = options(payload) if words[-1] == "python" else ("", payload)
        if "u" in taken or env.get("PYTHONUNBUFFERED"):  # unbuffered, as python -u writes
            out = lambda fd: io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True)
        else:
            out = lambda fd: open(fd, "w", closefd=False)
        sys.stdin, sys.stdout, sys.stderr = open(0, closefd=False), out(1), out(2)
        if words[-1] == "cli":
            import lmrl.cli
            sys.argv = ["lmrl", *argv]
            code = lmrl.cli.main(argv) or 0
        elif words[-1] == "script":
            code = script(argv)
        elif words[-1] == "python":
            code = python(argv, taken, env)
        else:
            sys.argv = [argv[1], *argv[2:]]
            code = as_main(argv[0], argv[1], "")
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

def serve(conn):  # in a fork of the zygote: one stand-in's program, its parent, until it ends (stand_in below)
    try:
        head, fds, _, _ = socket.recv_fds(conn, 8, 250)
        size, request = int.from_bytes(head, "big"), b""
        while len(request) < size:
            chunk = conn.recv(size - len(request))
            if not chunk:
                return
            request += chunk
        kind, argv, cwd, env, numbers = marshal.loads(request)
        pid = os.fork()
        if pid == 0:  # the program: the stand-in's descriptors at their numbers; it ends if this process does
            conn.close()
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]
            for fd, number in zip(high, numbers):
                os.dup2(fd, number)
            for fd in (*fds, *high):
                if fd not in numbers:
                    os.close(fd)
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            child(f"stand-in {kind}", argv, cwd, env, ())
        for fd in fds:
            os.close(fd)
        conn.sendall(b"%d\n" % pid)
        pidfd = os.pidfd_open(pid)
        while pidfd not in select.select([conn, pidfd], [], [])[0]:
            if not conn.recv(1):  # the stand-in was killed: so is its program
                os.kill(pid, signal.SIGKILL)
        conn.sendall(b"%d\n" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    except OSError:
        pass
    finally:
        os._exit(0)

running, serving = set(), set()  # the children forked for the test (reaped when it asks), those serving stand-ins
while True:
    if listener in select.select([requests, listener], [], [])[0]:
        conn = listener.accept()[0]
        pid = os.fork()
        if pid == 0:
            listener.close()
            serve(conn)
        conn.close()
        serving = {p for p in serving if not os.waitpid(p, os.WNOHANG)[0]} | {pid}
        continue
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
            listener.close()
            child(kind, payload, cwd, env, files)
        running.add(reply)
    pickle.dump(reply, replies)
    replies.flush()
for pid in running | serving:  # the test's process is gone: so is what it started (a stand-in's, with its server)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
shutil.rmtree(STAND_INS, ignore_errors=True)  # the folder the test's process made (it may end with os._exit)
os._exit(0)  # not the interpreter's shutdown: it reports what was frozen as leaked (nanobind, in vLLM's Triton)
"""
_zygotes: dict[tuple[str, ...], subprocess.Popen] = {}  # this process's, one per set of imports
_zygotes_lock = threading.Lock()

# What the zygote of lmrl's commands imports: torch and transformers through lmrl.build and lmrl.cli, and what a run
# imports as it starts: the trainer, transformers' Llama (which imports torch._dynamo and DTensor), the tokenizer's
# auto class, the task, the report. A child that imported these itself took 1.5-3 s more (the pages and the
# bad-inputs table ran 2.7x slower).
LMRL = ("lmrl.build", "lmrl.cli", "lmrl.trainer", "lmrl.reward_trainer", "lmrl.data.tasks", "lmrl.report",
        "transformers.models.llama.modeling_llama", "transformers.models.auto.tokenization_auto")
# and vLLM's engine, for children that start one (`imports=VLLM`): a child forked from it starts its first engine in
# 3.7 s, against 6.4 s from LMRL's. Only those: a child that would not import vLLM should not run with what its
# import sets up (its logging, platform detection, registries).
VLLM = (*LMRL, "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
        "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama",
        "vllm.v1.sample.sampler", "vllm.v1.attention.backends.cpu_attn")
# an agent program's (tests/envs/calc_agent.py): the official `openai` client, 0.5 s of imports a fresh program
AGENT = ("openai",)

def forked(kind: str, payload, cwd: Path, timeout: float, what: str, env: dict[str, str],
           stdin: str = "", imports: tuple[str, ...] = LMRL, forked_python: bool = False
           ) -> subprocess.CompletedProcess:
    """A child forked from the zygote (ZYGOTE): `kind` "cli" runs `lmrl.cli.main(payload)`, "main" runs the
    source `payload[0]` as `__main__` (named `payload[1]`, argv `payload[1:]`, sys.path[0] the cwd), "script" the
    file `payload[0]` as `python payload[0] payload[1:]...` does; in `cwd`, with the environment `env`, stdin
    `stdin`, stdout and stderr captured. Like subprocess.run, without the interpreter's start-up. The environment
    is the child's os.environ: what torch or lmrl read from it at import time is the zygote's (the first call's).
    The child ends with os._exit: atexit handlers and the interpreter's shutdown do not run, so what only a
    process's normal exit shows (a hang joining children, a message at shutdown) needs a fresh process. `imports`:
    what the zygote imports (LMRL, VLLM: a zygote each). `forked_python`: the child's `sys.executable` is the
    zygote's stand-in `python` (`stand_in`), so that what it starts with it is forked as well."""
    zygote = _zygote(env, imports)
    kind = f"stand-in {kind}" if forked_python else kind
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
    forks and answers at once, and a child's end is seen here (`_exit_code`), not waited for there. Its stand-ins
    (`stand_in`) are in its folder, with the socket it listens on (bound here: a stand-in may call before the
    zygote has imported what it imports)."""
    with _zygotes_lock:
        zygote = _zygotes.get(imports)
        if zygote is None or zygote.poll() is not None:
            folder = Path(tempfile.mkdtemp(prefix="lmrl-zygote-"))  # the zygote removes it as it ends
            with socket.socket(socket.AF_UNIX) as listener:
                listener.bind(str(folder / "socket"))
                listener.listen(64)
                zygote = _zygotes[imports] = subprocess.Popen(
                    [sys.executable, "-c", ZYGOTE, str(folder), str(listener.fileno()), *imports],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(listener.fileno(),),
                    env={**env, "PYTHONPATH": str(ROOT)})
            for name, kind in (("python", "python"), ("lmrl", "cli")):
                (folder / name).write_text(f"#!{sys.executable} -IS\nKIND, SOCKET = {kind!r}, {str(folder / 'socket')!r}\n"
                                           + STAND_IN)
                (folder / name).chmod(0o755)
            zygote.lock = threading.Lock()  # one request and its answer at a time
            zygote.stand_ins, zygote.ready = folder, False
        return zygote


def _ready(zygote: subprocess.Popen) -> None:
    """Once the zygote has imported what it imports (its first word; the caller holds its lock)."""
    if not zygote.ready:
        said = pickle.load(zygote.stdout)
        assert said == "ready", said
        zygote.ready = True


def stand_in(imports: tuple[str, ...] = LMRL) -> Path:
    """A folder with `python` and `lmrl` programs that stand in for the real ones: each runs as a child forked from
    this process's zygote of `imports` (`python ARGS...` with python's usual options, a script, `-m` or `-c`;
    `lmrl ARGS...` as `lmrl.cli.main`), with the stand-in's arguments, working directory, environment and open
    descriptors, and the stand-in ends as its program does (the exit code or the signal). Signals sent to the
    stand-in reach the program; a stand-in killed (SIGKILL) takes its program with it. For what a test starts as
    users do (a benchmark's own `python -m lmrl.cli train`, torchrun's ranks, a shell script's commands, agent
    programs) where the interpreter's start-up is not what the test checks. Not where a test measures the
    children's memory (the program is not the caller's child: `RUSAGE_CHILDREN` does not see it), nor for a process
    that checks its parent: lmrl's spawned generator processes and the servers a run starts end themselves when
    their parent is not the trainer (multiprocessing starts real interpreters, even from a stand-in's program)."""
    zygote = _zygote(dict(os.environ), imports)
    with zygote.lock:
        _ready(zygote)  # a program's start-up is what it would be: not the zygote's imports
    return zygote.stand_ins


def python(imports: tuple[str, ...] = LMRL) -> str:
    """The stand-in `python` of `stand_in(imports)`."""
    return str(stand_in(imports) / "python")


# The stand-in (`stand_in`): a Python that imports nothing (-IS: 10 ms) hands its arguments, working directory,
# environment and open descriptors to the zygote over a unix socket; a fork of the zygote forks the program and
# waits for it, and answers with its pid and then its exit code. KIND and SOCKET come first in each stand-in's file.
STAND_IN = """import marshal, os, signal, socket, sys

pid, pending = None, []


def forward(signum, frame):  # to the program, once its pid is known
    if pid is None:
        pending.append(signum)
    else:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(signum, forward)
for fd in (0, 1, 2):  # a closed one is /dev/null to the program
    try:
        os.fstat(fd)
    except OSError:
        os.open(os.devnull, os.O_RDWR)
zygote = socket.socket(socket.AF_UNIX)
zygote.connect(SOCKET)
numbers = []
for name in os.listdir("/proc/self/fd"):
    if int(name) != zygote.fileno():
        try:
            os.fstat(int(name))  # not the listing's own descriptor, closed by now
            numbers.append(int(name))
        except OSError:
            pass
request = marshal.dumps((KIND, sys.argv[1:], os.getcwd(), dict(os.environ), numbers))
socket.send_fds(zygote, [len(request).to_bytes(8, "big")], numbers)
zygote.sendall(request)
replies = zygote.makefile("rb")
pid = int(replies.readline())
for signum in pending:
    forward(signum, None)
said = replies.readline()
code = int(said) if said else 1  # nothing: the zygote is gone, and the program with it
if code < 0:  # ended by a signal: the stand-in too
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
"""

def _ask(zygote: subprocess.Popen, request: tuple):
    with zygote.lock:
        _ready(zygote)
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


def start(*args: str, cwd: Path | str, env: dict[str, str] | None = None, imports: tuple[str, ...] = LMRL,
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
         stdin: str = "", imports: tuple[str, ...] = LMRL) -> subprocess.CompletedProcess:
    """`lmrl ARGS...` in `cwd` as a forked child: what `subprocess.run([sys.executable, "-m", "lmrl.cli", *args],
    cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` gives (env None: this process's
    environment), without the interpreter's start-up; `imports` as `forked` takes them."""
    return forked("cli", list(args), Path(cwd), timeout, shlex.join(["lmrl", *args]),
                  dict(os.environ) if env is None else env, stdin, imports)


def script(path: Path | str, *args: str, cwd: Path | str, timeout: float = 240, env: dict[str, str] | None = None,
           stdin: str = "", imports: tuple[str, ...] = LMRL, forked_python: bool = False) -> subprocess.CompletedProcess:
    """`python PATH ARGS...` in `cwd` as a forked child (PATH relative to `cwd`, or absolute), like `lmrl` above;
    `forked_python` as `forked` takes it."""
    return forked("script", [str(path), *args], Path(cwd), timeout, shlex.join(["python", str(path), *args]),
                  dict(os.environ) if env is None else env, stdin, imports, forked_python)


# torchrun itself (`torch.distributed.run.main`) in a forked child, its ranks forked from it (torchrun's own
# `--start-method fork --run-path`, with tests/torchrun_rank.py as the rank): torchrun's elastic agent, rendezvous,
# gloo process group, signals and exit codes, without three interpreters each importing torch and transformers
# (5.8 s a launch of two ranks here, 0.6 s forked). `lmrl train --nproc` (tests/test_distributed.py) still runs
# the real command, its ranks `python -m lmrl.cli`.
TORCHRUN = "import sys\nfrom torch.distributed.run import main\nmain(sys.argv[1:])\n"
RANK = str(ROOT / "tests" / "torchrun_rank.py")


def torchrun(*args: str, cwd: Path | str, nproc: int = 2, timeout: float = 300, env: dict[str, str] | None = None,
             launcher: tuple[str, ...] = ("--standalone",), imports: tuple[str, ...] = LMRL,
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
    return _start("main", [TORCHRUN, "torchrun", *argv], shlex.join(["torchrun", *argv]), cwd, env, LMRL,
                  start_new_session, output)


def _torchrun_argv(launcher: tuple[str, ...], nproc: int, args: tuple[str, ...]) -> list[str]:
    return [*launcher, f"--nproc_per_node={nproc}", "--start-method", "fork", "--run-path", RANK, *args]
