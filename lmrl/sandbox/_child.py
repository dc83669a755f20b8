"""The sandbox's child side: set up the limits, then run the program read from stdin.

Run by `lmrl.sandbox` as `python -I -S _child.py SETTINGS_JSON` with an empty environment, the
program on stdin and a status pipe on fd 3. Standard library only (`-S` skips site-packages, so
lmrl itself is not importable here), and never imported by the trainer.

With isolation on, three processes, each with one job:

    bootstrap   unshare a new user (when not root), mount, network, pid, IPC and UTS namespace; fork
      init      pid 1 of the new pid namespace: mount a tmpfs as the work directory, remount every
                other mount read-only, mount a /proc that shows only this namespace; fork; wait.
                When it exits the kernel kills every process left in the namespace.
        worker  pid 2: drop root (to `nobody`) or every capability, set the rlimits, install the socket
                filter (`_refuse_sockets`) and the write confinement (`_confine_writes`), run the program

The trainer kills the bootstrap on a timeout; init dies with it (PR_SET_PDEATHSIG), and with init
the whole namespace. Setup failures go to the status pipe as `error: ...`, the worker writes `ready`
and closes it before the program runs, so a program cannot pretend a setup failure.
"""

import contextlib
import ctypes
import ctypes.util
import json
import os
import resource
import select
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
_MOUNT_OPTION_FLAGS = {
    "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME,
}

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class SetupError(Exception):
    pass


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _status(line):
    with contextlib.suppress(OSError):
        os.write(_STATUS_FD, (line + "\n").encode())


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), f"mount {target}")


