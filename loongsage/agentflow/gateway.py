"""The black-box gateway: OpenAI chat completions, OpenAI Responses and Anthropic Messages in front of
the policy.

Any program that speaks one of these APIs (with tools) talks to its own session; the gateway turns each
request into token ids (extending the session's held ids when the request continues an earlier
call), samples through the router, parses tool calls, records the exact ids / logprobs / versions,
and answers in the caller's protocol (streamed as it is generated, when asked). Bad input is a 4xx with
one clear message, never a 5xx. A call the inference system fails (an abort no continuation saved,
an engine error, an engine gone) is a 502/503 to the agent and is noted in the session, so the
episode is the system's failure, not the agent's (`rollout/resume.py`).
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loongsage.agentflow import anthropic_protocol as A
from loongsage.agentflow import openai_protocol as O
from loongsage.agentflow import responses_protocol as R
from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.agentflow.llm import ModelTurn, PolicyLLM
from loongsage.agentflow.sessions import CallRecorder, Session, SessionStore
from loongsage.rollout.client import EngineError
from loongsage.rollout.resume import system_failure
from loongsage.wire import ClientGone, openapi_body, unless_client_leaves

# every protocol's request gives template_messages, template_tools and sampling_params
ChatRequest = O.ChatCompletionRequest | A.MessagesRequest | R.ResponsesRequest


@dataclass(frozen=True)
class Wire:
    """One API protocol the gateway speaks: its request parser, response and stream builders, errors."""
    parse: Callable[[bytes], Any]
    response: Callable[[ModelTurn, str, int], dict]
    encoder: Callable[[Any, str, int], Any]  # (request, model, prompt tokens) -> stream encoder
    error_body: Callable[[str, str], dict]


OPENAI = Wire(O.parse_request, O.completion,
              lambda req, model, n: O.StreamEncoder(model, n, bool((req.stream_options or {}).get("include_usage"))),
              O.error_body)
ANTHROPIC = Wire(A.parse_request, A.message, lambda req, model, n: A.MessageStreamEncoder(model, n), A.error_body)
RESPONSES = Wire(R.parse_request, R.response, lambda req, model, n: R.ResponseStreamEncoder(model, n), R.error_body)
WIRES = {"/v1/chat/completions": OPENAI, "/v1/messages": ANTHROPIC, "/v1/responses": RESPONSES}


class SystemFailed(RuntimeError):
    """The inference system failed a call (noted in the session): 503 for an abort, else 502."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.message, self.status = message, status


ABORTED = "the inference engine aborted the call (a system abort, not the agent's doing)"


