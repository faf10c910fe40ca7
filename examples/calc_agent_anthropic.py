"""A black-box calculator agent written with the official `anthropic` SDK (the Messages API, as
Claude Code speaks it) and nothing of LoongSage's agent API: it reads its task (JSON: messages,
tools in OpenAI form) from stdin, talks to ANTHROPIC_BASE_URL with ANTHROPIC_API_KEY (the LoongSage
gateway during training, `loongsage serve` interactively), runs the tools it is asked to use, and
prints its final answer as its last line.

    echo '{"messages": [{"role": "user", "content": "123*456=?"}]}' | \
        ANTHROPIC_BASE_URL=http://127.0.0.1:8000 ANTHROPIC_API_KEY=me python examples/calc_agent_anthropic.py
"""
from __future__ import annotations

import json
import sys

from anthropic import Anthropic

from loongsage.tasks.calculator import CALCULATOR_TOOL, evaluate_expression

MAX_TURNS = 3


def calculator(arguments: dict) -> str:
    try:
        return evaluate_expression(str(arguments["expression"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def main() -> None:
    task = json.load(sys.stdin)
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"]["parameters"]} for t in task.get("tools") or [CALCULATOR_TOOL]]
    messages = [{"role": m["role"], "content": m["content"]} for m in task["messages"]]
    client = Anthropic(max_retries=0)
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.messages.create(model="policy", max_tokens=72, messages=messages, tools=tools)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        answer = "".join(b.text for b in reply.content if b.type == "text")
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id,
             "content": calculator(b.input) if b.name == "calculator" else "error: unknown tool"} for b in uses]})
    print(answer)


if __name__ == "__main__":
    main()
