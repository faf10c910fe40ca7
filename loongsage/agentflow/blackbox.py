"""Black-box agents: any command that speaks the OpenAI API, run as a subprocess per episode.

The episode's task arrives on stdin as JSON ({"messages", "tools", "meta"}); OPENAI_BASE_URL and
OPENAI_API_KEY point the program's SDK at its own gateway session; its final answer is the last
non-empty line it prints. A crash, a hang (wall-clock timeout; the process group is killed) or no
model call at all gives a failed trajectory with the reason; the run goes on.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal

from loongsage.agentflow.gateway import GatewayServer
from loongsage.agentflow.trajectory import Trajectory
from loongsage.tasks.base import TaskRow, TaskSpec


class BlackBoxRunner:
    def __init__(self, server: GatewayServer, command: list[str], timeout_s: float, concurrency: int,
                 env: dict[str, str] | None = None):
        if not command:
            raise ValueError("agent.command: the black-box agent's command line is empty")
        self.server, self.command, self.timeout_s = server, list(command), timeout_s
        self.env = {**os.environ, **(env or {}), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        self._slots = asyncio.Semaphore(concurrency)

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
                     "later_calls": max(0, session.calls - 1), "drifted_calls": max(0, session.calls - 1 - session.extended)}
        if traj.status == "failed":
            return traj
        if code != 0:
            tail = err.strip().splitlines()[-1:] or [""]
            return traj.fail(f"agent exited with code {code}: {tail[0][:300]}")
        if session.calls == 0:
            return traj.fail("agent made no model call")
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        traj.answer = lines[-1] if lines else ""
        if any(r["finish_reason"] == "length" for r in session.records):
            traj.status = "truncated"
        traj.reward = session.reward if session.reward is not None else spec.reward(traj.answer, row)
        return traj

    async def _run_process(self, row: TaskRow, key: str, name: str) -> tuple[int | None, str, str]:
        messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
        task = json.dumps({"messages": messages, "tools": row.tools or [], "meta": row.meta}).encode()
        env = {**self.env, "OPENAI_BASE_URL": self.server.base_url, "OPENAI_API_KEY": key, "LOONGSAGE_SESSION": name}
        proc = await asyncio.create_subprocess_exec(
            *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(task), self.timeout_s)
        except BaseException:  # timeout or cancellation: the agent and its children go
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            raise
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
