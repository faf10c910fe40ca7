"""TransferMesh: a run's weight sync. One transport per group of receivers as the planner routed
them (`topology.plan`), each whole in its own module (trainer side, engine routes, this controller
side); the mesh also owns what surrounds a delivery: holding the receivers while they load (the
pause mode, with the one-bucket fast path), and verification as its own step (`verify.py`).

    begin(v)   ─► every route's trainer side submitted now (before the trainer's next step)
    deliver(v) ─► pause receivers ─► routes deliver (relay fan-out after the collective) ─► checksums
               ─► resume: every receiver confirmed v, bit for bit where verified
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from loongsage.api import InferenceClient
from loongsage.transfer.broadcast import DistributedWeightSync
from loongsage.transfer.config import TransferConfig
from loongsage.transfer.disk import DiskWeightSync
from loongsage.transfer.mapped import MappedShmSync
from loongsage.transfer.relay import RelayShmSync
from loongsage.transfer.staged import ShmWeightSync
from loongsage.transfer.topology import Endpoint, Plan
from loongsage.transfer.transport import BaseTransport
from loongsage.transfer.verify import ChecksumVerifier


def discover(trainers, engine_actors, transfer: TransferConfig) -> tuple[Endpoint, list[Endpoint]]:
    """Host ids (Ray node ids) and devices reported by trainer rank 0 and each engine actor, with
    the `transfer` section's overrides applied."""
    (t_host, t_dev), *engines = ray.get([trainers.rank0.where.remote()] + [a.where.remote() for a in engine_actors])
    return (transfer.endpoint("trainer", t_host, t_dev),
            [transfer.endpoint(f"engine-{i}", h, d) for i, (h, d) in enumerate(engines)])


@dataclass
class RouteContext:
    """What a route's controller side is built from (a user's transport class takes this too)."""
    trainers: object  # the trainer group (ranks, rank0, weight_meta())
    clients: list[InferenceClient]  # the receivers on this route
    engine_dtype: str
    bucket_mb: float
    backend: str  # gloo | nccl
    disk_dir: str | None = None
    extensions: bool = True  # embedded engines (LoongSage's extra routes), not SGLang
    on_cpu: bool = True  # the receivers run on CPU (shm: the one-copy mapped route suits them)
    colocated: bool = False  # receivers time-share the trainer's devices: no second copy of weights they keep
    peers: dict[InferenceClient, list[InferenceClient]] = field(default_factory=dict)  # relay_shm: relay -> peers


def _disk(ctx: RouteContext) -> BaseTransport:
    if ctx.disk_dir is None:
        raise ValueError("TransferMesh: a disk route needs disk_dir, a folder its receivers may load from")
    return DiskWeightSync(ctx.trainers, ctx.clients, ctx.engine_dtype, ctx.disk_dir)


# route -> how its controller side is built. Same GPU: the engine's own buffers written device to device
# (one copy; SGLang: trainer-side device buffers + IPC handles). Same host: one copy into engine-owned
# buffers (SGLang or GPU engines: staging buffers + handles). Other hosts: the collective to one relay
# per host, which fans out over shared memory. Anything: disk. Colocated engines (placement.mode) release
# their weights while the trainer trains, so they take the staging route, never the mapped double buffer.
ROUTES: dict[str, Callable[[RouteContext], BaseTransport]] = {
    "cuda_ipc": lambda ctx: (MappedShmSync(ctx.trainers, ctx.clients) if ctx.extensions and not ctx.colocated
                             else ShmWeightSync(ctx.trainers, ctx.clients, ctx.engine_dtype, ctx.bucket_mb,
                                                on_device=True)),
    "shm": lambda ctx: (MappedShmSync(ctx.trainers, ctx.clients) if ctx.extensions and ctx.on_cpu and not ctx.colocated
                        else ShmWeightSync(ctx.trainers, ctx.clients, ctx.engine_dtype, ctx.bucket_mb)),
    "collective": lambda ctx: DistributedWeightSync(ctx.trainers, ctx.clients, ctx.engine_dtype, ctx.bucket_mb,
                                                    ctx.backend),
    "relay_shm": lambda ctx: RelayShmSync(ctx.peers, ctx.bucket_mb),
    "disk": _disk,
}


