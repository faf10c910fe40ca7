"""TransferMesh: a run's weight sync, one transport per group of receivers as the planner routed
them (`topology.plan`). Same interface as each transport (setup / begin / deliver / push / aclose),
so the controller does not know which paths are in use."""
from __future__ import annotations

import asyncio

import ray

from loongsage.transfer.config import TransferConfig
from loongsage.transfer.distributed_sync import DistributedWeightSync
from loongsage.transfer.shm_sync import ShmWeightSync
from loongsage.transfer.topology import TRANSPORTS, Endpoint, Plan

EXECUTED = ("shm", "collective")  # routes with a transport today; the rest are planned only


def discover(trainers, engine_actors, transfer: TransferConfig) -> tuple[Endpoint, list[Endpoint]]:
    """Host ids (Ray node ids) and devices reported by trainer rank 0 and each engine actor, with
    the `transfer` section's overrides applied."""
    (t_host, t_dev), *engines = ray.get([trainers.rank0.where.remote()] + [a.where.remote() for a in engine_actors])

    def make(name: str, host: str, device: str) -> Endpoint:
        return Endpoint(name, transfer.hosts.get(name, host), device, tuple(transfer.transports.get(name, TRANSPORTS)))

    return make("trainer", t_host, t_dev), [make(f"engine-{i}", h, d) for i, (h, d) in enumerate(engines)]


class WeightMesh:
    def __init__(self, routes: Plan, trainers, urls: dict[str, str], engine_dtype: str, bucket_mb: float,
                 backend: str):
        groups = routes.by_transport()
        todo = sorted(set(groups) - set(EXECUTED))
        if todo:
            raise NotImplementedError(f"TransferMesh: routes {todo} (for {[n for t in todo for n in groups[t]]}) are "
                                      "planned but have no transport yet; set transfer.transports to avoid them")
        self.plan = routes
        self.parts: dict[str, ShmWeightSync | DistributedWeightSync] = {}
        if "shm" in groups:
            self.parts["shm"] = ShmWeightSync(trainers, [urls[n] for n in groups["shm"]], engine_dtype, bucket_mb)
        if "collective" in groups:
            self.parts["collective"] = DistributedWeightSync(trainers, [urls[n] for n in groups["collective"]],
                                                             engine_dtype, bucket_mb, backend)
        self.buckets = next(iter(self.parts.values())).buckets

    async def setup(self) -> None:
        await asyncio.gather(*[p.setup() for p in self.parts.values()])

    def begin(self, version: int) -> dict:
        return {name: part.begin(version) for name, part in self.parts.items()}

    async def deliver(self, version: int, begun: dict) -> dict[str, float]:
        names = list(self.parts)
        results = await asyncio.gather(*[self.parts[n].deliver(version, begun[n]) for n in names])
        out = {"time/weight_sync_s": max(r["time/weight_sync_s"] for r in results),
               "weight_sync/bytes": max(r["weight_sync/bytes"] for r in results)}
        for n, r in zip(names, results):
            out[f"time/weight_sync_{n}_s"] = r["time/weight_sync_s"]
        return out

    async def push(self, version: int) -> dict[str, float]:
        return await self.deliver(version, self.begin(version))

    async def aclose(self) -> None:
        await asyncio.gather(*[p.aclose() for p in self.parts.values()])
