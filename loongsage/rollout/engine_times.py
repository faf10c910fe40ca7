"""Where the engines' time went in each step, from their cumulative counters (GET /get_server_info:
prefill_s, decode_s, sample_s, schedule_s, http_s, busy_s, tokens), so a regression in any part of
the engine shows in metrics.jsonl and on the timeline. Engines that do not report a counter (SGLang
servers report none of the time fields) leave it out; an engine seen for the first time (a restart)
sets its baseline and counts from the next step."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("loongsage.rollout")

COUNTERS = ("prefill_s", "decode_s", "sample_s", "schedule_s", "http_s", "busy_s", "steps",
            "prefill_tokens", "cached_tokens", "generated_tokens")
ENGINE_SPLIT = tuple(f"engine/{k}" for k in ("prefill_s", "decode_s", "sample_s", "schedule_s", "http_s"))


class EngineTimes:
    def __init__(self, clients: Callable[[], list]):
        """`clients()`: the engines' clients now (the router's list changes when an engine restarts)."""
        self.clients = clients
        self._last: dict[str, dict[str, float]] = {}
        self._delta: dict[str, float] = {}

    async def refresh(self) -> None:
        clients = [c for c in self.clients() if hasattr(c, "server_info")]
        infos = await asyncio.gather(*[c.server_info() for c in clients], return_exceptions=True)
        delta: dict[str, float] = {}
        for client, info in zip(clients, infos):
            if isinstance(info, BaseException) or not isinstance(info, dict):
                continue  # a dead engine is the supervisor's; its time is not counted
            now = {k: float(info[k]) for k in COUNTERS if isinstance(info.get(k), (int, float))}
            before = self._last.get(client.base_url)
            self._last[client.base_url] = now
            if before is None:
                continue
            for k, v in now.items():
                delta[k] = delta.get(k, 0.0) + max(0.0, v - before.get(k, 0.0))
        self._delta = delta

    def metrics(self) -> dict[str, float]:
        """engine/<counter> summed over the engines since the previous step (seconds or tokens)."""
        return {f"engine/{k}": v for k, v in self._delta.items()}
