"""Anthropic Messages encoding for the gateway (`POST /v1/messages`), apart from the HTTP transport:
the request validated (one clear message naming the field) and turned into the same chat messages
and tools the OpenAI path renders, so sessions, exact token capture and chain merging are shared;
and the response / server-sent events built from a model turn.

Agents written against Anthropic's API (Claude Code, the `anthropic` SDK) train like OpenAI ones:
content blocks `text`, `tool_use` and `tool_result` map to assistant content, tool calls and tool
messages; `system` to a system message; `tools[].input_schema` to a function's parameters.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loongsage.agentflow.llm import ModelTurn
from loongsage.agentflow.openai_protocol import RequestError, sampling_from


class Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations, ...
    type: Literal["text", "tool_use", "tool_result"]
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool = False

    @model_validator(mode="after")
    def _complete(self) -> Block:
        need = {"text": ["text"], "tool_use": ["id", "name", "input"], "tool_result": ["tool_use_id"]}[self.type]
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(missing)}")
        return self

    def result_text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # metadata, thinking, service_tier, ...
    model: str = ""
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False

    def template_messages(self) -> list[dict[str, Any]]:
        """The OpenAI-form messages the chat template renders: tool results before a user's text (they
        answer the assistant's previous tool calls)."""
        out: list[dict[str, Any]] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "".join(b.text or "" for b in self.system)
            out.append({"role": "system", "content": text})
        for m in self.messages:
            blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            text = "".join(b.text for b in blocks if b.type == "text")
            if m.role == "assistant":
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                         for b in blocks if b.type == "tool_use"]
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
                continue
            out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.result_text()}
                    for b in blocks if b.type == "tool_result"]
            if text or not any(b.type == "tool_result" for b in blocks):
                out.append({"role": "user", "content": text})
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or (self.tool_choice or {}).get("type") == "none":
            return None
        return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.input_schema}} for t in self.tools]

    def sampling_params(self) -> dict[str, Any]:
        return sampling_from(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                             max_new_tokens=self.max_tokens, stop=self.stop_sequences or None)


def parse_request(body: bytes) -> MessagesRequest:
    try:
        req = MessagesRequest.model_validate_json(body)
    except ValidationError as exc:
        # the most specific error: for `content` (a string or blocks) given blocks, the block's own
        err = max(exc.errors(), key=lambda e: len(e["loc"]))
        where = ".".join(str(x) for x in err["loc"] if not isinstance(x, str) or "[" not in x) or "body"
        raise RequestError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None
    for i, m in enumerate(req.messages):
        blocks = [] if isinstance(m.content, str) else m.content
        wrong = [b.type for b in blocks if (b.type == "tool_use") != (m.role == "assistant") and b.type != "text"]
        if wrong:
            raise RequestError(f"messages.{i}: {m.role} messages cannot hold {wrong[0]} blocks")
    return req


def stop_reason(turn: ModelTurn) -> str:
    if turn.parsed.tool_calls:
        return "tool_use"
    if turn.finish == "length":
        return "max_tokens"
    return "end_turn" if turn.stopped_with is not None else "stop_sequence"


def content_blocks(turn: ModelTurn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"type": "text", "text": turn.parsed.content}] if turn.parsed.content else []
    return out + [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in turn.parsed.tool_calls]


def message(turn: ModelTurn, model: str, prompt_tokens: int) -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(turn), "stop_reason": stop_reason(turn), "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(turn.output_ids)}}


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessageStreamEncoder:
    """Server-sent events of one streamed message (message_start, content blocks, message_delta,
    message_stop), with the gateway's stream interface: opening, text, closing, failure."""

    def __init__(self, model: str, prompt_tokens: int):
        self.model, self.prompt_tokens = model, prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self._text_open = False

    @staticmethod
    def _event(kind: str, data: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    def opening(self) -> list[str]:
        return [self._event("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}})]

    def text(self, piece: str) -> list[str]:
        out = []
        if not self._text_open:
            self._text_open = True
            out.append(self._event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
        return out + [self._event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}})]

    def closing(self, turn: ModelTurn) -> list[str]:
        out = [self._event("content_block_stop", {"index": 0})] if self._text_open else []
        first = int(self._text_open)
        for i, call in enumerate(turn.parsed.tool_calls, start=first):
            out += [self._event("content_block_start", {"index": i, "content_block": {
                        "type": "tool_use", "id": call.id, "name": call.name, "input": {}}}),
                    self._event("content_block_delta", {"index": i, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(call.arguments)}}),
                    self._event("content_block_stop", {"index": i})]
        return out + [self._event("message_delta", {"delta": {"stop_reason": stop_reason(turn), "stop_sequence": None},
                                                     "usage": {"output_tokens": len(turn.output_ids)}}),
                      self._event("message_stop", {})]

    def failure(self, message: str) -> list[str]:
        return [f"event: error\ndata: {json.dumps(error_body(message, 'api_error'))}\n\n"]
