"""Black-box agents: any command that speaks the OpenAI or Anthropic API, run as a subprocess per episode.

The episode's task arrives on stdin as JSON ({"messages", "tools", "meta"}); OPENAI_BASE_URL and
OPENAI_API_KEY (ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY for the Messages API) point the program's
SDK at its own gateway session; its final answer is the last
non-empty line it prints. A crash, a hang (wall-clock timeout; the process group is killed) or no
model call at all gives a failed trajectory with the reason; the run goes on. Output goes to files
capped by RLIMIT_FSIZE: an agent that floods stdout or stderr is stopped by the kernel at
`max_output_bytes` (SIGXFSZ, or EFBIG for Python, which ignores that signal) and fails with that
reason, and the controller never holds more than the cap. An episode in which
the gateway saw the inference system fail a call is `aborted` instead (not scored, not trained).

Python agents can be started from a fork server that has their heavy imports done (`agent.preload`):
same process contract, a fraction of the start-up CPU.
"""
from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys
import tempfile
from pathlib import Path

from loongsage.agentflow.gateway import GatewayServer
from loongsage.agentflow.trajectory import Trajectory
from loongsage.tasks.base import TaskRow, TaskSpec


def _read_capped(path: str, cap: int) -> str:
    """The file's text; FLOODED when it reached `cap` (the kernel refused more: SIGXFSZ, or EFBIG
    for a program that ignores the signal, as Python does)."""
    with open(path, "rb") as f:
        raw = f.read(cap or -1)
    return FLOODED if cap and len(raw) >= cap else raw.decode(errors="replace")


FLOODED = "\0flooded"  # no program's readable output: it holds a NUL


