"""Engine supervision: a long run outlives its engines.

Every `rollout.health.check_every_s` each engine's `/health` is probed. An engine that is gone
(nothing answers: killed, crashed, its node lost) is restarted at once; one that is alive but
unhealthy (probes time out: hung; or answer an error; or the router reported calls it failed) is
restarted after `failures` such checks in a row. A restart (`Runtime.replace_engine`) starts a new
actor, rebuilds the TransferMesh around it and gives every engine the trainer's current weights;
meanwhile the router sends nothing to it, and the calls it failed go to other engines or wait for
it (`rollout/router.py`). More than `max_restarts` restarts in a run end the run with the reason.

    probe loop ─► ok ───────────────► strikes = 0 (and back in the router if it was taken out)
               ─► gone ─────────────► restart now
               ─► hung / error ─────► strike; `failures` strikes ─► restart
    router: a call failed on engine i ─► taken out of the router; probed now
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loongsage.rollout.config import EngineHealthConfig
from loongsage.rollout.resume import system_failure

log = logging.getLogger("loongsage.supervisor")


@dataclass
class Strikes:
    """Per engine: consecutive unhealthy checks; pure bookkeeping of what a probe or report means."""
    limit: int
    count: dict[int, int] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)  # a call failed on it since its last check

    def verdict(self, idx: int, outcome: str) -> str:
        """`outcome` of a probe: ok | gone | unhealthy. Returns ok | wait | restart."""
        if outcome == "gone":
            return "restart"
        failed_calls = idx in self.reported
        self.reported.discard(idx)
        if outcome == "ok" and not failed_calls:
            self.count[idx] = 0
            return "ok"
        self.count[idx] = self.count.get(idx, 0) + 1
        return "restart" if self.count[idx] >= self.limit else "wait"

    def reset(self, idx: int) -> None:
        self.count[idx] = 0
        self.reported.discard(idx)


class EngineSupervisor:
    def __init__(self, rt, cfg: EngineHealthConfig, on_fatal: Callable[[BaseException], None], console=None,
                 timeline=None):
        """`rt`: the run's `Runtime`; `on_fatal`: called once when engines cannot be kept up (the
        run must stop with that error)."""
        self.rt, self.cfg, self.on_fatal, self.console, self.timeline = rt, cfg, on_fatal, console, timeline
        self.strikes = Strikes(cfg.failures)
        self.restarting: set[int] = set()
        self.restarts = 0
        self.error: BaseException | None = None
        self._retried_seen = 0
        self._tasks: set[asyncio.Task] = set()
        rt.router.on_engine_failure = self.on_failure

    @property
    def engines(self) -> int:
        return len(self.rt.router.clients)

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.cfg.check_every_s)
                await asyncio.gather(*[self.check(i) for i in range(self.engines) if i not in self.restarting])
        finally:
            for t in list(self._tasks):
                t.cancel()

    async def probe(self, idx: int) -> str:
        try:
            status = await asyncio.wait_for(self.rt.router.clients[idx].health_status(), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            return "unhealthy"
        return "gone" if status is None else "ok" if status == 200 else "unhealthy"

    async def check(self, idx: int) -> None:
        outcome = await self.probe(idx)
        if idx in self.restarting:
            return
        verdict = self.strikes.verdict(idx, outcome)
        if verdict == "ok":
            if not self.rt.router.up[idx]:
                await self.rt.router.mark_up(idx)
        elif verdict == "restart":
            self.restart(idx, "is gone" if outcome == "gone" else f"unhealthy for {self.cfg.failures} checks")

    def on_failure(self, idx: int, exc: BaseException) -> None:
        """The router: a call failed on engine `idx` (unreachable, or a 5xx): out of the router until
        a check says it is fine; checked now."""
        if idx in self.restarting or self.error is not None:
            return
        self.strikes.reported.add(idx)
        if self.rt.router.up[idx]:
            self.rt.router.mark_down(idx)
            log.warning("engine-%d failed a call (%s); checking it", idx, system_failure(exc))
            self._spawn(self.check(idx))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def restart(self, idx: int, why: str) -> None:
        """Starts restarting engine `idx` (in its own task: the other engines are still checked)."""
        if idx in self.restarting or self.error is not None:
            return
        if self.restarts >= self.cfg.max_restarts:
            self._fail(RuntimeError(f"engine-{idx} {why}, and the run already restarted engines {self.restarts} "
                                    f"times (rollout.health.max_restarts={self.cfg.max_restarts})"))
            return
        self.restarting.add(idx)
        self.restarts += 1
        self._spawn(self._restart(idx, why))

    async def _restart(self, idx: int, why: str) -> None:
        self._say(f"engine-{idx} {why}: restarting it (restart {self.restarts} of at most {self.cfg.max_restarts})")
        try:
            if self.timeline is not None:
                with self.timeline.span("engines: restart", f"engine-{idx}"):
                    await self.rt.replace_engine(idx)
            else:
                await self.rt.replace_engine(idx)
            self._say(f"engine-{idx} is back at {self.rt.router.clients[idx].base_url}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(RuntimeError(f"engine-{idx} could not be restarted: {type(exc).__name__}: {exc}"))
        finally:
            self.restarting.discard(idx)
            self.strikes.reset(idx)

    async def recover(self, version: int) -> dict[str, float]:
        """A weight update to `version` failed on an engine: every engine is checked now (the gone
        or hung ones restarted, each restart giving all engines the trainer's current weights);
        engines still below `version` afterwards get the current weights in one more push."""
        t0 = time.perf_counter()
        await asyncio.gather(*[self.check(i) for i in range(self.engines) if i not in self.restarting])
        while self.restarting and self.error is None:
            await asyncio.sleep(0.1)
        if self.error is not None:
            raise self.error
        if not all(await asyncio.gather(*[self._serves_at_least(c, version) for c in self.rt.router.clients])):
            async with self.rt.sync_lock, self.rt.trainers.stepping:
                await self.rt.sync.push(await self.rt.trainers.version())
        return {"time/weight_sync_s": time.perf_counter() - t0, "weight_sync/bytes": 0.0}

    @staticmethod
    async def _serves_at_least(client, version: int) -> bool:
        try:
            return int((await client.model_info())["weight_version"]) >= version
        except Exception:  # unreachable, or a label that is no step (SGLang's "default")
            return False

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.on_fatal(exc)

    def _say(self, text: str) -> None:
        log.warning(text)
        if self.console is not None:
            self.console.print(text)

    def metrics(self) -> dict[str, float]:
        """`engine/restarts` (in the run so far) and `samples/retried` (model calls sent again after
        an engine failed them, since the last call)."""
        retried, self._retried_seen = self.rt.router.retried - self._retried_seen, self.rt.router.retried
        return {"engine/restarts": float(self.restarts), "samples/retried": float(retried)}
