"""Agent rollouts: n episodes of a task row as one `Group`, and held-out evaluation (one episode per
row), with a white-box agent function or a black-box agent program behind the gateway. Same
protocol as `rollout.single_turn.SingleTurnRollout` (`api.Rollout`); `make_rollout` picks the kind
(`agent.kind`: a built-in kind, or `module:attr` of a factory taking a `RolloutSetup`)."""
from __future__ import annotations

import asyncio
import sys
from collections import Counter

from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.agentflow.context import AgentContext, load_agent, run_episode
from loongsage.agentflow.gateway import Gateway, GatewayServer
from loongsage.agentflow.llm import PolicyLLM
from loongsage.agentflow.sessions import SessionStore
from loongsage.agentflow.tools import offered_specs, registry_for
from loongsage.agentflow.trajectory import Trajectory
from loongsage.rollout.single_turn import RolloutSetup, SingleTurnRollout, accuracy_by_tag, group_session, in_group
from loongsage.sample import Group
from loongsage.tasks.base import TaskRow

_COUNTERS = ("turns", "tool_calls", "malformed_tool_calls", "later_calls", "drifted_calls", "resumed_calls")


class _EpisodeRollout:
    """What white-box and black-box rollouts share: a group is n episodes, evaluation one per row."""

    def __init__(self, setup: RolloutSetup):
        self.cfg, self.router, self.spec = setup.agent, setup.router, setup.spec
        self.sampling = dict(setup.sampling)
        self.chat = ChatTokens(setup.tokenizer, setup.model_dir)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def episode(self, row: TaskRow, name: str, sampling: dict) -> Trajectory:
        raise NotImplementedError

    async def group(self, row: TaskRow, n: int, gid: int, seed: int | None = None) -> Group:
        """(`seed` is not used: an episode makes several calls, and one seed each would correlate them.)"""
        trajs = await asyncio.gather(*[self.episode(row, f"{group_session(gid)}-r{j}", self.sampling)
                                       for j in range(n)])
        samples = [s for j, t in enumerate(trajs) for s in t.to_samples(gid, j, row.tag)]
        stats = Counter({"rollouts": n, "failed": sum(t.status == "failed" for t in trajs),
                         "aborted": sum(t.status == "aborted" for t in trajs)})
        for t in trajs:
            stats.update({k: t.info[k] for k in _COUNTERS if k in t.info})
        return Group(samples, [t.reward for t in trajs], row.tag, failed=stats["failed"], aborted=stats["aborted"],
                     stats=dict(stats))

    async def cancel(self, gid: int) -> int:
        """Aborts the group's requests in flight on the engines that hold them."""
        return await self.router.abort_where(lambda s: in_group(s, gid))

    async def evaluate(self, rows: list[TaskRow], temperature: float = 0.0) -> dict[str, float]:
        """Held-out success: one episode per row (greedy unless a temperature is given), scored by the
        task's verifier; a failed or aborted episode scores 0 (`eval/aborted` says how many the system
        failed)."""
        trajs = await asyncio.gather(*[self.episode(r, f"eval-{i}", {**self.sampling, "temperature": temperature})
                                       for i, r in enumerate(rows)])
        out = accuracy_by_tag(rows, [t.reward if t.status in ("ok", "truncated") else 0.0 for t in trajs])
        out["eval/failed"] = sum(t.status == "failed" for t in trajs) / len(trajs)
        out["eval/aborted"] = sum(t.status == "aborted" for t in trajs) / len(trajs)
        return out


class WhiteBoxRollout(_EpisodeRollout):
    """An `async def run(ctx, task)` (agent.entry) over the token-level `AgentContext`."""

    def __init__(self, setup: RolloutSetup):
        super().__init__(setup)
        self.agent = load_agent(self.cfg.entry)
        self.offered = offered_specs(self.cfg.offer_tools, self.cfg.tools)  # for rows that declare no tools

    async def episode(self, row: TaskRow, name: str, sampling: dict) -> Trajectory:
        tools = registry_for(row.tools if row.tools is not None else self.offered, self.cfg.tools)
        ctx = AgentContext(PolicyLLM(self.router, self.chat, sampling), self.chat, tools, self.cfg.limits, session=name)
        return await run_episode(self.agent, ctx, row, self.spec)


class BlackBoxRollout(_EpisodeRollout):
    """Any program speaking the OpenAI chat API (agent.command), one process per episode, each with
    its own gateway session (the gateway records the exact token ids)."""

    def __init__(self, setup: RolloutSetup):
        super().__init__(setup)
        self.server: GatewayServer | None = None
        self._programs = None

    async def start(self) -> None:
        from loongsage.agentflow.blackbox import BlackBoxRunner

        gateway = Gateway(PolicyLLM(self.router, self.chat, self.sampling), self.chat, SessionStore(),
                          policy_sampling=self.sampling, max_prompt_tokens=self.cfg.limits.max_tokens)
        self.server = await GatewayServer(gateway, self.cfg.gateway_host).start()
        command = [sys.executable if part == "{python}" else part for part in self.cfg.command]
        self._programs = await BlackBoxRunner(self.server, command, self.cfg.limits.timeout_s, self.cfg.concurrency,
                                              preload=self.cfg.preload,
                                              max_output_bytes=self.cfg.limits.max_output_bytes).start()

    async def stop(self) -> None:
        if self._programs is not None:
            await self._programs.stop()
            self._programs = None
        if self.server is not None:
            await self.server.stop()
            self.server = None

    async def episode(self, row: TaskRow, name: str, sampling: dict) -> Trajectory:
        return await self._programs.run(row, self.spec, name, sampling)


ROLLOUTS = {"single_turn": SingleTurnRollout, "whitebox": WhiteBoxRollout, "blackbox": BlackBoxRollout}


def make_rollout(setup: RolloutSetup):
    """The rollout of `setup.agent.kind`: a built-in kind, or a `module:attr` factory."""
    from loongsage.extensions import resolve

    kind = setup.agent.kind
    factory = ROLLOUTS.get(kind) or resolve(kind, "rollout")
    return factory(setup)
