"""Episodes for the controller, whatever the agent kind: n rollouts of a task row as one `Group`,
and greedy held-out evaluation, with single-turn sampling, a white-box agent or a black-box program."""
from __future__ import annotations

import asyncio
import sys
from collections import Counter, defaultdict

from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.agentflow.config import AgentConfig
from loongsage.agentflow.context import AgentContext, load_agent, run_episode
from loongsage.agentflow.gateway import Gateway, GatewayServer
from loongsage.agentflow.llm import PolicyLLM
from loongsage.agentflow.sessions import SessionStore
from loongsage.agentflow.tools import registry_for
from loongsage.agentflow.trajectory import Trajectory
from loongsage.controller.evaluate import evaluate as evaluate_single_turn
from loongsage.rollout.router import Router
from loongsage.rollout.single_turn import sample_group
from loongsage.sample import Group
from loongsage.tasks.base import TaskRow, TaskSpec

_COUNTERS = ("turns", "tool_calls", "malformed_tool_calls", "later_calls", "drifted_calls")


class EpisodeRunner:
    def __init__(self, cfg: AgentConfig, router: Router, tokenizer, model_dir: str, spec: TaskSpec,
                 sampling: dict, max_new_tokens: int):
        self.cfg, self.router, self.tok, self.spec = cfg, router, tokenizer, spec
        self.sampling, self.max_new_tokens = dict(sampling), max_new_tokens
        self.chat = ChatTokens(tokenizer, model_dir)
        self.agent = load_agent(cfg.entry) if cfg.kind == "whitebox" else None
        self.server: GatewayServer | None = None
        self._blackbox = None

    async def start(self) -> "EpisodeRunner":
        if self.cfg.kind == "blackbox":
            from loongsage.agentflow.blackbox import BlackBoxRunner

            gateway = Gateway(PolicyLLM(self.router, self.chat, self.sampling), self.chat, SessionStore(),
                              policy_sampling=self.sampling, max_prompt_tokens=self.cfg.limits.max_tokens)
            self.server = await GatewayServer(gateway, self.cfg.gateway_host).start()
            command = [sys.executable if part == "{python}" else part for part in self.cfg.command]
            self._blackbox = await BlackBoxRunner(self.server, command, self.cfg.limits.timeout_s, self.cfg.concurrency,
                                                  preload=self.cfg.preload).start()
        return self

    async def stop(self) -> None:
        if self._blackbox is not None:
            await self._blackbox.stop()
            self._blackbox = None
        if self.server is not None:
            await self.server.stop()
            self.server = None

    async def episode(self, row: TaskRow, name: str, sampling: dict | None = None) -> Trajectory:
        params = {**self.sampling, **(sampling or {})}
        if self.cfg.kind == "blackbox":
            return await self._blackbox.run(row, self.spec, name, params)
        ctx = AgentContext(PolicyLLM(self.router, self.chat, params), self.chat, registry_for(row.tools),
                           self.cfg.limits, session=name)
        return await run_episode(self.agent, ctx, row, self.spec)

    async def group(self, row: TaskRow, n: int, gid: int) -> Group:
        if self.cfg.kind == "single_turn":
            samples = await sample_group(self.router, self.tok, row, self.spec, self.sampling, n, gid, rid=f"group-{gid}")
            return Group(samples, [s.reward for s in samples], row.tag,
                         failed=sum(s.status == "failed" for s in samples))
        trajs = await asyncio.gather(*[self.episode(row, f"g{gid}-r{j}") for j in range(n)])
        samples = [s for j, t in enumerate(trajs) for s in t.to_samples(gid, j, row.tag)]
        stats = Counter({"rollouts": n, "failed": sum(t.status == "failed" for t in trajs)})
        for t in trajs:
            stats.update({k: t.info[k] for k in _COUNTERS if k in t.info})
        return Group(samples, [t.reward for t in trajs], row.tag, failed=stats["failed"], stats=dict(stats))

    async def evaluate(self, rows: list[TaskRow], temperature: float = 0.0) -> dict[str, float]:
        """Held-out success: one episode per row (greedy unless a temperature is given), scored by the
        task's verifier."""
        if self.cfg.kind == "single_turn":
            return await evaluate_single_turn(self.router, self.tok, rows, self.spec, self.max_new_tokens, temperature)
        trajs = await asyncio.gather(*[self.episode(r, f"eval-{i}", {"temperature": temperature})
                                       for i, r in enumerate(rows)])
        by_tag: dict[str, list[float]] = defaultdict(list)
        for row, t in zip(rows, trajs):
            by_tag[row.tag].append(t.reward if t.status != "failed" else 0.0)
        scores = [s for v in by_tag.values() for s in v]
        out = {"eval/accuracy": sum(scores) / len(scores),
               "eval/failed": sum(t.status == "failed" for t in trajs) / len(trajs)}
        for tag, v in by_tag.items():
            if len(by_tag) > 1 or tag != "default":
                out[f"eval/{tag}/accuracy"] = sum(v) / len(v)
        return out
