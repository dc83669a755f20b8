"""Running untrusted, model-written Python in a separate, limited process.

    sandbox = Sandbox(SandboxLimits(timeout=5))
    result = sandbox.run("print(sum(range(10)))")   # SandboxResult(status="ok", stdout="45\\n", ...)
    results = sandbox.run_many(programs)             # at most `max_parallel` processes at once

Model outputs are never executed in the trainer's process. Each program runs in a fresh Python
process (`_child.py`, standard library only) that gets:

- a wall-clock limit (`timeout`, enforced by this process, which kills the whole process tree) and a
  CPU-time limit (RLIMIT_CPU);
- an address-space limit (RLIMIT_AS), a process-count limit (RLIMIT_NPROC, which root ignores: as
  root the program runs as `nobody`), a file-size limit (RLIMIT_FSIZE), a limit on open files;
- no network: a new network namespace with no interface up, not even loopback;
- a new pid namespace (it sees only its own processes, and they all die with it), a new mount
  namespace in which every mount is read-only except its own size-limited tmpfs work directory, and
  a /proc that shows only its own processes;
- an empty environment (only PATH, HOME and TMPDIR, set by lmrl; nothing inherited) and an empty stdin;
- without root, the caller's home directory hidden under an empty tmpfs (unless the interpreter lives in it);
- stdout and stderr cut at `output_bytes` each (a program that writes more is stopped).

Namespaces need root, or a kernel that allows unprivileged user namespaces. Where neither is
available, `Sandbox()` refuses to start with one line, unless `allow_network_fallback=True`, which
runs programs with the rlimits, the empty environment and the output cut only (network, the file
system as the user sees it and other processes are then reachable). See docs/agents.md for what
the sandbox does not protect against.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from lmrl.errors import RunError, print_line

_CHILD = str(Path(__file__).with_name("_child.py"))
NOBODY = 65534

Status = Literal["ok", "error", "timeout", "cpu_limit", "file_limit", "output_limit", "killed", "setup_error"]
KILL_STATUSES = ("timeout", "cpu_limit", "file_limit", "output_limit", "killed")


class SandboxUnavailable(RunError):
    """The machine cannot isolate programs the way the sandbox requires (one-line message)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use. Defaults suit test-running and calculator-style tools.

    Attributes:
        timeout: wall-clock seconds before the program and everything it started are killed.
        cpu_seconds: CPU seconds per process (RLIMIT_CPU).
        memory_mb: address space per process, in MiB (RLIMIT_AS); Python needs about 30 MiB.
        processes: processes the program may have at once, itself included (RLIMIT_NPROC).
        file_mb: largest file it may write, in MiB (RLIMIT_FSIZE).
        disk_mb: size of its private tmpfs work directory, in MiB (counts toward RAM while it lives).
        open_files: file descriptors per process (RLIMIT_NOFILE).
        output_bytes: bytes kept of stdout and of stderr each; writing more stops the program.
        max_parallel: programs run at once by `run_many` (and by concurrent `run` calls).
        allow_network_fallback: where namespaces are unavailable, run anyway without network, mount
            and pid isolation (the rlimits, empty environment and output cut still apply).
        python: the interpreter programs run with (standard library only: site-packages are left
            out). None: this Python, or, when programs cannot read its files (a Python under /root
            while programs run as `nobody`), the first of /usr/bin/python3, /usr/local/bin/python3 that works.
    """

    timeout: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    processes: int = 32
    file_mb: int = 16
    disk_mb: int = 64
    open_files: int = 256
    output_bytes: int = 65536
    max_parallel: int = 4
    allow_network_fallback: bool = False
    python: str | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name == "python":
                if value is not None and (not isinstance(value, str) or not value):
                    raise ValueError(f"sandbox.python: expected a path to a Python interpreter, got {value!r}")
            elif name == "allow_network_fallback":
                if not isinstance(value, bool):
                    raise ValueError(f"sandbox.{name}: expected true or false, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox.{name}: expected a positive number, got {value!r}")


@dataclass
class SandboxResult:
    """How one program ended.

    Attributes:
        status: "ok" (exit code 0), "error" (another exit code: an exception, a failed assert, a
            MemoryError at the address-space limit), "timeout" (wall clock), "cpu_limit",
            "file_limit" (wrote a file over `file_mb`), "output_limit" (wrote more than
            `output_bytes`), "killed" (another signal), "setup_error" (the sandbox failed to start it).
        returncode: the exit code, or -signal; None when lmrl killed it.
        stdout: what it printed, cut at `output_bytes` (decoded as UTF-8, bad bytes replaced).
        stderr: same for stderr; for "setup_error" the reason.
        seconds: wall-clock time from start to end.
    """

    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def killed(self) -> bool:
        """Stopped by a limit rather than ending by itself."""
        return self.status in KILL_STATUSES


_probe_lock = threading.Lock()
_probe_cache: dict[tuple[str | None, bool], tuple[str, bool]] = {}
_PROBE = "import json, socket, traceback\nprint('ok')"


class Sandbox:
    """Runs Python programs under `limits`; see the module docstring for what that means.

    Raises:
        SandboxUnavailable: no namespaces on this machine and `allow_network_fallback` is False.
    """

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._slots = threading.BoundedSemaphore(self.limits.max_parallel)
        self.python, self.isolated = _choose_python(self.limits.python, self.limits.allow_network_fallback)

    def run(self, code: str) -> SandboxResult:
        """Run one program; never raises for anything the program does."""
        with self._slots:
            return _run(code, self.limits, self.isolated, self.python)

    def run_many(self, programs: list[str]) -> list[SandboxResult]:
        """Run several programs, `max_parallel` at a time; results in the same order."""
        if not programs:
            return []
        workers = min(self.limits.max_parallel, len(programs))
        with ThreadPoolExecutor(workers, thread_name_prefix="lmrl-sandbox") as pool:
            return list(pool.map(self.run, programs))


def _choose_python(python: str | None, allow_fallback: bool) -> tuple[str, bool]:
    """(interpreter, isolated): the first interpreter that runs a small program in the sandbox here,
    isolated if possible. Probed once per process and setting."""
    with _probe_lock:
        key = (python, allow_fallback)
        if key not in _probe_cache:
            _probe_cache[key] = _probe(python, allow_fallback)
        return _probe_cache[key]


def _probe(python: str | None, allow_fallback: bool) -> tuple[str, bool]:
    candidates = [python] if python else list(dict.fromkeys(
        p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3") if p and os.path.exists(p)
    ))
    limits = SandboxLimits(timeout=30)
    problems = []
    for isolated in (True, False) if allow_fallback else (True,):
        for candidate in candidates:
            result = _run(_PROBE, limits, isolated, candidate)
            if result.status == "ok" and result.stdout == "ok\n":
                if not isolated:
                    print_line(f"lmrl: warning: sandbox without namespaces ({problems[0]}): "
                               "model-written code can reach the network, the file system and other processes")
                return candidate, isolated
            lines = (result.stderr.strip() or result.status).splitlines()
            problems.append(f"{candidate}: {lines[-1][:200] if lines else result.status}")
    if any("unshare" in p or "mount" in p for p in problems):
        raise SandboxUnavailable(
            f"sandbox: cannot isolate model-written code on this machine ({problems[0]}); run as root or where "
            "unprivileged user namespaces are allowed, or set sandbox.allow_network_fallback=true to run it "
            "without network, mount and pid isolation"
        )
    raise SandboxUnavailable(f"sandbox.python: no interpreter runs a program in the sandbox ({'; '.join(problems)}); "
                             "set sandbox.python to a Python whose files every user can read")


def _ids() -> tuple[int, int]:
    """The uid and gid programs run as: `nobody` for root (which ignores RLIMIT_NPROC), else the caller's."""
    if os.geteuid() == 0:
        return NOBODY, NOBODY
    return os.geteuid(), os.getegid()


