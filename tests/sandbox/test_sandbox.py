"""The sandbox against hostile programs: each is stopped or refused, and the caller goes on unharmed.

Limits are small so that the table is fast and safe on a 2-core machine: the fork bomb meets
RLIMIT_NPROC (the programs run as `nobody` when the tests run as root) and dies with its pid namespace.
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from lmrl.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

LIMITS = SandboxLimits(timeout=2, cpu_seconds=2, memory_mb=256, processes=16, file_mb=1, disk_mb=8,
                       output_bytes=4096, max_parallel=2)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    try:
        return Sandbox(LIMITS)
    except SandboxUnavailable as e:  # a machine without namespaces: the refusal is tested below
        pytest.skip(f"no namespaces here: {e}")


def _parent(pid: str) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]


def _sandbox_processes() -> list[str]:
    """Processes still running the sandbox's child script (none should outlive a run): this test process's, or
    orphans (what escaped its run). Sandboxes of other pytest workers running beside this one are theirs."""
    found, me = [], str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"_child.py" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            ancestor = parent = _parent(pid)
            while ancestor not in (me, "0", "1"):
                ancestor = _parent(ancestor)
            if ancestor == me or parent in ("0", "1"):
                found.append(pid)
        except (OSError, IndexError):
            pass  # gone meanwhile
    return found


class _UnixListener:
    """A unix socket listener any user may connect to (its directory and file mode 0777), at a path in `where`
    (None: the abstract namespace), keeping what each connection sends."""

    def __init__(self, where: str | None) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        if where is None:
            self.path, self.directory = f"\0lmrl-test-{os.getpid()}-{id(self)}", None
            self.sock.bind(self.path)
        else:
            self.directory = tempfile.mkdtemp(prefix="lmrl-sock-", dir=where)
            os.chmod(self.directory, 0o777)
            self.path = os.path.join(self.directory, "listener.sock")
            self.sock.bind(self.path)
            os.chmod(self.path, 0o777)
        self.sock.listen()
        self.sock.settimeout(0.1)
        self.received: list[bytes] = []
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(1)
            with contextlib.suppress(OSError):
                self.received.append(conn.recv(100) or b"(connected)")
            conn.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close()
        if self.directory:
            shutil.rmtree(self.directory)


def _landlock() -> bool:
    """Whether this kernel has Landlock, which the sandbox confines writes with (named pipes, device nodes)."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True).syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)) >= 1


class _Fifo:
    """A named pipe any user may write (directory 0777, pipe 0666), in `where`, with a reader of its own."""

    def __init__(self, where: str) -> None:
        self.directory = tempfile.mkdtemp(prefix="lmrl-fifo-", dir=where)
        os.chmod(self.directory, 0o777)
        self.path = os.path.join(self.directory, "pipe")
        os.mkfifo(self.path)
        os.chmod(self.path, 0o666)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # a reader: a writer's open does not block

    def received(self) -> bytes:
        try:
            return os.read(self.fd, 100)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        os.close(self.fd)
        shutil.rmtree(self.directory)


