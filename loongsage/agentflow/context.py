"""The white-box agent API: an agent is `async def run(ctx, task) -> answer`.

`ctx` holds the conversation as token ids. `generate()` samples the next model turn from those exact
ids; `add_messages()` / `run_tools()` append the template's rendering of new messages only, so the
trained tokens are exactly the ones the engine produced (no retokenization drift). Limits (turns,
tokens, wall clock, per tool) end an episode cleanly instead of letting it run away.
"""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.agentflow.config import AgentLimits
from loongsage.agentflow.llm import ModelTurn, PolicyLLM
from loongsage.agentflow.toolcalls import ToolCall
from loongsage.agentflow.tools import ToolRegistry
from loongsage.agentflow.trajectory import Chain, Trajectory
from loongsage.rollout.resume import system_failure
from loongsage.tasks.base import TaskRow, TaskSpec


class AgentLimitReached(RuntimeError):
    """Raised by ctx.generate when the episode has no turns or tokens left."""


class GenerationAborted(RuntimeError):
    """The inference system failed the model call: the engine aborted it and no continuation saved
    it (`rollout/resume.py`), or the engine erred or could not be reached. The episode is the
    system's failure (`aborted`), not the agent's, even if the agent catches this."""


class AgentContext:
    def __init__(self, llm: PolicyLLM, chat: ChatTokens, tools: ToolRegistry, limits: AgentLimits,
                 session: str | None = None):
        self.llm, self.chat, self.tools, self.limits, self.session = llm, chat, tools, limits, session
        self.trajectory = Trajectory()
        self.turns = 0
        self.reward: float | None = None  # set by an agent that scores itself; otherwise the verifier
        self._chain: Chain | None = None

    # ---- conversation ------------------------------------------------------------------
    def start(self, messages: list[dict] | None = None, tools: list[dict] | None = None,
              ids: list[int] | None = None) -> None:
        """A new token sequence: from messages (rendered with the tools) or from raw prompt ids."""
        if (messages is None) == (ids is None):
            raise ValueError("ctx.start: give messages or ids")
        tools = self.tools.specs() if tools is None else tools
        prompt = list(ids) if ids is not None else self.chat.prompt_ids(messages, tools)
        self._chain = Chain(prompt, messages=list(messages or []), tools=tools)
        self.trajectory.chains.append(self._chain)

    @property
    def ids(self) -> list[int]:
        return self._need_chain().ids

    @property
    def messages(self) -> list[dict]:
        return list(self._need_chain().messages)

    def add_messages(self, messages: list[dict]) -> None:
        chain = self._need_chain()
        chain.add_inserted(self.chat.continuation_ids(chain.messages, messages, chain.tools, chain.last_stop))
        chain.messages += messages

    def add_ids(self, ids: list[int]) -> None:
        """Token-level API: append ids the model did not generate (not trained on)."""
        self._need_chain().add_inserted(list(ids))

    async def generate(self, **sampling: Any) -> ModelTurn:
        chain = self._need_chain()
        if self.turns >= self.limits.max_turns:
            raise AgentLimitReached(f"max_turns={self.limits.max_turns} reached")
        budget = self.limits.max_tokens - len(chain.ids)
        if budget <= 0:
            raise AgentLimitReached(f"max_tokens={self.limits.max_tokens} reached")
        cap = min(budget, int(sampling.pop("max_new_tokens", self.llm.sampling.get("max_new_tokens", budget))))
        try:
            turn = await self.llm.generate(chain.ids, {**sampling, "max_new_tokens": cap}, session=self.session)
        except Exception as exc:
            why = system_failure(exc)
            if why is None:
                raise
            self.trajectory.abort(why)
            raise GenerationAborted(why) from exc
        self.turns += 1
        chain.add_model_turn(turn.output_ids, turn.logprobs, turn.versions, turn.temperature)
        chain.messages.append(turn.message())
        chain.last_stop = turn.stopped_with
        info = self.trajectory.info
        info["turns"] = self.turns
        info["malformed_tool_calls"] = info.get("malformed_tool_calls", 0) + turn.parsed.malformed
        info["resumed_calls"] = info.get("resumed_calls", 0) + bool(turn.resumed)
        if turn.finish == "abort":
            self.trajectory.abort("the engine aborted the model call (no continuation left)")
            raise GenerationAborted(self.trajectory.reason)
        if turn.finish == "length" and self.trajectory.status == "ok":
            self.trajectory.status = "truncated"
        return turn

    async def run_tools(self, calls: list[ToolCall]) -> list[dict]:
        """Executes the calls, appends their results as tool messages, returns those messages."""
        results = await asyncio.gather(*[self.tools.execute(c) for c in calls])
        msgs = [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": r} for c, r in zip(calls, results)]
        self.trajectory.info["tool_calls"] = self.trajectory.info.get("tool_calls", 0) + len(calls)
        self.add_messages(msgs)
        return msgs

    def _need_chain(self) -> Chain:
        if self._chain is None:
            raise RuntimeError("ctx.start(messages) first")
        return self._chain


AgentFn = Callable[[AgentContext, TaskRow], Awaitable[Any]]


async def run_episode(agent: AgentFn, ctx: AgentContext, row: TaskRow, spec: TaskSpec) -> Trajectory:
    """Runs one white-box episode from the row's prompt; failures become a failed trajectory."""
    traj = ctx.trajectory
    try:
        if isinstance(row.prompt, str):
            ctx.start(ids=ctx.chat.encode(row.prompt), tools=[])
        else:
            ctx.start(row.prompt, row.tools if row.tools is not None else ctx.tools.specs())
        answer = await asyncio.wait_for(agent(ctx, row), ctx.limits.timeout_s)
    except AgentLimitReached as exc:
        if traj.status != "aborted":
            traj.status, traj.reason = "truncated", str(exc)
        answer = next((m.get("content") or "" for m in reversed(ctx.messages) if m["role"] == "assistant"), "")
    except asyncio.TimeoutError:
        return traj if traj.status == "aborted" else traj.fail(f"timeout: episode longer than {ctx.limits.timeout_s}s")
    except Exception as exc:  # the agent's own bug (or the system's, then already marked): the run goes on
        return traj if traj.status == "aborted" else traj.fail(f"agent raised {type(exc).__name__}: {exc}")
    if traj.status == "aborted":  # the agent caught GenerationAborted and went on: still not scored
        return traj
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and ctx.reward is None:
        ctx.reward = float(answer)
        answer = ""
    traj.answer = "" if answer is None else str(answer)
    traj.reward = ctx.reward if ctx.reward is not None else spec.reward(traj.answer, row)
    return traj


def load_agent(path: str) -> AgentFn:
    """'package.module:function' -> the agent function (must be `async def run(ctx, task)`)."""
    import importlib

    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"agent {path!r}: expected 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"agent {path!r}: cannot import ({exc})") from None
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent {path!r}: must be an async function run(ctx, task)")
    return fn
