"""The `agent` section: how a rollout runs (single-turn sampling, a white-box agent function, or a
black-box agent program through the gateway) and what happens when an episode fails."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loongsage.extensions import plugin

RolloutKind = plugin("rollout", ["single_turn", "whitebox", "blackbox"])
ToolFactory = plugin("tool")


class AgentLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_turns: int = Field(4, ge=1, description="model calls per episode")
    max_tokens: int = Field(512, ge=8, description="prompt + all turns, in tokens, per episode")
    timeout_s: float = Field(60.0, gt=0, description="wall clock per episode")
    max_output_bytes: int = Field(1 << 20, ge=1024, description="black-box agents: stdout and stderr each; an "
                                  "agent that writes more is killed (SIGXFSZ) and its episode failed")


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: RolloutKind = Field("single_turn", description="single_turn | whitebox | blackbox, or module:attr of a "
                              "rollout factory (RolloutSetup) -> Rollout")
    tools: dict[str, ToolFactory] = Field(default_factory=dict, description="tool name -> module:attr of a factory "
                                          "() -> Tool, for tools that task rows declare (besides the built-in ones)")
    offer_tools: list[str] = Field(default_factory=list, description="whitebox: tools (built-in: calculator, "
                                   "python; or agent.tools names) offered to every task row that declares none, "
                                   "e.g. a math data set trained to use a python tool")
    entry: str = Field("loongsage.agentflow.agents:tool_loop", description="whitebox: 'module:function', "
                       "an async def run(ctx, task)")
    command: list[str] = Field(default_factory=list, description="blackbox: the agent program's command line "
                               "('{python}' is this interpreter); the task arrives on stdin as JSON")
    preload: list[str] = Field(default_factory=list, description="blackbox, Python agents: modules to import "
                               "once in a fork server that forks a process per episode (e.g. [openai])")
    limits: AgentLimits = AgentLimits()
    concurrency: int = Field(16, ge=1, description="black-box agent processes running at once")
    on_failure: Literal["zero", "mask"] = Field("zero", description="a failed episode scores 0 in its group "
                                                "(zero) or the whole group is not trained (mask)")
    gateway_host: str = "127.0.0.1"

    @model_validator(mode="after")
    def _command(self) -> AgentConfig:
        if self.kind == "blackbox" and not self.command:
            raise ValueError("agent.kind=blackbox needs agent.command (the agent program's command line)")
        if self.offer_tools and self.kind != "whitebox":
            raise ValueError("agent.offer_tools needs agent.kind=whitebox (a black-box agent declares its own tools "
                             "in its API calls)")
        from loongsage.agentflow.tools import BUILTIN_TOOLS

        unknown = sorted(set(self.offer_tools) - set(BUILTIN_TOOLS) - set(self.tools))
        if unknown:
            raise ValueError(f"agent.offer_tools: no implementation of {unknown}; built-in: {sorted(BUILTIN_TOOLS)}"
                             f"{', agent.tools: ' + str(sorted(self.tools)) if self.tools else ''}")
        if self.preload and (len(self.command) < 2 or self.command[0] != "{python}" or not self.command[1].endswith(".py")):
            raise ValueError("agent.preload needs agent.command = ['{python}', 'script.py', ...] (a Python script)")
        return self
