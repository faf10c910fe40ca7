"""A black-box calculator agent built with LangGraph (a model node and a tool node in a StateGraph,
LangChain's `ChatOpenAI` as the model) and nothing of LoongSage's agent API. Like any black-box agent
it reads its task (JSON: messages, tools) from stdin, reaches the model through OPENAI_BASE_URL /
OPENAI_API_KEY (its gateway session during training), and prints its final answer last.

    echo '{"messages": [{"role": "user", "content": "123*456=?"}]}' | \
        OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=me python examples/calc_agent_langgraph.py
"""
from __future__ import annotations

import json
import sys
from typing import Annotated, TypedDict

from langchain_core.messages import AnyMessage, ToolMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from loongsage.tasks.calculator import CALCULATOR_TOOL, evaluate_expression

MAX_TURNS = 3


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def calculator(arguments: dict) -> str:
    try:
        return evaluate_expression(str(arguments["expression"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def build(tools: list[dict]):
    # the task's tool specs go to the model as given (the policy was trained on exactly these)
    model = ChatOpenAI(model="policy", max_tokens=72, max_retries=0).bind_tools(tools)

    def think(state: State) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    def act(state: State) -> dict:
        return {"messages": [ToolMessage(calculator(c["args"]) if c["name"] == "calculator" else "error: unknown tool",
                                         tool_call_id=c["id"]) for c in state["messages"][-1].tool_calls]}

    def route(state: State) -> str:
        turns = sum(m.type == "ai" for m in state["messages"])
        return "act" if state["messages"][-1].tool_calls and turns < MAX_TURNS else END

    graph = StateGraph(State)
    graph.add_node("think", think)
    graph.add_node("act", act)
    graph.add_edge(START, "think")
    graph.add_conditional_edges("think", route, ["act", END])
    graph.add_edge("act", "think")
    return graph.compile()


def main() -> None:
    task = json.load(sys.stdin)
    agent = build(task.get("tools") or [CALCULATOR_TOOL])
    final = agent.invoke({"messages": task["messages"]})
    print(final["messages"][-1].content)


if __name__ == "__main__":
    main()
