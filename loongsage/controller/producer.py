"""The rollout producer: keeps groups generating inside the staleness window.

It admits a prompt whenever the window has capacity, runs its group (n samples + rewards) as its
own task, and puts finished groups into `buffer`. At a weight update the controller asks it to
cancel in-flight groups that can no longer be trained in time (their requests are aborted on the
engines; partial work is counted, not trained).
"""
from __future__ import annotations

import asyncio
import logging
import time

from loongsage.buffer import StalenessWindow
from loongsage.controller.runtime import Runtime
from loongsage.controller.sampler import PromptSampler
from loongsage.rollout.single_turn import sample_group
from loongsage.sample import Sample
from loongsage.tasks.base import TaskSpec
from loongsage.timeline import Timeline

log = logging.getLogger("loongsage.producer")


class BusyClock:
    """Cumulative seconds during which at least one unit of work was active (and those intervals
    on a timeline, when one is given)."""

    def __init__(self, timeline: Timeline | None = None, track: str = "engines: generate") -> None:
        self.active, self.total, self._since = 0, 0.0, 0.0
        self.timeline, self.track = timeline, track

    def start(self) -> None:
        if self.active == 0:
            self._since = time.perf_counter()
        self.active += 1

    def stop(self) -> None:
        self.active -= 1
        if self.active == 0:
            now = time.perf_counter()
            self.total += now - self._since
            if self.timeline is not None:
                self.timeline.add(self.track, "generate", self._since, now)

    def now(self) -> float:
        return self.total + (time.perf_counter() - self._since if self.active else 0.0)


class RolloutProducer:
    def __init__(self, rt: Runtime, tokenizer, spec: TaskSpec, sampler: PromptSampler, window: StalenessWindow,
                 sampling_params: dict, n: int, timeline: Timeline | None = None):
        self.rt, self.tok, self.spec, self.sampler, self.window = rt, tokenizer, spec, sampler, window
        self.params, self.n = sampling_params, n
        self.buffer: asyncio.Queue[list[Sample]] = asyncio.Queue()
        self.inflight: dict[int, int] = {}  # group id -> version when it started
        self.cancelling: set[int] = set()
        self.busy = BusyClock(timeline)
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def poke(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        gid = 0
        while True:
            while self.window.capacity() == 0:
                self._wake.clear()
                await self._wake.wait()
            row = self.sampler.take(1)[0]
            self.window.admit()
            gid += 1
            self.inflight[gid] = self.window.version
            task = asyncio.create_task(self._one(gid, row))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, gid: int, row) -> None:
        self.busy.start()
        try:
            group = await sample_group(self.rt.router, self.tok, row, self.spec, self.params, self.n, gid,
                                       rid=f"group-{gid}")
        except Exception as exc:  # a broken request must not stop the run
            log.warning("group %d failed: %s", gid, exc)
            self.window.fail()
            return
        finally:
            self.busy.stop()
            self.inflight.pop(gid, None)
            self.poke()
        if gid in self.cancelling:
            self.cancelling.discard(gid)
            self.window.cancel()
        elif any(s.status == "failed" for s in group):
            self.window.fail()
        else:
            self.window.finish()
            self.buffer.put_nowait(group)

    async def cancel_too_old(self) -> int:
        """Aborts in-flight groups that would be out of the window at the next step."""
        old = [g for g, start in self.inflight.items() if self.window.in_flight_too_old(start) and g not in self.cancelling]
        for g in old:
            self.cancelling.add(g)
            await asyncio.gather(*[c.abort(f"group-{g}") for c in self.rt.router.clients])
        return len(old)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
