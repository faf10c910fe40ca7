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

Engines that die: the hand-overs skip engines that are down, and an engine that fails its release or
resume is marked down and reported to the supervisor (the hand-over goes on without it). Its
replacement starts only in the engines' turn (`replacing`): a new engine allocates weights and KV
cache and takes the current weights, which it must not do on a device the trainer holds; a train
step that comes meanwhile waits for it.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

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
    _trainers_turn: asyncio.Lock = field(default_factory=asyncio.Lock)  # from hand_to_trainer to hand_to_engines

    async def hand_to_trainer(self) -> None:
        await self._trainers_turn.acquire()  # an engine being replaced is ready first
        t0 = time.perf_counter()
        await self.router.hold()
        await self.router.on_each_up(lambda c: c.release_memory(["kv_cache", "weights"]))
        await self.trainers.reload_optimizer()
        self._t_released = time.perf_counter()
        self.released_s = self._t_released - t0
        self.timeline.add("colocation", "release engines", t0, self._t_released)

    async def hand_to_engines(self) -> None:
        t0 = time.perf_counter()
        try:
            self.offloaded_bytes = await self.trainers.offload_optimizer()
            await self.router.on_each_up(lambda c: c.resume_memory(["weights", "kv_cache"]))
        finally:
            self.router.reopen()
            self._trainers_turn.release()
        now = time.perf_counter()
        self.resumed_s = now - t0
        self.timeline.add("colocation", "resume engines", t0, now)
        if self._t_released is not None:
            self.timeline.add("colocation: engines released", "released", self._t_released, t0)

    def replacing(self, replace: Callable[[int], Awaitable[None]]) -> Callable[[int], Awaitable[None]]:
        """`replace(idx)` (Runtime.replace_engine) run in the engines' turn: after the trainer's
        step, before the next one."""
        async def in_engines_turn(idx: int) -> None:
            async with self._trainers_turn:
                await replace(idx)
        return in_engines_turn

    def metrics(self) -> dict[str, float]:
        return {"time/colocate_release_s": self.released_s, "time/colocate_resume_s": self.resumed_s,
                "colocate/offloaded_bytes": float(self.offloaded_bytes)}
