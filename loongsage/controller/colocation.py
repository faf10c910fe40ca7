"""Colocated placement's time-sharing: each step the engines give their devices to the trainer.

    generation of batch t (engines hold weights + KV; optimizer state on the host)
    ─► hand_to_trainer: router holds new calls, in-flight ones end ─► engines release weights and
       KV cache (/release_memory_occupation) ─► optimizer state back on the ranks' devices
    ─► train step t
    ─► hand_to_engines: optimizer state to the host ─► engines resume weights and KV cache
       (/resume_memory_occupation) ─► router sends again ─► weight update v_t ─► generation of t + 1

Only a synchronous schedule can do this (rollout.max_staleness 0, checked with the config): with
generation overlapping training there would be no moment the engines are idle. A disaggregated run
has no Colocation; the loop is otherwise the same.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loongsage.rollout.router import Router
from loongsage.timeline import Timeline


@dataclass
class Colocation:
    router: Router
    trainers: object  # TrainerGroup
    timeline: Timeline
    released_s: float = 0.0  # this step's hand-overs, reported with the step
    resumed_s: float = 0.0
    offloaded_bytes: int = 0
    _t_released: float | None = None

    async def hand_to_trainer(self) -> None:
        t0 = time.perf_counter()
        await self.router.hold()
        await asyncio.gather(*[c.release_memory(["kv_cache", "weights"]) for c in self.router.clients])
        await self.trainers.reload_optimizer()
        self._t_released = time.perf_counter()
        self.released_s = self._t_released - t0
        self.timeline.add("colocation", "release engines", t0, self._t_released)

    async def hand_to_engines(self) -> None:
        t0 = time.perf_counter()
        try:
            self.offloaded_bytes = await self.trainers.offload_optimizer()
            await asyncio.gather(*[c.resume_memory(["weights", "kv_cache"]) for c in self.router.clients])
        finally:
            self.router.reopen()
        now = time.perf_counter()
        self.resumed_s = now - t0
        self.timeline.add("colocation", "resume engines", t0, now)
        if self._t_released is not None:
            self.timeline.add("colocation: engines released", "released", self._t_released, t0)

    def metrics(self) -> dict[str, float]:
        return {"time/colocate_release_s": self.released_s, "time/colocate_resume_s": self.resumed_s,
                "colocate/offloaded_bytes": float(self.offloaded_bytes)}
