"""A black-box calculator agent, written with the official `openai` SDK and nothing of LoongSage's
agent API: it reads its task (JSON: messages, tools) from stdin, talks to OPENAI_BASE_URL with
OPENAI_API_KEY (set by whoever runs it: the LoongSage gateway during training, `loongsage serve`
interactively, any OpenAI-compatible server otherwise), runs the tool calls it gets back, and prints
its final answer as its last line.

    echo '{"messages": [{"role": "user", "content": "123*456=?"}]}' | \
        OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=me python examples/calc_agent_openai.py
"""
from __future__ import annotations

import json
import sys

from openai import OpenAI

from loongsage.tasks.calculator import CALCULATOR_TOOL, evaluate_expression

MAX_TURNS = 3


def calculator(arguments: str) -> str:
    try:
        return evaluate_expression(str(json.loads(arguments)["expression"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def main() -> None:
    task = json.load(sys.stdin)
    messages, tools = task["messages"], task.get("tools") or [CALCULATOR_TOOL]
    client = OpenAI(max_retries=0)
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=72)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        answer = msg.content or ""
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            result = calculator(call.function.arguments) if call.function.name == "calculator" else "error: unknown tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(answer)


if __name__ == "__main__":
    main()