def _lock_down_mounts(workdir, settings):
    """A tmpfs on `workdir`, every other mount read-only, a /proc of this pid namespace only."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    uid, gid = settings["run_uid"], settings["run_gid"]
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={settings['disk_bytes']},mode=0700,uid={uid},gid={gid}")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target = fields[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        if target == workdir:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):  # locked flags must be kept, or a user namespace refuses
            flags |= _MOUNT_OPTION_FLAGS.get(option, 0)
        if _libc.mount(None, target.encode(), None, ctypes.c_ulong(flags), None) != 0:
            err = ctypes.get_errno()
            # a mount hidden under another one cannot be reached, and so needs no remount
            if err not in (2, 13, 22):  # ENOENT, EACCES, EINVAL
                raise SetupError(f"remount {target} read-only: {os.strerror(err)}")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in settings["hide"]:  # the caller's home (keys, tokens): an empty read-only tmpfs on top
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=0555")


def _drop_privileges(settings, was_root):
    """Root becomes `nobody` (which loses every capability); anyone else clears its capabilities."""
    if was_root:
        os.setgroups([])
        os.setresgid(settings["run_gid"], settings["run_gid"], settings["run_gid"])
        os.setresuid(settings["run_uid"], settings["run_uid"], settings["run_uid"])
        # a user namespace of its own, so that RLIMIT_NPROC counts this sandbox's processes only and not
        # every `nobody` process of the machine; where the kernel refuses, the count stays machine-wide
        _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # else /proc/self stays root's and the maps cannot be written
        if _libc.unshare(CLONE_NEWUSER) == 0:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{settings['run_uid']} {settings['run_uid']} 1")
            _write("/proc/self/gid_map", f"{settings['run_gid']} {settings['run_gid']} 1")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    _check(_libc.capset(ctypes.byref(Header(0x20080522, 0)), ctypes.byref((Data * 2)())), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


# seccomp: the native architecture of each machine the filter knows, and its socket() number
AUDIT_ARCH = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
IO_URING_SETUP = 425  # the same number on both: it came after the tables were unified
AF_INET, AF_INET6 = 2, 10
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, EPERM = 0x7FFF0000, 0x00050000, 1
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06


def _refuse_sockets():
    """A seccomp filter: socket() of any family but AF_INET / AF_INET6 fails with EPERM, and so does
    io_uring_setup (its ring opens sockets without the socket() call) and any system call of another ABI
    (i386's socketcall, x32). The new network namespace leaves an internet socket nothing to reach and
    keeps abstract unix sockets out of reach, but a unix socket *file* of the host (a daemon's, a listener
    under /tmp) is a path, not a network: a read-only mount does not stop connect() to it, this does.
    socketpair() stays allowed: its two ends reach only each other."""
    machine = os.uname().machine
    if machine not in AUDIT_ARCH:
        raise SetupError(f"seccomp: no socket filter for this machine ({machine}): x86_64 and aarch64 only")
    arch, socket_nr = AUDIT_ARCH[machine]
    deny = SECCOMP_RET_ERRNO | EPERM
    program = [  # (code, jump if true, jump if false, k); seccomp_data: nr at 0, arch at 4, args[0] at 16
        (BPF_LD_W_ABS, 0, 0, 4),
        (BPF_JEQ_K, 1, 0, arch),
        (BPF_RET_K, 0, 0, deny),  # 2: another ABI
        (BPF_LD_W_ABS, 0, 0, 0),
        (BPF_JGE_K, 6, 0, X32_SYSCALL_BIT),  # -> 11
        (BPF_JEQ_K, 5, 0, IO_URING_SETUP),  # -> 11
        (BPF_JEQ_K, 1, 0, socket_nr),  # -> 8
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (BPF_LD_W_ABS, 0, 0, 16),  # 8: socket(family, ...)
        (BPF_JEQ_K, 3, 0, AF_INET),  # -> 13
        (BPF_JEQ_K, 2, 0, AF_INET6),  # -> 13
        (BPF_RET_K, 0, 0, deny),  # 11
        (BPF_RET_K, 0, 0, deny),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),  # 13
    ]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*f) for f in program])
    fprog = Program(len(program), filters)
    # no_new_privs is set (`_drop_privileges`): a process without CAP_SYS_ADMIN may install a filter
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp(socket filter)")


# Landlock (Linux 5.13+): the file-system rights it is told to handle are denied outside the rules' paths
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every architecture's numbers
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_WRITE_FILE, FS_REFER, FS_TRUNCATE = 1 << 1, 1 << 13, 1 << 14
FS_CHANGES = sum(1 << bit for bit in (4, 5, 6, 7, 8, 9, 10, 11, 12))  # remove and make: dirs, files, nodes, links
O_PATH = 0o10000000


def _confine_writes(workdir):
    """Landlock: the program may write, make and remove files only under `workdir` (and write /dev/null). The
    read-only mounts refuse writes to regular files, directories and links only; this also refuses writing a
    host's named pipe or device node. Where the kernel has no Landlock (older than 5.13, or not enabled), the
    mounts alone hold: returns False."""
    syscall = _libc.syscall
    syscall.restype = ctypes.c_long
    abi = syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 1:
        return False
    handled = FS_WRITE_FILE | FS_CHANGES | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    handled_attr = ctypes.c_uint64(handled)  # struct landlock_ruleset_attr's first field: enough for every ABI
    ruleset = syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(handled_attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset < 0:
        raise SetupError(f"landlock: create a ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for path, allowed in ((workdir, handled), (os.devnull, handled & (FS_WRITE_FILE | FS_TRUNCATE))):
            fd = os.open(path, O_PATH | os.O_CLOEXEC)
            try:
                rule = PathBeneath(allowed, fd)
                if syscall(LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
                    raise SetupError(f"landlock: allow {path}: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
        if syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            raise SetupError(f"landlock: restrict: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    return True


def _set_limits(settings):
    def limit(kind, soft, hard=None):
        resource.setrlimit(kind, (soft, soft if hard is None else hard))

    limit(resource.RLIMIT_CPU, settings["cpu_seconds"], settings["cpu_seconds"] + 1)
    limit(resource.RLIMIT_AS, settings["memory_bytes"])
    limit(resource.RLIMIT_FSIZE, settings["file_bytes"])
    limit(resource.RLIMIT_NOFILE, settings["open_files"])
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NPROC, settings["processes"])


def _exit_like(status):
    """End this process the way the worker ended. pid 1 of a namespace cannot kill itself with a
    signal, so a signal is told on the status pipe and the exit code is 128 + its number."""
    if os.WIFSIGNALED(status):
        _status(f"signal {os.WTERMSIG(status)}")
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _wait_for(pid):
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return status
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue


def _run_program(source, settings):
    """The worker's last step: the program runs in this process, as `__main__`."""
    os.chdir(settings["workdir"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _status("ready")
    os.close(_STATUS_FD)
    sys.argv = ["main.py"]
    namespace = {"__name__": "__main__", "__file__": os.path.join(settings["workdir"], "main.py"),
                 "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), namespace)  # noqa: S102 - this process exists to run it
    except SystemExit:
        raise
    except BaseException as e:  # the program's traceback, without this file's frames
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.stderr.flush()
        os._exit(1)


_STATUS_FD = -1


def main():
    global _STATUS_FD
    settings = json.loads(sys.argv[1])
    _STATUS_FD = settings["status_fd"]
    source = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    was_root = os.geteuid() == 0
    try:
        if not settings["isolate"]:
            if was_root:  # root ignores RLIMIT_NPROC
                os.setgroups([])
                os.setresgid(settings["run_gid"], settings["run_gid"], settings["run_gid"])
                os.setresuid(settings["run_uid"], settings["run_uid"], settings["run_uid"])
            _set_limits(settings)
        else:
            _isolate(settings, was_root)
    except (SetupError, OSError) as e:
        _status(f"error: {e}")
        os._exit(70)
    _run_program(source, settings)


def _isolate(settings, was_root):
    """Namespaces and mounts (bootstrap and init stay in here until they exit); returns in the worker."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(flags if was_root else flags | CLONE_NEWUSER), "unshare(network, pid, mount namespaces)")
    if not was_root:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    alive_r, alive_w = os.pipe()  # open in the bootstrap for as long as it lives
    init = os.fork()
    if init:  # bootstrap
        os.close(_STATUS_FD)
        os.close(alive_r)
        _exit_like(_wait_for(init))
    os.close(alive_w)
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if select.select([alive_r], [], [], 0)[0]:  # end of file: the bootstrap died before prctl
        os._exit(1)
    os.close(alive_r)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    _lock_down_mounts(settings["workdir"], settings)
    worker = os.fork()
    if worker:  # init: wait for the worker; leaving kills everything else in the namespace
        _exit_like(_wait_for(worker))
    _drop_privileges(settings, was_root)
    _set_limits(settings)
    _confine_writes(settings["workdir"])
    _refuse_sockets()


if __name__ == "__main__":
    main()
