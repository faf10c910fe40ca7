"""OpenAI Responses API encoding for the gateway (`POST /v1/responses`), apart from the HTTP
transport: the request's `input` items (messages, `function_call`, `function_call_output`) and
`instructions` turned into the chat messages the other protocols render, so sessions, exact token
capture and chain merging are shared; and the response object / streamed events built from a turn.

Stateless: every call sends its whole input (`store: false` style). `previous_response_id` would
need the server to keep conversations; it is refused with a clear 400, and the session still merges
calls that extend each other token for token.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loongsage.agentflow.llm import ModelTurn
from loongsage.agentflow.openai_protocol import RequestError, sampling_from

ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # store, include, reasoning, metadata, ...
    model: str = ""
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = None
    stream: bool = False

    def template_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for item in items:
            kind = item.get("type", "message")
            if kind == "message":
                out.append({"role": item["role"], "content": _text(item.get("content"))})
            elif kind == "function_call":
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if out and out[-1]["role"] == "assistant":  # the same turn's text, or its earlier calls
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:  # function_call_output
                out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"))})
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                  "parameters": t.get("parameters") or {}}} for t in self.tools]

    def sampling_params(self) -> dict[str, Any]:
        return sampling_from(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_output_tokens)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _check_items(req: ResponsesRequest) -> None:
    """Each input item and tool, one clear message naming the first that cannot be used."""
    if req.previous_response_id is not None:
        raise RequestError("previous_response_id: not supported (the gateway keeps no responses); send the "
                           "whole conversation as input")
    need = {"message": ("role",), "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output")}
    for i, item in enumerate([] if isinstance(req.input, str) else req.input):
        kind = item.get("type", "message")
        if kind not in need:
            raise RequestError(f"input.{i}.type: {kind!r} is not supported; expected one of {', '.join(need)}")
        missing = [k for k in need[kind] if k not in item]
        if missing:
            raise RequestError(f"input.{i}: a {kind} item needs {', '.join(missing)}")
        if kind == "message" and item["role"] not in ROLES:
            raise RequestError(f"input.{i}.role: {item['role']!r}; expected one of {', '.join(ROLES)}")
        if kind == "function_call" and not isinstance(item["arguments"], str):
            raise RequestError(f"input.{i}.arguments: expected a JSON string")
        text = item.get("content") if kind == "message" else item.get("output", "")
        if not isinstance(text, (str, list)) or isinstance(text, list) and not all(isinstance(p, dict) for p in text):
            raise RequestError(f"input.{i}: content must be a string or a list of content parts")
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"tools.{i}: only function tools with a name are supported")


def parse_request(body: bytes) -> ResponsesRequest:
    try:
        req = ResponsesRequest.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"] if not isinstance(x, str) or "[" not in x) or "body"
        raise RequestError(f"{where}: {err['msg']}") from None
    _check_items(req)
    return req


def output_items(turn: ModelTurn, text_id: str | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if turn.parsed.content:
        out.append(_message_item(text_id or f"msg_{uuid.uuid4().hex[:24]}", turn.parsed.content, "completed"))
    return out + [_call_item(c, json.dumps(c.arguments), "completed") for c in turn.parsed.tool_calls]


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": parts}


def _call_item(call, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": arguments, "status": status}


def response(turn: ModelTurn | None, model: str, prompt_tokens: int, resp_id: str | None = None,
             text_id: str | None = None) -> dict[str, Any]:
    """The response object; `turn` None: one still in progress (a stream's first event)."""
    incomplete = turn is not None and turn.finish == "length" and not turn.parsed.tool_calls
    n = len(turn.output_ids) if turn is not None else 0
    return {"id": resp_id or f"resp_{uuid.uuid4().hex[:24]}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress" if turn is None else "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "model": model, "output": [] if turn is None else output_items(turn, text_id),
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "instructions": None, "metadata": {},
            "usage": None if turn is None else {
                "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt_tokens + n}}


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class ResponseStreamEncoder:
    """Server-sent events of one streamed response (response.created, output items, text deltas,
    function-call arguments, response.completed), with the gateway's stream interface."""

    def __init__(self, model: str, prompt_tokens: int):
        self.model, self.prompt_tokens = model, prompt_tokens
        self.id, self.text_id = f"resp_{uuid.uuid4().hex[:24]}", f"msg_{uuid.uuid4().hex[:24]}"
        self.seq, self.text_open = 0, False

    def _event(self, kind: str, **data) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **data})}\n\n"

    def opening(self) -> list[str]:
        return [self._event("response.created", response=response(None, self.model, self.prompt_tokens, self.id))]

    def text(self, piece: str) -> list[str]:
        where = {"item_id": self.text_id, "output_index": 0, "content_index": 0}
        out = []
        if not self.text_open:
            self.text_open = True
            out += [self._event("response.output_item.added", output_index=0,
                                item=_message_item(self.text_id, None, "in_progress")),
                    self._event("response.content_part.added", **where,
                                part={"type": "output_text", "text": "", "annotations": []})]
        return out + [self._event("response.output_text.delta", **where, delta=piece, logprobs=[])]

    def closing(self, turn: ModelTurn) -> list[str]:
        out, index = [], 0
        if self.text_open:
            text = turn.parsed.content
            where = {"item_id": self.text_id, "output_index": 0, "content_index": 0}
            out += [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                    self._event("response.content_part.done", **where,
                                part={"type": "output_text", "text": text, "annotations": []}),
                    self._event("response.output_item.done", output_index=0,
                                item=_message_item(self.text_id, text, "completed"))]
            index = 1
        for i, call in enumerate(turn.parsed.tool_calls, start=index):
            args, item_id = json.dumps(call.arguments), f"fc_{call.id}"
            out += [self._event("response.output_item.added", output_index=i, item=_call_item(call, "", "in_progress")),
                    self._event("response.function_call_arguments.delta", item_id=item_id, output_index=i, delta=args),
                    self._event("response.function_call_arguments.done", item_id=item_id, output_index=i,
                                arguments=args, name=call.name),
                    self._event("response.output_item.done", output_index=i, item=_call_item(call, args, "completed"))]
        final = response(turn, self.model, self.prompt_tokens, self.id, self.text_id if self.text_open else None)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=final)]

    def failure(self, message: str) -> list[str]:
        return [self._event("error", code="api_error", message=message, param=None)]
