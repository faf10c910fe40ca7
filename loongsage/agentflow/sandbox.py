"""Python execution for agents: a subprocess with time, memory and output limits, a temporary
working folder, and no network.

Network is cut twice: the child enters new user + network namespaces (only a down loopback inside)
where the kernel allows unprivileged namespaces, and an audit hook that code cannot remove refuses
sockets, subprocesses, forks and ctypes in any case.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import sys
import tempfile
from dataclasses import dataclass

_PRELUDE = r'''
import sys
_DENY = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
         "os.forkpty", "ctypes.", "pty.")
def _hook(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_hook)
del _hook
_src = open("main.py").read()
exec(compile(_src, "main.py", "exec"), {"__name__": "__main__"})
'''
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed for the time limit
    timed_out: bool = False

    def as_text(self) -> str:
        """What a tool call returns to the model."""
        if self.timed_out:
            return "error: time limit exceeded" + (f"\n{self.stdout}" if self.stdout else "")
        if self.exit_code:
            return (self.stdout + self.stderr.strip().splitlines()[-1:][0] if self.stderr.strip()
                    else self.stdout + f"error: exit code {self.exit_code}")
        return self.stdout


def _limits(memory_mb: int, cpu_s: int, max_file_mb: int):
    def apply() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
        except (OSError, AttributeError):
            pass  # no namespaces here: the audit hook still refuses sockets
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_mb << 20, max_file_mb << 20))
        os.setsid()
    return apply


async def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 256, max_output: int = 4000,
                     max_file_mb: int = 16) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="loongsage-sandbox-") as work:
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "PYTHONIOENCODING": "utf-8"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _PRELUDE, cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=_limits(memory_mb, max(1, int(timeout_s) + 1), max_file_mb))
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
            return SandboxResult(out.decode(errors="replace")[:max_output], "", None, timed_out=True)
        return SandboxResult(out.decode(errors="replace")[:max_output], err.decode(errors="replace")[-max_output:],
                             proc.returncode)
