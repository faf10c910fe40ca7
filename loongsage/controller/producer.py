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

from loongsage.agentflow.runner import EpisodeRunner
from loongsage.buffer import StalenessWindow
from loongsage.controller.runtime import Runtime
from loongsage.controller.sampler import PromptSampler
from loongsage.sample import Group
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
    def __init__(self, rt: Runtime, runner: EpisodeRunner, sampler: PromptSampler, window: StalenessWindow,
                 n: int, mask_failures: bool = True, timeline: Timeline | None = None):
        self.rt, self.runner, self.sampler, self.window = rt, runner, sampler, window
        self.n, self.mask_failures = n, mask_failures
        self.buffer: asyncio.Queue[Group] = asyncio.Queue()
        self.inflight: dict[int, int] = {}  # group id -> version when it started
        self.cancelling: set[int] = set()
        self.busy = BusyClock(timeline)
        self._wake = asyncio.Event()
        self._tasks: dict[int, asyncio.Task] = {}

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
            self._tasks[gid] = task
            task.add_done_callback(lambda _, g=gid: self._tasks.pop(g, None))

    async def _one(self, gid: int, row) -> None:
        self.busy.start()
        try:
            group = await self.runner.group(row, self.n, gid)
        except asyncio.CancelledError:  # an agent group cancelled at a weight update
            self.cancelling.discard(gid)
            self.window.cancel()
            raise
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
        elif group.failed and self.mask_failures:
            self.window.fail()
        else:
            self.window.finish()
            self.buffer.put_nowait(group)

    async def cancel_too_old(self) -> int:
        """Aborts in-flight groups that would be out of the window at the next step."""
        old = [g for g, start in self.inflight.items() if self.window.in_flight_too_old(start) and g not in self.cancelling]
        for g in old:
            self.cancelling.add(g)
            if self.runner.cfg.kind == "single_turn":  # one request per group: abort it on the engines
                await asyncio.gather(*[c.abort(f"group-{g}") for c in self.rt.router.clients])
            elif g in self._tasks:  # agent episodes: cancel them (black-box processes are killed)
                self._tasks[g].cancel()
        return len(old)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
