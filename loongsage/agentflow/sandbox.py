"""Running code an agent wrote: in a namespace sandbox, or not at all.

Every call is a fresh set of Linux namespaces (user, mount, PID, network, IPC, UTS) built by
`sandbox_init.py`: the program sees read-only system folders and the Python installation, a private
size-limited /scratch as its only writable place, no network, and nothing of the run (data,
checkpoints, caches, /dev/shm weights). CPU, memory, processes, file size, wall time and output are
limited; when the program ends, or its time is up, every process it started is killed with it (PID
namespace). Where namespaces cannot be made, calls fail with the reason: there is no weaker
fallback. docs/sandbox.md states what this guarantees and what it does not.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from loongsage.agentflow.sandbox_init import LEFTOVER, SETUP_FAILED

_INIT = str(Path(__file__).with_name("sandbox_init.py"))
SYSTEM_READ_ONLY = ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock; the whole process tree is killed after it
    memory_mb: int = 256  # address space per process
    max_processes: int = 32  # processes (and threads) of the sandbox user
    max_output: int = 4000  # stdout/stderr characters returned to the model (the rest is cut)
    max_output_bytes: int = 1 << 20  # beyond this much output the program is killed
    scratch_mb: int = 64  # size of the writable /scratch (tmpfs)
    max_file_mb: int = 16  # largest file the program may write
    python: str | None = None  # interpreter inside the sandbox (default: this one's base installation)
    read_only: tuple[str, ...] = field(default_factory=tuple)  # more folders to show, read-only


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed for a limit (see `reason`)
    timed_out: bool = False
    reason: str | None = None  # why the call failed, when the sandbox ended it or could not start

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.reason is None

    def as_text(self) -> str:
        """What a tool call returns to the model."""
        if self.reason:
            return f"error: {self.reason}" + (f"\n{self.stdout}" if self.stdout else "")
        if self.exit_code:
            last = self.stderr.strip().splitlines()[-1:]
            return self.stdout + (last[0] if last else f"error: exit code {self.exit_code}")
        return self.stdout


def _python(limits: SandboxLimits) -> tuple[str, list[str]]:
    """The interpreter to run and the folders it needs (a venv's own folder is never shown: it may
    sit inside the project, next to the run's data)."""
    exe = limits.python or os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    prefix = sys.base_prefix if limits.python is None else str(Path(exe).resolve().parent.parent)
    return exe, [prefix]


def _spec(code: str, limits: SandboxLimits) -> dict:
    exe, folders = _python(limits)
    return {
        "argv": [exe, "-I", "-B", "/scratch/main.py"], "files": {"main.py": code},
        "read_only": list(SYSTEM_READ_ONLY) + folders + list(limits.read_only),
        "memory_mb": limits.memory_mb, "cpu_s": max(1, int(limits.timeout_s) + 1),
        "max_processes": limits.max_processes, "max_file_mb": limits.max_file_mb, "scratch_mb": limits.scratch_mb,
    }


class _Capture:
    """A stream's first (or, with `tail`, last) `keep` bytes; counts everything."""

    def __init__(self, keep: int, tail: bool = False):
        self.keep, self.tail, self.data, self.total = keep, tail, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.tail:
            self.data += chunk[-self.keep:]
            del self.data[:-self.keep]
        elif len(self.data) < self.keep:
            self.data += chunk[: self.keep - len(self.data)]

    def text(self) -> str:
        return self.data.decode(errors="replace")


async def run_python(code: str, limits: SandboxLimits | None = None, **overrides) -> SandboxResult:
    """Runs `code` as a program in a new sandbox; never raises for anything the program does."""
    limits = limits or SandboxLimits()
    if overrides:
        limits = SandboxLimits(**{**limits.__dict__, **overrides})
    if not sys.platform.startswith("linux"):
        return SandboxResult("", "", None, reason="sandbox unavailable: needs Linux namespaces")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", _INIT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True, env={"PATH": "/usr/bin:/bin"})
    proc.stdin.write(json.dumps(_spec(code, limits)).encode() + b"\n")
    proc.stdin.close()
    out, err = _Capture(limits.max_output), _Capture(limits.max_output, tail=True)  # tracebacks end last
    flooded = asyncio.Event()

    async def pump(stream: asyncio.StreamReader, sink: _Capture) -> None:
        while chunk := await stream.read(65536):  # drained to the end: only `keep` bytes are held
            sink.add(chunk)
            if out.total + err.total > limits.max_output_bytes:
                flooded.set()

    pumps = asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err))
    flood = asyncio.ensure_future(flooded.wait())
    done, _ = await asyncio.wait({pumps, flood}, timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
    flood.cancel()
    reason = None
    if pumps not in done:  # time or output limit: the whole tree goes (init's death ends the namespace)
        reason = "output limit exceeded" if flooded.is_set() else f"time limit exceeded ({limits.timeout_s:g} s)"
        _kill_group(proc.pid)
    await pumps  # end of file once every process that held the pipes is gone
    code_ = await proc.wait()
    if reason is None:
        reason = _reason(code_, err.text())
    return SandboxResult(out.text(), err.text(), None if reason and code_ < 0 else code_,
                         timed_out=reason is not None and reason.startswith("time limit"), reason=reason)


def _reason(code: int, stderr: str) -> str | None:
    """Why a finished program counts as failed because of the sandbox (None: its own exit status)."""
    if code == SETUP_FAILED and "sandbox:" in stderr:
        line = next(ln for ln in reversed(stderr.splitlines()) if ln.startswith("sandbox:"))
        return f"sandbox unavailable: {line.removeprefix('sandbox: ')}"
    if code == LEFTOVER:
        return "the program left processes running (all were killed)"
    if code == 128 + signal.SIGXCPU:
        return "CPU time limit exceeded"
    if code == 128 + signal.SIGXFSZ:
        return "file size limit exceeded"
    if code == 128 + signal.SIGKILL:
        return "killed (memory or process limit)"
    return None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
