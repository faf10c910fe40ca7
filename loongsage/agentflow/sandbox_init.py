"""The sandbox's launcher, run as `python -I -S sandbox_init.py` with a JSON spec on stdin.

Standard library only (it must start fast and must not import the framework). Process chain:

    launcher (caller's user)       writes the child's uid/gid maps, waits, exits with its status
      └─ holder                    unshare(user, mount, PID, network, IPC, UTS); waits for init
           └─ init  (PID 1)        builds the new root, pivots into it, runs the program, reaps;
                └─ program         when init exits, the kernel kills every process left in the
                                   PID namespace, so nothing the program starts can outlive it

Inside, the program is uid 1000, which is `nobody` (65534) outside when the caller is root and the
caller's own uid otherwise; it has no capabilities, `no_new_privs`, and sees only: read-only binds of
the system folders and the Python installation, /dev/{null,zero,random,urandom}, a read-only /proc
of its own PID namespace, and /scratch (a size-limited tmpfs, the only writable place). The network
namespace has a loopback that is down: no route anywhere, abstract unix sockets of its own.

Exit statuses: the program's own, or 128+signal; `SETUP_FAILED` with a `sandbox: ...` line on
stderr when the sandbox could not be built (nothing of the program ran).
"""
import ctypes
import json
import os
import platform
import resource
import signal
import sys

SETUP_FAILED = 125
LEFTOVER = 124  # the program exited but processes it started were still running (all killed)
INNER_ID = 1000
_CLONE = {"ns": 0x20000, "uts": 0x4000000, "ipc": 0x8000000, "user": 0x10000000, "pid": 0x20000000,
          "net": 0x40000000}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
_KEEP_FLAGS = ((os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21))
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
DEVICES = ("null", "zero", "random", "urandom")
_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _mount(src, target: str, fstype, flags: int, data=None) -> None:
    _check(_libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                       data and data.encode()), f"mount {src or ''} on {target}")


def _bind_read_only(fd: int, target: str) -> None:
    """Bind by file descriptor (opened before the uid change, so paths the sandbox user could not
    traverse, like /root/.pyenv, still bind), then remount read-only keeping the flags the kernel
    locks in a user namespace."""
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    have = os.statvfs(target).f_flag
    for st, ms in _KEEP_FLAGS:
        if have & st:
            flags |= ms
    _mount(None, target, None, flags)


def _open_sources(paths: list[str]) -> list[tuple[str, str, object]]:
    """(path, "link" | "dir" | "file", symlink target or O_PATH fd) for each path that exists."""
    out = []
    for p in paths:
        if os.path.islink(p) and os.path.dirname(p) == "/":  # /bin -> usr/bin on merged-/usr systems
            out.append((p, "link", os.readlink(p)))
        elif os.path.exists(p):
            out.append((p, "dir" if os.path.isdir(p) else "file", os.open(p, os.O_PATH | os.O_CLOEXEC)))
    return out


