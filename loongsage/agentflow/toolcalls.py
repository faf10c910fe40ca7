"""Tool calls in model text: Hermes/Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Parsing is strict: a block that is not JSON with a string `name` and an object `arguments` (or a JSON
string of one), or an unclosed `<tool_call>`, makes the whole turn plain content and is counted as
malformed, so an agent never receives a half-understood call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:16]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass
class ParsedTurn:
    content: str  # text outside the tool-call blocks (all of it when a call is malformed)
    tool_calls: list[ToolCall]
    malformed: int = 0  # tool-call blocks that could not be parsed


def parse_tool_calls(text: str) -> ParsedTurn:
    if OPEN not in text:
        return ParsedTurn(text.strip(), [])
    calls, bad = [], 0
    for block in _BLOCK.findall(text):
        call = _parse_block(block)
        if call is None:
            bad += 1
        else:
            calls.append(call)
    rest = _BLOCK.sub("", text)
    if OPEN in rest or CLOSE in rest:  # an unclosed or stray tag
        bad += 1
    if bad:
        return ParsedTurn(text.strip(), [], bad)
    return ParsedTurn(rest.strip(), calls)


def _parse_block(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args)


def call_from_openai(call: dict[str, Any]) -> ToolCall:
    """An OpenAI `tool_calls` entry (arguments as a JSON string or an object) as a ToolCall."""
    fn = call.get("function") or {}
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            args = {"__raw__": args}
    return ToolCall(fn.get("name", ""), args if isinstance(args, dict) else {"__raw__": args}, call.get("id") or "")
