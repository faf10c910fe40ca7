"""Spreads requests over engines: least outstanding requests, and a conversation (session) sticks
to the engine that holds its prefix cache."""
from __future__ import annotations

from collections import OrderedDict
from typing import AsyncIterator

from loongsage.rollout import protocol as P
from loongsage.rollout.client import EngineClient


class Router:
    def __init__(self, urls: list[str], max_sessions: int = 100_000, api_key: str | None = None):
        if not urls:
            raise ValueError("router needs at least one engine")
        self.clients = [EngineClient(u, api_key) for u in urls]
        self.outstanding = [0] * len(urls)
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.max_sessions = max_sessions

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

    async def generate(self, input_ids: list[int], sampling_params: dict, session: str | None = None,
                       **kw) -> list[P.GenerateOutput]:
        """One prompt; returns a list (n samples when sampling_params has n > 1)."""
        idx = self.pick(session)
        self.outstanding[idx] += 1
        try:
            res = await self.clients[idx].generate_raw(P.build_generate(input_ids, sampling_params, **kw))
        finally:
            self.outstanding[idx] -= 1
        return [P.parse_generate(r) for r in (res if isinstance(res, list) else [res])]

    async def generate_stream(self, input_ids: list[int], sampling_params: dict, session: str | None = None,
                              **kw) -> AsyncIterator[P.GenerateOutput]:
        """One prompt, one sample, as cumulative snapshots while it is generated (the last is final)."""
        idx = self.pick(session)
        self.outstanding[idx] += 1
        try:
            async for chunk in self.clients[idx].generate_stream(input_ids, sampling_params, **kw):
                yield P.parse_generate(chunk)
        finally:
            self.outstanding[idx] -= 1

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()
