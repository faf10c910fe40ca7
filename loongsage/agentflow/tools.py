"""Tools an agent can call: a registry of OpenAI function specs with their implementations, run
with a timeout; a failing tool answers the model with an error message instead of ending the run."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from loongsage.agentflow.sandbox import run_python
from loongsage.agentflow.toolcalls import ToolCall
from loongsage.tasks.calculator import CALCULATOR_TOOL, evaluate_expression


@dataclass
class Tool:
    spec: dict[str, Any]  # OpenAI {"type": "function", "function": {...}}
    fn: Callable[..., str | Awaitable[str]]  # called with the call's arguments as keywords
    timeout_s: float = 10.0

    @property
    def name(self) -> str:
        return self.spec["function"]["name"]


@dataclass
class ToolRegistry:
    tools: dict[str, Tool] = field(default_factory=dict)
    calls: int = 0
    errors: int = 0

    def add(self, tool: Tool) -> ToolRegistry:
        self.tools[tool.name] = tool
        return self

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec for t in self.tools.values()]

    async def execute(self, call: ToolCall) -> str:
        """The tool's answer as text (an `error: ...` line for unknown tools, bad arguments, timeouts)."""
        self.calls += 1
        tool = self.tools.get(call.name)
        if tool is None:
            self.errors += 1
            return f"error: unknown tool {call.name!r}; available: {', '.join(self.tools) or 'none'}"
        try:
            result = tool.fn(**call.arguments)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, tool.timeout_s)
            return str(result)
        except asyncio.TimeoutError:
            self.errors += 1
            return f"error: {call.name} timed out after {tool.timeout_s}s"
        except TypeError as exc:
            self.errors += 1
            return f"error: bad arguments for {call.name}: {exc}"
        except ValueError as exc:
            self.errors += 1
            return f"error: {exc}"


def calculator_tool() -> Tool:
    return Tool(CALCULATOR_TOOL, lambda expression: evaluate_expression(str(expression)))


PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a sandbox (no network, limited time and memory); returns stdout.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


def python_tool(timeout_s: float = 5.0, memory_mb: int = 256) -> Tool:
    async def run(code: str) -> str:
        return (await run_python(str(code), timeout_s=timeout_s, memory_mb=memory_mb)).as_text()
    return Tool(PYTHON_TOOL, run, timeout_s=timeout_s + 5.0)


BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {"calculator": calculator_tool, "python": python_tool}


def registry_for(specs: list[dict[str, Any]] | None, custom: dict[str, str] | None = None) -> ToolRegistry:
    """A registry with an implementation of every tool a task row declares: `custom` (agent.tools:
    name -> module:attr or registered tool factory) first, then the built-in ones."""
    from loongsage.extensions import resolve

    reg = ToolRegistry()
    for spec in specs or []:
        name = spec.get("function", {}).get("name")
        if custom and name in custom:
            reg.add(resolve(custom[name], "tool")())
        elif name in BUILTIN_TOOLS:
            reg.add(BUILTIN_TOOLS[name]())
        else:
            raise ValueError(f"task declares tool {name!r} with no implementation; built-in: {sorted(BUILTIN_TOOLS)}"
                             f"{'; agent.tools: ' + ', '.join(sorted(custom)) if custom else ''}")
    return reg


def offered_specs(names: list[str], custom: dict[str, str] | None = None) -> list[dict[str, Any]] | None:
    """The specs of the tools named in `agent.offer_tools` (None when none are named)."""
    if not names:
        return None
    from loongsage.extensions import resolve

    return [(resolve(custom[n], "tool")() if custom and n in custom else BUILTIN_TOOLS[n]()).spec for n in names]
