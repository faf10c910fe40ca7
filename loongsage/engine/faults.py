"""Fault injection for reliability tests and drills (`engine.inject_errors: "AFTER:COUNT"`): the
engine answers HTTP 500 to COUNT `/generate` requests after the first AFTER, as an engine with a
broken batch or a failing device would, so that retries, failover and restarts are exercised by a
real run (`tests/test_engine_faults.py`). Off unless configured; a restarted engine comes up without it."""
from __future__ import annotations

import json


def parse_spec(spec: str) -> tuple[int, int]:
    after, count = (int(x) for x in spec.split(":"))
    return after, count


class InjectedErrors:
    """ASGI middleware: requests AFTER + 1 .. AFTER + COUNT to /generate get a 500."""

    def __init__(self, app, spec: str):
        self.app = app
        self.after, self.count = parse_spec(spec)
        self.seen = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/generate":
            self.seen += 1
            if self.after < self.seen <= self.after + self.count:
                body = json.dumps({"error": {"message": "injected fault (engine.inject_errors)", "code": 500}}).encode()
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
