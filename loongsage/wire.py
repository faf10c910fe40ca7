"""JSON over HTTP for LoongSage's servers (engine routes, weight routes): strict request models,
bodies read with a size limit, one clear 4xx message per client error, responses serialised once.
(Protocol *contents* live with their owners: engine/schema.py, each transfer route, the gateway.)"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

MAX_BODY_BYTES = 64 * 1024 * 1024


class RequestError(ValueError):
    """A client error: answered with HTTP 400 and this message."""


DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still there


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def unless_client_leaves(request: Request, work: Awaitable, poll_s: float = DISCONNECT_POLL_S):
    """`work`'s result, or ClientGone once the client has disconnected (`work` is cancelled then).
    uvicorn never cancels a handler whose client left, so without this a finished-with caller keeps
    an engine generating to max_new_tokens."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class Strict(BaseModel):
    """Request models reject unknown fields: a request is never silently misread."""
    model_config = ConfigDict(extra="forbid")


def openapi_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route that reads `model` with `body_of` + `parse`: its JSON body in the
    server's OpenAPI document (what clients, docs and the schema fuzzing tests read), with the
    model's nested definitions inlined so the document needs no shared components."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.split("/")[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node
    return {"requestBody": {"required": False, "content": {"application/json": {"schema": inline(schema)}}}}


def parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body if body is not None else {})
    except ValidationError as exc:
        raise RequestError(format_validation_error(exc)) from None


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in ((prefix,) if prefix else ()) + tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown field")
        elif err["type"] == "missing":
            parts.append(f"{loc}: required field is missing")
        else:
            parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


async def body_of(request: Request, limit: int = MAX_BODY_BYTES) -> Any:
    """The request's JSON ({} for an empty body); bodies over `limit` are refused before they are
    read in full (by their declared length, else while streaming)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"malformed JSON: {exc}") from None


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def dumps(obj) -> bytes:
    """Already-JSON data straight to bytes, by orjson (as SGLang answers: a non-finite float is null).
    FastAPI's jsonable_encoder walks every element in Python first, and the standard library's encoder
    still spent a fifth of a teacher engine's time on full-vocabulary logprobs (2026-12-07): with one
    core and one GIL every such millisecond stalls the forward."""
    return orjson.dumps(obj)


def json_response(obj) -> Response:
    return Response(dumps(obj), media_type="application/json")
