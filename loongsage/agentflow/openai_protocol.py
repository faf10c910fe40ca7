"""OpenAI chat-completions encoding for the gateway, apart from the HTTP transport: request
validation (pydantic; one clear message naming the field) and response / stream-chunk builders."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from loongsage.agentflow.llm import ModelTurn
from loongsage.agentflow.toolcalls import OPEN


class RequestError(ValueError):
    """A bad request, as the one line the client gets back (HTTP 400)."""


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: dict[str, Any]

    @field_validator("function")
    @classmethod
    def _named(cls, fn: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError("function.name must be a non-empty string")
        return fn


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SDKs send fields we have no use for (user, metadata, ...)
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per call (agents loop; GRPO groups are rollouts)")
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def sampling_params(self) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return sampling_from(temperature=self.temperature, top_p=self.top_p,
                             max_new_tokens=self.max_completion_tokens or self.max_tokens, stop=stop or None)


def sampling_from(**given: Any) -> dict[str, Any]:
    """The engine's sampling params from what a request set (what it left out stays the policy's)."""
    return {k: v for k, v in given.items() if v is not None}


def parse_request(body: bytes) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "body"
        raise RequestError(f"{where}: {err['msg']}") from None


def finish_reason(turn: ModelTurn) -> str:
    if turn.parsed.tool_calls:
        return "tool_calls"
    return "length" if turn.finish == "length" else "stop"


def completion(turn: ModelTurn, model: str, prompt_tokens: int) -> dict[str, Any]:
    msg = turn.message()
    if msg.get("tool_calls") and not msg["content"]:
        msg["content"] = None
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": msg, "finish_reason": finish_reason(turn),
                                         "logprobs": None}],
            "usage": usage(turn, prompt_tokens)}


def usage(turn: ModelTurn, prompt_tokens: int) -> dict[str, int]:
    n = len(turn.output_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}


class StreamEncoder:
    """SSE chunks of one streamed completion (OpenAI's chat.completion.chunk objects), with the
    gateway's stream interface: opening, text, closing, failure."""

    def __init__(self, model: str, prompt_tokens: int, include_usage: bool = False):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), model
        self.prompt_tokens, self.include_usage = prompt_tokens, include_usage

    def _chunk(self, choices: list, **extra) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": choices, **extra}
        return f"data: {json.dumps(obj)}\n\n"

    def _delta(self, delta: dict, finish: str | None = None) -> str:
        return self._chunk([{"index": 0, "delta": delta, "finish_reason": finish}])

    def opening(self) -> list[str]:
        return [self._delta({"role": "assistant", "content": ""})]

    def text(self, piece: str) -> list[str]:
        return [self._delta({"content": piece})]

    def closing(self, turn: ModelTurn) -> list[str]:
        out = [self._delta({"tool_calls": [{"index": i, **call.to_openai()}]})
               for i, call in enumerate(turn.parsed.tool_calls)]
        out.append(self._delta({}, finish_reason(turn)))
        if self.include_usage:
            out.append(self._chunk([], usage=usage(turn, self.prompt_tokens)))
        return out + [DONE]

    def failure(self, message: str) -> list[str]:
        return [f"data: {json.dumps(error_body(message, 'api_error'))}\n\n", DONE]


DONE = "data: [DONE]\n\n"


def visible_content(text: str) -> str:
    """The part of a partial turn that is content for sure: before any tool call, and without a tail
    that could be the start of one."""
    cut = text.find(OPEN)
    if cut >= 0:
        return text[:cut]
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return text[:-k]
    return text


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