class WeightMesh:
    def __init__(self, routes: Plan, trainers, clients: dict[str, InferenceClient], engine_dtype: str,
                 bucket_mb: float, backend: str, verify_every: int = 0, disk_dir: str | None = None,
                 extensions: bool = True, pause_mode: str = "in_place",
                 implementations: dict[str, str] | None = None, colocated: bool = False):
        """`clients`: receiver name -> its client (owned by the mesh from now on). `extensions`: the
        receivers are embedded engines, with LoongSage's routes (/map_weights, /share_weights,
        /weights_checksum); SGLang servers are not. `implementations`: route -> module:attr of a
        transport class taking a `RouteContext`, replacing the built-in one. `colocated`: the
        receivers release their memory between updates (placement.mode colocated)."""
        from loongsage.extensions import resolve

        groups = routes.by_transport()
        if "relay_shm" in groups and not extensions:
            raise ValueError(f"TransferMesh: {groups['relay_shm']} would be fed by a relay engine, but SGLang engines "
                             "cannot relay (no /share_weights); list their transfer.transports without 'shm' "
                             "(they then take the disk route)")
        unknown = sorted(set(groups) - set(ROUTES))
        if unknown:
            raise NotImplementedError(f"TransferMesh: routes {unknown} (for {[n for t in unknown for n in groups[t]]}) "
                                      "are planned but have no transport; set transfer.transports to avoid them")
        self.plan, self.clients, self.pause_mode = routes, clients, pause_mode
        self.parts: dict[str, BaseTransport] = {}
        for route, names in groups.items():
            ctx = RouteContext(trainers, [clients[n] for n in names], engine_dtype, bucket_mb, backend, disk_dir,
                               extensions, routes.on_cpu(names), colocated)
            if route == "relay_shm":
                for r in routes.routes:
                    if r.transport == "relay_shm":
                        ctx.peers.setdefault(clients[r.relay], []).append(clients[r.receiver])
            build = resolve(implementations[route], "transport") if implementations and route in implementations \
                else ROUTES[route]
            self.parts[route] = build(ctx)
        self.buckets = max((p.buckets for p in self.parts.values()), key=len)
        first = next(p for p in self.parts.values() if hasattr(p, "bucket_names"))
        self.names = [n for names in first.bucket_names for n in names]  # every exported tensor
        receivers = [c for p in self.parts.values() for c in p.clients]
        self.verifier = ChecksumVerifier(trainers, receivers, self.names, engine_dtype, verify_every)

    async def setup(self) -> None:
        await asyncio.gather(*[p.setup() for p in self.parts.values()])

    def begin(self, version: int) -> dict:
        begun = {name: part.begin(version) for name, part in self.parts.items()}
        begun["verify"] = self.verifier.begin(version)  # submitted now: before the next train step
        return begun

    async def deliver(self, version: int, begun: dict) -> dict[str, float]:
        """Every receiver serves `version` afterwards (confirmed, and verified when due)."""
        mode = self.pause_mode
        if mode == "in_place" and len(self.buckets) == 1:
            # One bucket is applied by the engine thread between two steps with every running request
            # held where it is: an in-place pause by construction, without two extra round trips.
            mode = "none"
        clients = list(self.clients.values())
        if mode != "none":
            await asyncio.gather(*[c.pause(mode) for c in clients])
        try:
            out = await self._deliver_parts(version, begun)
            await self.verifier.check(version, begun["verify"])
        finally:
            if mode != "none":
                await asyncio.gather(*[c.resume() for c in clients])
        return out

    async def _deliver_parts(self, version: int, begun: dict) -> dict[str, float]:
        names = [n for n in self.parts if n != "relay_shm"]
        results = await asyncio.gather(*[self.parts[n].deliver(version, begun[n]) for n in names])
        if "relay_shm" in self.parts:  # the relays hold the version now: fan it out on their hosts
            names.append("relay_shm")
            results.append(await self.parts["relay_shm"].deliver(version, begun["relay_shm"]))
        out = {"time/weight_sync_s": max(r["time/weight_sync_s"] for r in results),
               "weight_sync/bytes": max(r["weight_sync/bytes"] for r in results)}
        for n, r in zip(names, results):
            out[f"time/weight_sync_{n}_s"] = r["time/weight_sync_s"]
        return out

    async def relabel(self, version: int) -> dict[str, float]:
        """A version that changed no weight (a step with nothing to train): every receiver only
        relabels what it serves; no bytes move and running requests go on."""
        t0 = time.perf_counter()
        await asyncio.gather(*[c.update_weight_version(version) for c in self.clients.values()])
        return {"time/weight_sync_s": time.perf_counter() - t0, "weight_sync/bytes": 0.0}

    async def push(self, version: int) -> dict[str, float]:
        return await self.deliver(version, self.begin(version))

    async def aclose(self, gone: list[str] = ()) -> None:
        """`gone`: receivers that died (the mesh is being rebuilt around their successors)."""
        dead = [self.clients[n] for n in gone if n in self.clients]
        await asyncio.gather(*[p.aclose(gone=[c for c in dead if c in p.clients])
                               if "gone" in inspect.signature(p.aclose).parameters else p.aclose()
                               for p in self.parts.values()], return_exceptions=bool(dead))
        for c in self.clients.values():
            await c.aclose()
