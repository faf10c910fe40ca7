"""Built-in white-box agents (the `agent.entry` of a recipe names one, or any `module:function`)."""
from __future__ import annotations

from loongsage.agentflow.context import AgentContext
from loongsage.tasks.base import TaskRow


async def tool_loop(ctx: AgentContext, task: TaskRow) -> str:
    """The standard tool-use loop: generate; run the tool calls; repeat until the model answers
    without a call (its content is the answer) or the turn limit ends the episode."""
    while True:
        turn = await ctx.generate()
        if not turn.parsed.tool_calls or turn.stopped_with is None:
            return turn.parsed.content
        await ctx.run_tools(turn.parsed.tool_calls)