def _build_root(spec: dict, sources, devices) -> None:
    new = "/tmp"  # mounted over only inside this private mount namespace
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, kind, value in sources:
        target = new + path
        if kind == "link":
            os.symlink(value, target)
            continue
        os.makedirs(target if kind == "dir" else os.path.dirname(target), exist_ok=True)
        if kind == "file":
            open(target, "w").close()
        _bind_read_only(value, target)
    os.makedirs(new + "/dev")
    for name, fd in devices:
        open(f"{new}/dev/{name}", "w").close()
        _mount(f"/proc/self/fd/{fd}", f"{new}/dev/{name}", None, MS_BIND)
    os.makedirs(new + "/scratch")
    _mount("tmpfs", new + "/scratch", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={int(spec['scratch_mb'])}m,mode=0700,nr_inodes=4096")
    os.symlink("/scratch", new + "/tmp")
    os.makedirs(new + "/proc")
    try:  # our own PID namespace's view; absent where the kernel refuses (some containers mask /proc)
        _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    except SetupError:
        os.rmdir(new + "/proc")
    for name, text in spec["files"].items():
        with open(f"{new}/scratch/{name}", "w") as f:
            f.write(text)
    os.makedirs(new + "/.old")
    number = _PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise SetupError(f"pivot_root: unknown system call number on {platform.machine()}")
    _check(_libc.syscall(number, new.encode(), (new + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", 2), "detach the old root")  # MNT_DETACH
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _libc.sethostname(b"sandbox", 7)


def _no_nested_namespaces() -> None:
    """No user namespace may be made inside ours (the limit is per user namespace): without one the
    program holds no capability anywhere, so it cannot mount, unshare or pivot."""
    try:
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
    except OSError as exc:
        raise SetupError(f"cannot forbid nested user namespaces: {exc}") from None


# Kernel interfaces a tool program never needs and kernel exploits often use: refused with EPERM
# (clone3 with ENOSYS, so the C library falls back to clone, whose namespace flags are checked).
_DENIED = {  # name: (x86_64, aarch64)
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "chroot": (161, 51), "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "open_by_handle_at": (304, 265), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442), "io_uring_setup": (425, 425),
}
_CLONE_NR, _CLONE3_NR = {"x86_64": 56, "aarch64": 220}, 435
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def _seccomp() -> None:
    """A seccomp filter (classic BPF) over the syscalls above; other architectures skip it (the
    namespaces and the nested-namespace limit still hold there)."""
    arch = platform.machine()
    if arch not in _AUDIT_ARCH:
        return
    col = 0 if arch == "x86_64" else 1
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys, kill = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000
    denied = sorted({nrs[col] for nrs in _DENIED.values()})
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, _AUDIT_ARCH[arch]), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if arch == "x86_64":
        prog.append((jge, 0, 1, 0x40000000))  # the x32 ABI's numbers
        prog.append((ret, 0, 0, eperm))
    prog += [(jeq, 0, 1, _CLONE3_NR), (ret, 0, 0, enosys), (jeq, 0, 3, _CLONE_NR[arch]), (ld, 0, 0, 16),
             (jset, 0, 1, _NAMESPACE_FLAGS), (ret, 0, 0, eperm), (ld, 0, 0, 0)]
    for i, nr in enumerate(denied):  # each jumps to the EPERM return after the last one
        prog.append((jeq, len(denied) - i, 0, nr))
    prog += [(ret, 0, 0, allow), (ret, 0, 0, eperm)]
    insns = (_Insn * len(prog))(*[_Insn(*i) for i in prog])
    fprog = _Prog(len(prog), insns)
    _check(_libc.prctl(22, 2, ctypes.byref(fprog), 0, 0), "seccomp")  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _limit_and_exec(spec: dict) -> None:
    """In the program's process: limits, no new privileges, stdin from /dev/null, then exec."""
    mb = 1 << 20
    for res, value in ((resource.RLIMIT_AS, spec["memory_mb"] * mb), (resource.RLIMIT_CPU, spec["cpu_s"]),
                       (resource.RLIMIT_FSIZE, spec["max_file_mb"] * mb), (resource.RLIMIT_NPROC, spec["max_processes"]),
                       (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _seccomp()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir("/scratch")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/scratch", "TMPDIR": "/scratch", "LANG": "C.UTF-8",
           "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
    os.execve(spec["argv"][0], spec["argv"], env)


def _init(spec: dict) -> int:
    """PID 1 of the sandbox. Returns the exit status for the caller."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    sources = _open_sources(spec["read_only"])
    devices = [(name, os.open(f"/dev/{name}", os.O_PATH | os.O_CLOEXEC)) for name in DEVICES]
    # The mapped id (files we create must have an owner the namespace knows); capabilities in the
    # namespace stay, since the id we leave (the unmapped outer root, or the caller) is not its root.
    os.setresgid(INNER_ID, INNER_ID, INNER_ID)
    os.setresuid(INNER_ID, INNER_ID, INNER_ID)
    _no_nested_namespaces()
    _build_root(spec, sources, devices)
    for _, _, value in sources:
        if isinstance(value, int):
            os.close(value)
    program = os.fork()
    if program == 0:
        try:
            _limit_and_exec(spec)
        except BaseException as exc:
            os.write(2, f"sandbox: cannot start the program: {exc}\n".encode())
        os._exit(SETUP_FAILED)
    status = None
    while status is None:  # reap orphans (they are re-parented to us) until the program ends
        pid, st = os.waitpid(-1, 0)
        if pid == program:
            status = os.waitstatus_to_exitcode(st)
    left = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            left += 1
            os.kill(-1, signal.SIGKILL)  # as PID 1: every other process of this namespace
            os.waitpid(-1, 0)
    if left:
        os.write(2, b"\nsandbox: the program left processes running; they were killed\n")
        return LEFTOVER
    return status if status >= 0 else 128 - status


def _holder(spec: dict, unshared_w: int, mapped_r: int) -> int:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    flags = 0
    for name in ("user", "ns", "pid", "net", "ipc", "uts"):
        flags |= _CLONE[name]
    try:
        _check(_libc.unshare(flags), "unshare(user, mount, pid, net, ipc, uts)")
    except SetupError as exc:
        os.write(unshared_w, str(exc).encode())
        return SETUP_FAILED
    os.write(unshared_w, b"ok")
    if os.read(mapped_r, 2) != b"ok":
        return SETUP_FAILED
    init = os.fork()
    if init == 0:
        try:
            code = _init(spec)
        except (SetupError, OSError) as exc:
            os.write(2, f"sandbox: {exc}\n".encode())
            code = SETUP_FAILED
        os._exit(code)
    _, st = os.waitpid(init, 0)
    code = os.waitstatus_to_exitcode(st)
    return code if code >= 0 else 128 - code


def _write_maps(pid: int) -> None:
    """Inner uid/gid 1000 is `nobody` outside when we are root, else our own ids."""
    root = os.geteuid() == 0
    uid, gid = (65534, 65534) if root else (os.geteuid(), os.getegid())
    with open(f"/proc/{pid}/setgroups", "w") as f:
        f.write("deny")
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(f"{INNER_ID} {uid} 1")
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(f"{INNER_ID} {gid} 1")


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    if os.geteuid() == 0:
        os.setgroups([])  # no supplementary group of root's may follow the program
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        os.close(unshared_r)
        os.close(mapped_w)
        os._exit(_holder(spec, unshared_w, mapped_r))
    os.close(unshared_w)
    os.close(mapped_r)
    answer = os.read(unshared_r, 4096)
    if answer == b"ok":
        try:
            _write_maps(holder)
            os.write(mapped_w, b"ok")
        except OSError as exc:
            os.write(2, f"sandbox: cannot map the sandbox user: {exc}\n".encode())
            os.kill(holder, signal.SIGKILL)
    else:
        os.write(2, f"sandbox: {answer.decode(errors='replace')}\n".encode())
    os.close(mapped_w)
    _, st = os.waitpid(holder, 0)
    code = os.waitstatus_to_exitcode(st)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