class Gateway:
    def __init__(self, llm: PolicyLLM, chat: ChatTokens, sessions: SessionStore, model_name: str = "policy",
                 recorder: CallRecorder | None = None, policy_sampling: dict | None = None,
                 max_body_bytes: int = 1 << 20, max_prompt_tokens: int | None = None):
        self.llm, self.chat, self.sessions, self.model_name = llm, chat, sessions, model_name
        self.recorder, self.max_body_bytes, self.max_prompt_tokens = recorder, max_body_bytes, max_prompt_tokens
        # Training: the policy's sampling settings win over the agent's (behaviour logprobs must be the
        # policy's); `max_new_tokens` there is a cap on what the agent asks for.
        self.policy_sampling = dict(policy_sampling or {})

    def _sampling(self, req: ChatRequest, session: Session) -> dict[str, Any]:
        asked = req.sampling_params()
        policy = {**self.policy_sampling, **(session.sampling or {})}
        if not policy:
            return asked
        out = {**asked, **{k: v for k, v in policy.items() if k != "max_new_tokens"}}
        cap = policy.get("max_new_tokens")
        if cap is not None:
            out["max_new_tokens"] = min(cap, asked.get("max_new_tokens", cap))
        return out

    def _place(self, session: Session, req: ChatRequest):
        messages, tools = req.template_messages(), req.template_tools()
        try:
            chain, extends = session.place(self.chat, messages, tools)
        except Exception as exc:  # the template could not render these messages
            raise O.RequestError(f"messages: cannot be rendered by the chat template ({exc})") from None
        prompt = chain.ids
        if self.max_prompt_tokens is not None and len(prompt) >= self.max_prompt_tokens:
            raise O.RequestError(f"messages: {len(prompt)} prompt tokens, the model's limit is {self.max_prompt_tokens}")
        return chain, extends, prompt

    def _commit(self, session: Session, chain, extends: bool, prompt: list[int], turn: ModelTurn) -> None:
        """The turn joins its chain and the session's records (and the record file)."""
        chain.add_model_turn(turn.output_ids, turn.logprobs, turn.versions, turn.temperature)
        chain.messages.append(turn.message())
        chain.last_stop = turn.stopped_with
        session.calls += 1
        session.resumed_calls += bool(turn.resumed)
        session.extended += extends
        session.malformed_tool_calls += turn.parsed.malformed
        record = {"session": session.name, "call": session.calls - 1, "chain": session.chains.index(chain),
                  "extends": extends, "prompt_ids": prompt, "output_ids": turn.output_ids,
                  "output_logprobs": turn.logprobs, "output_versions": turn.versions,
                  "weight_version": turn.weight_version, "finish_reason": turn.finish, "text": turn.text,
                  "tool_calls": len(turn.parsed.tool_calls), "malformed_tool_calls": turn.parsed.malformed,
                  "time": time.time()}
        session.records.append(record)
        if self.recorder is not None:
            self.recorder.write(record)

    async def complete(self, session: Session, req: ChatRequest) -> tuple[ModelTurn, int]:
        chain, extends, prompt = self._place(session, req)
        session.busy.add(id(chain))
        try:
            turn = await self.llm.generate(prompt, self._sampling(req, session), session=f"gw-{session.name}")
        except Exception as exc:
            why = system_failure(exc)
            if why is None:
                raise
            session.system_errors.append(why)
            raise SystemFailed(why, 502) from exc
        finally:
            session.busy.discard(id(chain))
        if turn.finish == "abort":
            session.system_errors.append(ABORTED)
            raise SystemFailed(ABORTED, 503)
        self._commit(session, chain, extends, prompt, turn)
        return turn, len(prompt)

    async def complete_stream(self, session: Session, req: ChatRequest, encoder: Callable[[int], Any]) -> AsyncIterator[str]:
        """Content streams as the engine generates it; anything from a `<tool_call>` on is held back and
        sent as parsed tool calls at the end (or as content, if the call turns out malformed).
        `encoder(prompt_tokens)` writes the protocol's events (opening, text, closing, failure)."""
        chain, extends, prompt = self._place(session, req)  # a bad request fails before the stream starts
        session.busy.add(id(chain))  # from placement on: no other call may extend this chain meanwhile
        enc = encoder(len(prompt))

        async def events() -> AsyncIterator[str]:
            sent, turn = 0, None
            try:
                for event in enc.opening():
                    yield event
                async for text, turn in self.llm.stream(prompt, self._sampling(req, session), f"gw-{session.name}"):
                    show = O.visible_content(text) if turn is None else (
                        turn.text[:turn.text.find(O.OPEN)] if turn.parsed.tool_calls else turn.text)
                    if len(show) > sent:
                        for event in enc.text(show[sent:]):
                            yield event
                        sent = len(show)
            except Exception as exc:
                why = system_failure(exc)
                if why is None and not isinstance(exc, EngineError):
                    raise
                if why is not None:
                    session.system_errors.append(why)
                for event in enc.failure(why or f"inference engine error: {exc.message}"):
                    yield event
                return
            finally:
                session.busy.discard(id(chain))
            if turn.finish == "abort":
                session.system_errors.append(ABORTED)
                for event in enc.failure(ABORTED):
                    yield event
                return
            self._commit(session, chain, extends, prompt, turn)
            for event in enc.closing(turn):
                yield event

        return events()

    def app(self) -> FastAPI:
        app = FastAPI(title="LoongSage gateway", docs_url=None, redoc_url=None, openapi_url=None)

        def fail(status: int, message: str, kind: str = "invalid_request_error", wire: Wire | None = None) -> JSONResponse:
            return JSONResponse((wire or OPENAI).error_body(message, kind), status_code=status)

        def who(request: Request) -> Session | None:
            """The session of the call's key: `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY`
            (Anthropic)."""
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            return self.sessions.lookup(key)

        async def body_of(request: Request) -> bytes:
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                raise O.RequestError(f"body: larger than {self.max_body_bytes} bytes")
            data = bytearray()
            async for part in request.stream():
                data += part
                if len(data) > self.max_body_bytes:
                    raise O.RequestError(f"body: larger than {self.max_body_bytes} bytes")
            return bytes(data)

        @app.exception_handler(O.RequestError)
        async def _bad(request: Request, exc: O.RequestError):
            status = 413 if str(exc).startswith("body: larger") else 400
            return fail(status, str(exc), wire=WIRES.get(request.url.path))

        async def serve(request: Request, wire: Wire):
            """One model call in `wire`'s protocol: the same sessions, token capture and errors for all."""
            session = who(request)
            if session is None:
                return fail(401, "invalid or missing API key", "authentication_error", wire)
            req = wire.parse(await body_of(request))
            model = req.model or self.model_name
            if req.stream:
                return StreamingResponse(await self.complete_stream(session, req, lambda n: wire.encoder(req, model, n)),
                                         media_type="text/event-stream")
            try:  # an agent killed mid-call: its model call is cancelled, and with it the engine's work
                turn, prompt_tokens = await unless_client_leaves(request, self.complete(session, req))
            except ClientGone:
                return fail(499, "the client closed the request", wire=wire)
            except SystemFailed as exc:
                return fail(exc.status, exc.message, "api_error", wire)
            except EngineError as exc:
                if 400 <= exc.status < 500:
                    return fail(400, exc.message, wire=wire)
                return fail(502, f"inference engine error: {exc.message}", "api_error", wire)
            return wire.response(turn, model, prompt_tokens)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models(request: Request):
            if who(request) is None:
                return fail(401, "invalid or missing API key", "authentication_error")
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "loongsage"}]}

        @app.post("/v1/chat/completions", openapi_extra=openapi_body(O.ChatCompletionRequest))
        async def chat_completions(request: Request):
            return await serve(request, OPENAI)

        @app.post("/v1/messages", openapi_extra=openapi_body(A.MessagesRequest))
        async def messages(request: Request):
            """Anthropic's Messages API (the `anthropic` SDK, Claude Code)."""
            return await serve(request, ANTHROPIC)

        @app.post("/v1/responses", openapi_extra=openapi_body(R.ResponsesRequest))
        async def responses(request: Request):
            """OpenAI's Responses API (the `openai` SDK's `responses.create`, Codex)."""
            return await serve(request, RESPONSES)

        @app.post("/v1/loongsage/reward")
        async def post_reward(request: Request):
            """LoongSage extension: an agent that scores itself posts {"reward": number} to its session."""
            session = who(request)
            if session is None:
                return fail(401, "invalid or missing API key", "authentication_error")
            try:
                value = json.loads(await body_of(request)).get("reward")
            except (ValueError, AttributeError):
                value = None
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                return fail(400, "reward: expected a JSON object {\"reward\": number}")
            session.reward = float(value)
            return {"session": session.name, "reward": session.reward}

        @app.get("/v1/loongsage/session")
        async def own_records(request: Request):
            """LoongSage extension: the caller's own session records (never another session's)."""
            session = who(request)
            if session is None:
                return fail(401, "invalid or missing API key", "authentication_error")
            return {"session": session.name, "calls": session.calls, "drift_rate": session.drift_rate,
                    "records": session.records}

        return app


class GatewayServer:
    """Runs a gateway inside the current event loop (the controller's), on 127.0.0.1 by default."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0):
        self.gateway, self.host, self.port = gateway, host, port
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> GatewayServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.gateway.app(), log_level="warning", timeout_keep_alive=60, lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task
            self._server = None