def _hidden_dirs(python: str) -> list[str]:
    """Directories covered by an empty tmpfs inside the sandbox: the caller's home (ssh keys, hub tokens), unless
    the interpreter lives there. As root, programs run as `nobody`, whom file permissions already keep out."""
    if os.geteuid() == 0:
        return []
    home = os.path.realpath(os.path.expanduser("~"))
    return [] if home in ("/", "") or os.path.realpath(python).startswith(home + os.sep) else [home]


def _run(code: str, limits: SandboxLimits, isolated: bool, python: str) -> SandboxResult:
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="lmrl-sandbox-")
    uid, gid = _ids()
    status_r, status_w = os.pipe()
    try:
        if os.geteuid() == 0:
            os.chown(workdir, uid, gid)  # without isolation this directory itself is the work directory
        settings = {
            "isolate": isolated, "workdir": workdir, "status_fd": status_w, "run_uid": uid, "run_gid": gid,
            "cpu_seconds": int(max(1, limits.cpu_seconds)), "memory_bytes": int(limits.memory_mb * 2**20),
            "processes": int(limits.processes), "file_bytes": int(limits.file_mb * 2**20),
            "disk_bytes": int(limits.disk_mb * 2**20), "open_files": int(limits.open_files),
            "hide": _hidden_dirs(python),
        }
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir}
        try:
            proc = subprocess.Popen(
                [python, "-I", "-S", "-B", _CHILD, json.dumps(settings)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=workdir,
                pass_fds=(status_w,), start_new_session=True,
            )
        except OSError as e:  # the interpreter cannot be started at all
            return SandboxResult("setup_error", None, "", f"cannot start {python}: {e.strerror or e}",
                                 time.perf_counter() - start)
        os.close(status_w)
        status_w = -1
        try:
            proc.stdin.write(code.encode("utf-8", errors="replace"))
            proc.stdin.close()
        except BrokenPipeError:  # it died before reading its program: the status pipe says why
            pass
        out, err, status_text, stopped = _collect(proc, status_r, limits, start)
        returncode = proc.wait()
    finally:
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)
        shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.perf_counter() - start
    stdout, stderr = (b.decode("utf-8", errors="replace") for b in (out, err))
    lines = status_text.decode("utf-8", errors="replace").splitlines()
    if stopped is not None:
        return SandboxResult(stopped, None, stdout, stderr, seconds)
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if errors or "ready" not in lines:
        reason = errors[0] if errors else f"the sandbox process exited with {returncode} before the program started"
        return SandboxResult("setup_error", returncode, stdout, reason, seconds)
    signals = [int(line.split()[1]) for line in lines if line.startswith("signal ")]
    if signals:
        returncode = -signals[0]  # told by the namespace's init, which cannot die by a signal itself
    if returncode == 0:
        status: Status = "ok"
    elif returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and seconds >= limits.cpu_seconds):
        status = "cpu_limit"
    elif returncode == -signal.SIGXFSZ:
        status = "file_limit"
    elif returncode < 0:
        status = "killed"
    else:
        status = "error"
    return SandboxResult(status, returncode, stdout, stderr, seconds)


