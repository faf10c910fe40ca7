"""Engine supervision: a long run outlives its engines (the policy's and the teachers').

Every `rollout.health.check_every_s` each engine's `/health` is probed. An engine that is gone
(nothing answers: killed, crashed, its node lost) is restarted at once; one that is alive but
unhealthy (probes time out: hung; or answer an error; or the router reported calls it failed) is
restarted after `failures` such checks in a row. Each fleet (the policy's engines, each teacher's)
says how one of its engines is replaced: a policy engine by `Runtime.replace_engine` (a new actor,
the TransferMesh rebuilt around it, every engine given the trainer's current weights); a teacher's
by `teachers.launch.replace_teacher_engine` (its weights, its residency). Meanwhile the fleet's
router sends nothing to it, and the calls it failed go to other engines or wait for it
(`rollout/router.py`). More than `max_restarts` restarts in a run end the run with the reason.

    probe loop ─► ok ───────────────► strikes = 0 (and back in the router if it was taken out)
               ─► gone ─────────────► restart now
               ─► hung / error ─────► strike; `failures` strikes ─► restart
    router: a call failed on engine i ─► taken out of the router; probed now
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

from loongsage.rollout.config import EngineHealthConfig
from loongsage.rollout.resume import system_failure
from loongsage.rollout.router import Router

log = logging.getLogger("loongsage.supervisor")


@dataclass
class Strikes:
    """Per engine: consecutive unhealthy checks; pure bookkeeping of what a probe or report means."""
    limit: int
    count: dict[Hashable, int] = field(default_factory=dict)
    reported: set[Hashable] = field(default_factory=set)  # a call failed on it since its last check

    def verdict(self, key: Hashable, outcome: str) -> str:
        """`outcome` of a probe: ok | gone | unhealthy. Returns ok | wait | restart."""
        if outcome == "gone":
            return "restart"
        failed_calls = key in self.reported
        self.reported.discard(key)
        if outcome == "ok" and not failed_calls:
            self.count[key] = 0
            return "ok"
        self.count[key] = self.count.get(key, 0) + 1
        return "restart" if self.count[key] >= self.limit else "wait"

    def reset(self, key: Hashable) -> None:
        self.count[key] = 0
        self.reported.discard(key)


@dataclass
class Fleet:
    """Engines kept up together: the router over them and how engine `idx` is replaced (the
    replacement brings it back into the router)."""
    name: str  # "engine", "teacher-a"
    router: Router
    replace: Callable[[int], Awaitable[None]]


class EngineSupervisor:
    def __init__(self, fleets: list[Fleet], cfg: EngineHealthConfig, on_fatal: Callable[[BaseException], None],
                 console=None, timeline=None):
        """`on_fatal`: called once when engines cannot be kept up (the run must stop with that error)."""
        self.cfg, self.on_fatal, self.console, self.timeline = cfg, on_fatal, console, timeline
        self.fleets: dict[str, Fleet] = {}
        self.strikes = Strikes(cfg.failures)
        self.restarting: set[tuple[str, int]] = set()
        self.restarts = 0
        self.error: BaseException | None = None
        self._retried_seen = 0
        self._tasks: set[asyncio.Task] = set()
        for fleet in fleets:
            self.add(fleet)

    def add(self, fleet: Fleet) -> None:
        self.fleets[fleet.name] = fleet
        if self.cfg.check_every_s > 0:  # supervision on: the router reports the calls its engines fail
            fleet.router.on_engine_failure = lambda idx, exc, name=fleet.name: self.on_failure((name, idx), exc)

    def _engines(self) -> list[tuple[str, int]]:
        return [(name, i) for name, f in self.fleets.items() for i in range(len(f.router.clients))]

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.cfg.check_every_s)
                await self.check_all()
        finally:
            for t in list(self._tasks):
                t.cancel()

    def close(self) -> None:
        """The run is ending: engines are about to be stopped on purpose, so calls they fail from here
        on (an abort sent as a producer is cancelled) are not failures to check or restart."""
        for fleet in self.fleets.values():
            fleet.router.on_engine_failure = None
        for t in list(self._tasks):
            t.cancel()

    async def check_all(self) -> None:
        await asyncio.gather(*[self.check(key) for key in self._engines() if key not in self.restarting])

    async def probe(self, key: tuple[str, int]) -> str:
        name, idx = key
        try:
            status = await asyncio.wait_for(self.fleets[name].router.clients[idx].health_status(), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            return "unhealthy"
        return "gone" if status is None else "ok" if status == 200 else "unhealthy"

    async def check(self, key: tuple[str, int]) -> None:
        outcome = await self.probe(key)
        if key in self.restarting:
            return
        verdict = self.strikes.verdict(key, outcome)
        router = self.fleets[key[0]].router
        if verdict == "ok":
            if not router.up[key[1]]:
                await router.mark_up(key[1])
        elif verdict == "restart":
            self.restart(key, "is gone" if outcome == "gone" else f"unhealthy for {self.cfg.failures} checks")

    def on_failure(self, key: tuple[str, int], exc: BaseException) -> None:
        """A fleet's router: a call failed on one of its engines (unreachable, or a 5xx): out of the
        router until a check says it is fine; checked now."""
        if key in self.restarting or self.error is not None:
            return
        self.strikes.reported.add(key)
        router = self.fleets[key[0]].router
        if router.up[key[1]]:
            router.mark_down(key[1])
            log.warning("%s-%d failed a call (%s); checking it", *key, system_failure(exc))
            self._spawn(self.check(key))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def restart(self, key: tuple[str, int], why: str) -> None:
        """Starts replacing engine `key` (in its own task: the other engines are still checked)."""
        if key in self.restarting or self.error is not None:
            return
        if self.restarts >= self.cfg.max_restarts:
            self._fail(RuntimeError(f"{key[0]}-{key[1]} {why}, and the run already restarted engines {self.restarts} "
                                    f"times (rollout.health.max_restarts={self.cfg.max_restarts})"))
            return
        self.restarting.add(key)
        self.restarts += 1
        self._spawn(self._restart(key, why))

    async def _restart(self, key: tuple[str, int], why: str) -> None:
        label, fleet = f"{key[0]}-{key[1]}", self.fleets[key[0]]
        self._say(f"{label} {why}: restarting it (restart {self.restarts} of at most {self.cfg.max_restarts})")
        try:
            if self.timeline is not None:
                with self.timeline.span("engines: restart", label):
                    await fleet.replace(key[1])
            else:
                await fleet.replace(key[1])
            self._say(f"{label} is back at {fleet.router.clients[key[1]].base_url}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(RuntimeError(f"{label} could not be restarted: {type(exc).__name__}: {exc}"))
        finally:
            self.restarting.discard(key)
            self.strikes.reset(key)

    async def settled(self) -> None:
        """Returns once no restart is under way; raises the error that stopped supervision."""
        while self.restarting and self.error is None:
            await asyncio.sleep(0.1)
        if self.error is not None:
            raise self.error

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.on_fatal(exc)

    def _say(self, text: str) -> None:
        log.warning(text)
        if self.console is not None:
            self.console.print(text)

    def metrics(self) -> dict[str, float]:
        """`engine/restarts` (policy and teacher engines, in the run so far) and `samples/retried`
        (model calls sent again after an engine failed them, since the last call)."""
        retried = sum(f.router.retried for f in self.fleets.values())
        delta, self._retried_seen = retried - self._retried_seen, retried
        return {"engine/restarts": float(self.restarts), "samples/retried": float(delta)}


async def recover_weight_update(supervisor: EngineSupervisor, rt, version: int) -> dict[str, float]:
    """A weight update to `version` failed on a policy engine: every engine is checked now (the gone
    or hung ones replaced, each replacement giving all engines the trainer's current weights);
    engines still below `version` afterwards get the current weights in one more push."""
    t0 = time.perf_counter()
    await supervisor.check_all()
    await supervisor.settled()
    if not all(await asyncio.gather(*[_serves_at_least(c, version) for c in rt.router.clients])):
        async with rt.sync_lock:
            await rt.push_current_weights()
    return {"time/weight_sync_s": time.perf_counter() - t0, "weight_sync/bytes": 0.0}


async def _serves_at_least(client, version: int) -> bool:
    try:
        return int((await client.model_info())["weight_version"]) >= version
    except Exception:  # unreachable, or a label that is no step (SGLang's "default")
        return False