class _Server:
    """A TCP server on 127.0.0.1 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close()


def test_a_plain_program_runs_and_prints(sandbox):
    result = sandbox.run("print(sum(range(10)))")
    assert result.ok and result.status == "ok" and result.returncode == 0
    assert result.stdout == "45\n" and result.stderr == ""


def test_an_exception_is_an_error_with_the_programs_own_traceback(sandbox):
    result = sandbox.run("def f():\n    raise ValueError('boom')\nf()\n")
    assert result.status == "error" and result.returncode == 1 and not result.killed
    assert "ValueError: boom" in result.stderr and 'File "main.py", line 2' in result.stderr
    assert "_child.py" not in result.stderr


def test_the_work_directory_is_private_writable_and_empty(sandbox):
    code = ("import os\nassert os.listdir('.') == [], os.listdir('.')\n"
            "open('f.txt', 'w').write('hi')\nprint(open('f.txt').read(), os.getcwd() == os.environ['HOME'])")
    result = sandbox.run(code)
    assert result.stdout == "hi True\n", result.stderr
    again = sandbox.run("import os\nprint(os.listdir('.'))")  # a fresh directory for every program
    assert again.stdout == "[]\n"


def test_the_hostile_table(sandbox, tmp_path, monkeypatch):
    """Each program prints ESCAPED only if it got what it went for."""
    monkeypatch.setenv("LMRL_TEST_SECRET", "hunter2-in-the-trainer")
    outside = tmp_path / "outside.txt"
    server = _Server()
    listeners = [_UnixListener("/tmp"), _UnixListener("/dev/shm" if os.path.isdir("/dev/shm") else None),
                 _UnixListener(None)]
    fifos = [_Fifo("/tmp"), *([_Fifo("/dev/shm")] if os.path.isdir("/dev/shm") else [])] if _landlock() else []
    table = {
        "endless loop": ("while True:\n    pass\n", {"timeout", "cpu_limit"}),
        "fork bomb": (
            "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n",
            {"timeout", "cpu_limit"},
        ),
        "allocating 20 GB": ("x = bytearray(20 * 2**30)\nprint('ESCAPED')\n", {"error"}),
        "writing outside its directory": (
            f"import os\nfor path in [{str(outside)!r}, '/tmp/lmrl-escaped', os.path.expanduser('~root/escaped')]:\n"
            "    try:\n        open(path, 'w').write('x')\n        print('ESCAPED', path)\n    except OSError:\n        pass\n"
            "raise SystemExit(1)\n",
            {"error"},
        ),
        "reading the parent's environment": (
            "import os\nleaks = [v for v in os.environ.values() if 'hunter2' in v]\n"
            "for pid in os.listdir('/proc'):\n    try:\n        data = open(f'/proc/{pid}/environ', 'rb').read()\n"
            "    except OSError:\n        continue\n    if b'hunter2' in data:\n        leaks.append(pid)\n"
            "if leaks:\n    print('ESCAPED', leaks)\nraise SystemExit(1)\n",
            {"error"},
        ),
        "opening a socket to a local server": (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {server.port}), timeout=1)\nprint('ESCAPED')\n",
            {"error"},
        ),
        "reaching the host's unix sockets": (  # a read-only mount does not stop connect(): the socket filter does
            f"import socket\nfor path in {[u.path for u in listeners]!r}:\n    try:\n"
            "        s = socket.socket(socket.AF_UNIX)\n        s.connect(path)\n"
            "        s.sendall(b'ESCAPED')\n        print('ESCAPED', repr(path))\n    except OSError:\n        pass\n"
            "raise SystemExit(1)\n",
            {"error"},
        ),
        "writing the host's named pipes": (  # a read-only mount does not stop it either: Landlock does
            f"import os\nfor path in {[f.path for f in fifos]!r}:\n    try:\n"
            "        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)\n        os.write(fd, b'ESCAPED')\n"
            "        print('ESCAPED', path)\n    except OSError:\n        pass\nraise SystemExit(1)\n",
            {"error"},
        ),
        "printing 1 GB": ("import sys\nfor _ in range(2**20):\n    sys.stdout.write('x' * 1024)\nprint('ESCAPED')\n",
                          {"output_limit"}),
    }
    try:
        for name, (code, expected) in table.items():
            t0 = time.perf_counter()
            result = sandbox.run(code)
            assert result.status in expected, (name, result)
            assert not result.ok and "ESCAPED" not in result.stdout, (name, result.stdout)
            assert time.perf_counter() - t0 < LIMITS.timeout + 2, name
            assert len(result.stdout) <= LIMITS.output_bytes
            assert _sandbox_processes() == [], f"{name}: processes outlived the run"
    finally:
        server.close()
        for listener in listeners:
            listener.close()
        received = [f.received() for f in fifos]
        for fifo in fifos:
            fifo.close()
    assert server.accepted == 0
    assert [u.received for u in listeners] == [[], [], []]
    assert received == [b""] * len(fifos)
    assert not outside.exists() and not Path("/tmp/lmrl-escaped").exists()
    assert os.environ["LMRL_TEST_SECRET"] == "hunter2-in-the-trainer"
    assert sandbox.run("print('still fine')").stdout == "still fine\n"  # and the caller goes on


def test_the_socket_filter_refuses_unix_sockets_and_leaves_internet_ones_and_socketpairs(sandbox):
    code = ("import ctypes, errno, socket\n"
            "def refused(make):\n    try:\n        make()\n    except PermissionError:\n        return True\n"
            "    return False\n"
            "print(refused(lambda: socket.socket(socket.AF_UNIX)), refused(lambda: socket.socket(socket.AF_UNIX, "
            "socket.SOCK_DGRAM)), refused(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)))\n"
            "a, b = socket.socketpair()\na.sendall(b'pair')\nprint(b.recv(4).decode())\n"
            "print(socket.socket(socket.AF_INET).family.name, socket.socket(socket.AF_INET6).family.name)\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "params = ctypes.create_string_buffer(120)\n"
            "print(libc.syscall(425, 8, params), ctypes.get_errno() == errno.EPERM)\n")  # io_uring_setup
    result = sandbox.run(code)
    assert result.stdout.splitlines() == ["True True True", "pair", "AF_INET AF_INET6", "-1 True"], result.stderr


def test_the_process_limit_refuses_forks_beyond_it(sandbox):
    code = ("import os, time\nkids = 0\nwhile kids < 100:\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        break\n    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n    kids += 1\nprint(kids)\n")
    result = sandbox.run(code)
    assert result.ok, result
    # the program itself is one of them (and without root, the namespace's init too)
    assert LIMITS.processes - 3 <= int(result.stdout) <= LIMITS.processes - 1
    assert _sandbox_processes() == []  # its sleeping children died with its pid namespace


def test_file_size_and_disk_limits(sandbox):
    too_big = sandbox.run("open('big', 'wb').write(b'x' * (2 * 2**20))")
    assert too_big.status == "error" and "File too large" in too_big.stderr
    disk_full = sandbox.run("for i in range(20):\n    open(f'f{i}', 'wb').write(b'x' * (2**20 - 1))\n")
    assert disk_full.status == "error" and "No space left" in disk_full.stderr


def test_no_network_interface_is_up(sandbox):
    # /proc/net/dev: the interfaces of the program's network namespace (if_nameindex asks netlink, which the
    # socket filter refuses)
    result = sandbox.run("print([line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]])")
    assert result.stdout.strip() == "['lo']", result.stderr  # only loopback exists, and it is down
    down = sandbox.run("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)")
    assert down.status == "error" and "unreachable" in down.stderr


def test_run_many_keeps_order_and_bounds_parallelism(sandbox):
    code = "import time\nt = time.time()\ntime.sleep(0.3)\nprint({i}, t)"
    results = sandbox.run_many([code.format(i=i) for i in range(4)])
    assert [int(r.stdout.split()[0]) for r in results] == [0, 1, 2, 3]
    starts = sorted(float(r.stdout.split()[1]) for r in results)
    # two at a time: the third program starts only after one of the first two ended
    assert starts[2] - starts[0] >= 0.25


def test_limits_are_checked_where_defined():
    with pytest.raises(ValueError, match=r"sandbox.timeout: expected a positive number, got 0"):
        SandboxLimits(timeout=0)
    with pytest.raises(ValueError, match=r"sandbox.allow_network_fallback: expected true or false"):
        SandboxLimits(allow_network_fallback="yes")


_NON_ROOT_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from lmrl.sandbox import Sandbox, SandboxLimits
sandbox = Sandbox(SandboxLimits(timeout=2, processes=8, memory_mb=256))
fork = "import os, time\\nkids = 0\\nwhile kids < 50:\\n    try:\\n        pid = os.fork()\\n    except OSError:\\n        break\\n    if pid == 0:\\n        time.sleep(3)\\n        os._exit(0)\\n    kids += 1\\nprint(kids)"
caps = "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])"
results = [sandbox.run(fork), sandbox.run(caps),
           sandbox.run("import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)"),
           sandbox.run("open('/tmp/lmrl-escaped-nobody', 'w')"), sandbox.run("print(open({secret!r}).read())"),
           sandbox.run("import socket\\ns = socket.socket(socket.AF_UNIX)\\ns.connect({unix!r})\\ns.sendall(b'ESCAPED')")]
print(sandbox.isolated, [(r.status, r.stdout.strip()) for r in results])
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
                    reason="needs root to start a process as another user")
def test_without_root_a_user_namespace_isolates_hides_home_and_leaves_no_capability():
    # a copy of the package that user can read (a checkout may sit in a directory only root can enter)
    code = Path(tempfile.mkdtemp(prefix="lmrl-code-"))
    shutil.copytree(Path(__file__).resolve().parents[2] / "lmrl", code / "lmrl",
                    ignore=shutil.ignore_patterns("assets", "__pycache__"))
    for path in (code, *code.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    root = str(code)
    home = Path(tempfile.mkdtemp(prefix="lmrl-home-"))  # the user's home, with a secret the user can read
    secret = home / "token"
    secret.write_text("hunter2")
    for path in (home, secret):
        os.chown(path, 65534, 65534)
    listener = _UnixListener("/tmp")  # the host's, open to every user
    try:
        out = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
             _NON_ROOT_SCRIPT.format(root=root, secret=str(secret), unix=listener.path)],
            capture_output=True, text=True, timeout=60, cwd="/tmp", env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        )
    finally:
        listener.close()
        shutil.rmtree(home)
        shutil.rmtree(code)
    assert out.returncode == 0, out.stderr
    isolated, results = out.stdout.split(" ", 1)
    assert isolated == "True"
    results = ast.literal_eval(results)  # the script's printed list of (status, output) tuples
    assert results[0][0] == "ok" and 1 <= int(results[0][1]) <= 7
    assert results[1] == ("ok", "0000000000000000")
    assert results[2][0] == "error" and results[3][0] == "error"
    assert not Path("/tmp/lmrl-escaped-nobody").exists()
    assert results[4][0] == "error" and "hunter2" not in results[4][1]  # the home directory is hidden
    assert results[5][0] == "error" and listener.received == []  # the socket filter holds without root too


def test_without_namespaces_it_refuses_in_one_line_unless_fallback_is_allowed(tmp_path, monkeypatch, capfd):
    import lmrl.sandbox as sandbox_module

    # a child that fails to unshare, as on a machine that forbids namespaces, and otherwise runs the real one
    fake = tmp_path / "child.py"
    fake.write_text(
        "import json, os, sys\n"
        "settings = json.loads(sys.argv[1])\n"
        "if settings['isolate']:\n"
        "    os.write(settings['status_fd'], b'error: unshare(network, pid, mount namespaces): Operation not permitted\\n')\n"
        "    os._exit(70)\n"
        f"os.execv(sys.executable, [sys.executable, '-I', '-S', '-B', {sandbox_module._CHILD!r}, sys.argv[1]])\n"
    )
    monkeypatch.setattr(sandbox_module, "_CHILD", str(fake))
    monkeypatch.setattr(sandbox_module, "_probe_cache", {})
    with pytest.raises(SandboxUnavailable) as info:
        Sandbox(LIMITS)
    message = str(info.value)
    assert "\n" not in message and "Operation not permitted" in message
    assert "sandbox.allow_network_fallback=true" in message
    fallback = Sandbox(SandboxLimits(timeout=2, allow_network_fallback=True))
    assert fallback.isolated is False
    assert "model-written code can reach the network" in capfd.readouterr().err
    assert fallback.run("print(6 * 7)").stdout == "42\n"
    assert fallback.run("while True:\n    pass\n").status in ("timeout", "cpu_limit")


def test_the_config_section_gives_the_limits():
    from lmrl.config import load_config
    from lmrl.errors import ConfigError

    cfg = load_config(None, ["sandbox.timeout=3", "sandbox.processes=8", "sandbox.allow_network_fallback=true"])
    assert cfg.sandbox.limits() == SandboxLimits(timeout=3, processes=8, allow_network_fallback=True)
    with pytest.raises(ConfigError, match=r"^sandbox.memory_mb: "):
        load_config(None, ["sandbox.memory_mb=0"])


def test_an_interpreter_that_does_not_run_is_one_line(monkeypatch):
    import lmrl.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "_probe_cache", {})
    with pytest.raises(SandboxUnavailable) as info:
        Sandbox(SandboxLimits(python="/nonexistent/python3"))
    message = str(info.value)
    assert message.startswith("sandbox.python: no interpreter runs a program in the sandbox (/nonexistent/python3: ")
    assert "\n" not in message