def _collect(
    proc: subprocess.Popen, status_r: int, limits: SandboxLimits, start: float
) -> tuple[bytes, bytes, bytes, Status | None]:
    """Read stdout, stderr and the status pipe until all close; kill at the deadline or the output cut.

    Returns (stdout, stderr, status text, "timeout" / "output_limit" or None).
    """
    buffers = {"out": bytearray(), "err": bytearray(), "status": bytearray()}
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ, "out")
    selector.register(proc.stderr, selectors.EVENT_READ, "err")
    selector.register(status_r, selectors.EVENT_READ, "status")
    stopped: Status | None = None
    deadline = start + limits.timeout
    try:
        while selector.get_map():
            left = deadline - time.perf_counter()
            if left <= 0:
                stopped = "timeout"
                break
            for key, _ in selector.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.data]
                buffer += chunk
                if key.data != "status" and len(buffer) > limits.output_bytes:
                    del buffer[limits.output_bytes:]
                    stopped = "output_limit"
            if stopped:
                break
        if not stopped:  # every pipe closed: the process is exiting; its exit status comes within moments
            try:
                proc.wait(timeout=max(0.5, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                stopped = "timeout"
    finally:
        selector.close()
        if stopped or proc.poll() is None:
            _kill(proc)
            _drain([proc.stdout, proc.stderr], seconds=5.0)
        proc.stdout.close()
        proc.stderr.close()
    return bytes(buffers["out"]), bytes(buffers["err"]), bytes(buffers["status"]), stopped


def _drain(pipes: list, seconds: float) -> None:
    """Read the pipes to their end: every process that inherited them (a fork bomb's children) has exited,
    which the kernel does asynchronously once the pid namespace's init is gone."""
    selector = selectors.DefaultSelector()
    for pipe in pipes:
        selector.register(pipe, selectors.EVENT_READ)
    deadline = time.perf_counter() + seconds
    try:
        while selector.get_map() and time.perf_counter() < deadline:
            for key, _ in selector.select(timeout=max(0.0, deadline - time.perf_counter())):
                if not os.read(key.fd, 65536):
                    selector.unregister(key.fileobj)
    finally:
        selector.close()


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process group; with isolation the bootstrap's death takes the pid namespace with it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


__all__ = ["KILL_STATUSES", "Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable"]