def _limit_output(cap: int):
    """The child's files (its stdout and stderr among them) may not grow past `cap` bytes."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
    return limit


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ForkServer:
    """Client of loongsage/agentflow/forkserver.py: one server process, a forked child per episode."""

    def __init__(self, modules: list[str], env: dict[str, str]):
        self.modules, self.env = list(modules), env
        self._proc: asyncio.subprocess.Process | None = None
        self._waiting: dict[str, dict[str, asyncio.Future]] = {}
        self._reader: asyncio.Task | None = None
        self._next = 0

    async def start(self) -> ForkServer:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loongsage.agentflow.forkserver", *self.modules, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env, limit=1 << 20)
        line = await self._proc.stdout.readline()
        if not line:
            err = (await self._proc.stderr.read()).decode(errors="replace").strip().splitlines()[-1:] or ["?"]
            raise RuntimeError(f"agent.preload: the fork server did not start ({err[0]})")
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        async for line in self._proc.stdout:
            msg = json.loads(line)
            futs = self._waiting.get(msg.get("id"))
            if futs is None:
                continue
            key = "pid" if "pid" in msg else "exit"
            if not futs[key].done():
                futs[key].set_result(msg[key])
        for futs in self._waiting.values():  # the server died: every waiting episode fails
            for f in futs.values():
                if not f.done():
                    f.set_exception(RuntimeError("agent fork server exited"))

    async def run(self, argv: list[str], env: dict[str, str], stdin: bytes, timeout_s: float,
                  max_output_bytes: int = 0) -> tuple[int, str, str]:
        self._next += 1
        rid = str(self._next)
        loop = asyncio.get_running_loop()
        futs = self._waiting[rid] = {"pid": loop.create_future(), "exit": loop.create_future()}
        with tempfile.TemporaryDirectory(prefix="loongsage-agent-") as tmp:
            paths = {k: str(Path(tmp) / k) for k in ("stdin", "stdout", "stderr")}
            Path(paths["stdin"]).write_bytes(stdin)
            self._proc.stdin.write((json.dumps({"id": rid, "argv": argv, "env": env, **paths,
                                                "max_output_bytes": max_output_bytes}) + "\n").encode())
            try:
                await self._proc.stdin.drain()
                pid = await futs["pid"]
                try:
                    code = await asyncio.wait_for(asyncio.shield(futs["exit"]), timeout_s)
                except BaseException:
                    _kill_group(pid)
                    await asyncio.wait_for(asyncio.shield(futs["exit"]), 10)
                    raise
            finally:
                self._waiting.pop(rid, None)
            return code, _read_capped(paths["stdout"], max_output_bytes), _read_capped(paths["stderr"], max_output_bytes)

    async def stop(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.stdin.close()
            try:
                await asyncio.wait_for(self._proc.wait(), 10)
            except asyncio.TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        if self._reader is not None:
            self._reader.cancel()


class BlackBoxRunner:
    def __init__(self, server: GatewayServer, command: list[str], timeout_s: float, concurrency: int,
                 env: dict[str, str] | None = None, preload: list[str] | None = None, max_output_bytes: int = 1 << 20):
        if not command:
            raise ValueError("agent.command: the black-box agent's command line is empty")
        if preload and (command[0] != sys.executable or len(command) < 2 or not command[1].endswith(".py")):
            raise ValueError("agent.preload needs agent.command = ['{python}', 'script.py', ...] (a Python script)")
        self.server, self.command, self.timeout_s = server, list(command), timeout_s
        self.max_output_bytes = max_output_bytes
        self.env = {**os.environ, **(env or {}), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        self._slots = asyncio.Semaphore(concurrency)
        self.forkserver = ForkServer(preload, self.env) if preload else None

    async def start(self) -> BlackBoxRunner:
        if self.forkserver is not None:
            await self.forkserver.start()
        return self

    async def stop(self) -> None:
        if self.forkserver is not None:
            await self.forkserver.stop()

    async def run(self, row: TaskRow, spec: TaskSpec, name: str, sampling: dict | None = None) -> Trajectory:
        sessions = self.server.gateway.sessions
        key, session = sessions.open(name, sampling)
        traj = Trajectory()
        try:
            async with self._slots:
                code, out, err = await self._run_process(row, key, name)
        except asyncio.TimeoutError:
            code = None
            traj.fail(f"timeout: agent ran longer than {self.timeout_s}s (killed)")
        finally:
            sessions.close(key)
        traj.chains = session.chains
        traj.info = {"turns": session.calls, "tool_calls": sum(r["tool_calls"] for r in session.records),
                     "malformed_tool_calls": session.malformed_tool_calls, "calls": session.calls,
                     "later_calls": max(0, session.calls - 1), "drifted_calls": max(0, session.calls - 1 - session.extended),
                     "resumed_calls": session.resumed_calls}
        if session.system_errors:  # whatever the agent did after, the system failed it first
            return traj.abort(session.system_errors[0])
        if traj.status == "failed":
            return traj
        if code == -signal.SIGXFSZ or FLOODED in (out, err):
            return traj.fail(f"agent flooded its output: more than {self.max_output_bytes} bytes (killed)")
        if code != 0:
            tail = err.strip().splitlines()[-1:] or [""]
            return traj.fail(f"agent exited with code {code}: {tail[0][:300]}")
        if session.calls == 0:
            return traj.fail("agent made no model call")
        if "\ufffd" in out or "\x00" in out:
            return traj.fail("agent printed unreadable output (not UTF-8 text)")
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        traj.answer = lines[-1] if lines else ""
        if any(r["finish_reason"] == "length" for r in session.records):
            traj.status = "truncated"
        traj.reward = session.reward if session.reward is not None else spec.reward(traj.answer, row)
        return traj

    async def _run_process(self, row: TaskRow, key: str, name: str) -> tuple[int | None, str, str]:
        messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
        task = json.dumps({"messages": messages, "tools": row.tools or [], "meta": row.meta}).encode()
        env = {**self.env, "OPENAI_BASE_URL": self.server.base_url, "OPENAI_API_KEY": key, "LOONGSAGE_SESSION": name,
               "ANTHROPIC_BASE_URL": self.server.base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": key}
        if self.forkserver is not None:
            return await self.forkserver.run(self.command[1:], env, task, self.timeout_s, self.max_output_bytes)
        with tempfile.TemporaryDirectory(prefix="loongsage-agent-") as tmp:
            out_path, err_path = str(Path(tmp) / "stdout"), str(Path(tmp) / "stderr")
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = await asyncio.create_subprocess_exec(
                    *self.command, stdin=asyncio.subprocess.PIPE, stdout=out, stderr=err, env=env,
                    start_new_session=True, preexec_fn=_limit_output(self.max_output_bytes))
            try:
                await asyncio.wait_for(proc.communicate(task), self.timeout_s)
            except BaseException:  # timeout or cancellation: the agent and its children go
                _kill_group(proc.pid)
                await proc.wait()
                raise
            return (proc.returncode, _read_capped(out_path, self.max_output_bytes),
                    _read_capped(err_path, self.max_output_bytes))
