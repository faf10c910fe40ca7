"""Spreads requests over engines: least outstanding requests, and a conversation (session) sticks
to the engine that holds its prefix cache. It knows which engine holds every request in flight, so
an abort goes to that engine only. A request an engine aborts that nobody cancelled is continued
from where it stopped (`rollout/resume.py`)."""
from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from loongsage.rollout import protocol as P
from loongsage.rollout.client import EngineClient
from loongsage.rollout.resume import continuation_params, joined


class Router:
    def __init__(self, urls: list[str], max_sessions: int = 100_000, api_key: str | None = None,
                 clients: list[EngineClient] | None = None, abort_retries: int = 2):
        """`clients`: ready-made clients (another InferenceClient implementation) instead of `urls`;
        `abort_retries`: continuations of a request the system aborted (0: return it aborted)."""
        self.clients = clients or [EngineClient(u, api_key) for u in urls]
        if not self.clients:
            raise ValueError("router needs at least one engine")
        self.outstanding = [0] * len(self.clients)
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.max_sessions = max_sessions
        self.inflight: dict[str, tuple[str | None, int]] = {}  # rid -> (session, engine index)
        self.abort_retries = abort_retries
        self.cancelled: OrderedDict[str, None] = OrderedDict()  # sessions aborted on purpose (abort_where)
        self._rids = itertools.count()

    def pick(self, session: str | None = None) -> int:
        if session is not None and session in self.sessions:
            self.sessions.move_to_end(session)
            return self.sessions[session]
        idx = min(range(len(self.clients)), key=lambda i: self.outstanding[i])
        if session is not None:
            self.sessions[session] = idx
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return idx

    def _begin(self, session: str | None, rid: str | None) -> tuple[int, str]:
        idx = self.pick(session)
        rid = rid or f"{session or 'r'}-{next(self._rids)}"
        self.outstanding[idx] += 1
        self.inflight[rid] = (session, idx)
        return idx, rid

    def _end(self, idx: int, rid: str) -> None:
        self.outstanding[idx] -= 1
        self.inflight.pop(rid, None)

    async def generate(self, input_ids: list[int], sampling_params: dict, session: str | None = None,
                       rid: str | None = None, **kw) -> list[P.GenerateOutput]:
        """One prompt; returns a list (n samples when sampling_params has n > 1), each continued
        if the system aborted it."""
        outs = await self._generate_once(input_ids, sampling_params, session, rid, **kw)
        if any(self._resumable(o, sampling_params, session) for o in outs):
            outs = list(await asyncio.gather(*[self._resume(input_ids, sampling_params, o, session, kw) for o in outs]))
        return outs

    async def generate_stream(self, input_ids: list[int], sampling_params: dict, session: str | None = None,
                              rid: str | None = None, **kw) -> AsyncIterator[P.GenerateOutput]:
        """One prompt, one sample, as cumulative snapshots while it is generated (the last is final;
        a system abort is continued in the same stream)."""
        done: P.GenerateOutput | None = None
        params = sampling_params
        while True:
            last = None
            async with aclosing(self._stream_once(input_ids + (done.output_ids if done else []), params, session,
                                                  rid, **kw)) as chunks:
                async for out in chunks:
                    last = out if done is None else joined(done, out)
                    if last.finish_reason and self._resumable(last, sampling_params, session):
                        break  # not final: the continuation follows
                    yield last
            if last is None or not self._resumable(last, sampling_params, session):
                return
            done, rid = last, None
            params = continuation_params(sampling_params, len(done.output_ids))

    async def _resume(self, input_ids: list[int], params: dict, out: P.GenerateOutput, session: str | None,
                      kw: dict) -> P.GenerateOutput:
        while self._resumable(out, params, session):
            rest = await self._generate_once(input_ids + out.output_ids,
                                             continuation_params(params, len(out.output_ids)), session, None, **kw)
            out = joined(out, rest[0])
        return out

    def _resumable(self, out: P.GenerateOutput, params: dict, session: str | None) -> bool:
        """Aborted by the system (not by `abort_where`), retries left, tokens left to generate."""
        return (out.finish_type == "abort" and out.resumed < self.abort_retries and session not in self.cancelled
                and continuation_params(params, len(out.output_ids)) is not None)

    async def _generate_once(self, input_ids: list[int], sampling_params: dict, session: str | None,
                             rid: str | None, **kw) -> list[P.GenerateOutput]:
        idx, rid = self._begin(session, rid)
        try:
            res = await self.clients[idx].generate_raw(P.build_generate(input_ids, sampling_params, rid=rid, **kw))
        finally:
            self._end(idx, rid)
        return [P.parse_generate(r) for r in (res if isinstance(res, list) else [res])]

    async def _stream_once(self, input_ids: list[int], sampling_params: dict, session: str | None,
                           rid: str | None, **kw) -> AsyncIterator[P.GenerateOutput]:
        idx, rid = self._begin(session, rid)
        try:
            async for chunk in self.clients[idx].generate_stream(input_ids, sampling_params, rid=rid, **kw):
                yield P.parse_generate(chunk)
        finally:
            self._end(idx, rid)

    async def abort_where(self, session_matches: Callable[[str | None], bool]) -> int:
        """Aborts every request in flight whose session matches, on the engine that holds it;
        returns how many were aborted."""
        per_engine: dict[int, list[str]] = {}
        for rid, (session, idx) in list(self.inflight.items()):
            if session_matches(session):
                per_engine.setdefault(idx, []).append(rid)
                if session is not None:  # its aborted requests are not to be continued
                    self.cancelled[session] = None
                    if len(self.cancelled) > self.max_sessions:
                        self.cancelled.popitem(last=False)
        for idx, rids in per_engine.items():
            await self.clients[idx].abort(rids)
        return sum(len(r) for r in per_engine.values())

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()
