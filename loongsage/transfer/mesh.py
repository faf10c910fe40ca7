"""TransferMesh: a run's weight sync, one transport per group of receivers as the planner routed
them (`topology.plan`). Same interface as each transport (setup / begin / deliver / push / aclose),
so the controller does not know which paths are in use."""
from __future__ import annotations

import asyncio

import ray

from loongsage.transfer.config import TransferConfig
from loongsage.transfer.disk_sync import DiskWeightSync
from loongsage.transfer.distributed_sync import DistributedWeightSync
from loongsage.transfer.relay_sync import RelayShmSync
from loongsage.transfer.shm_mapped_sync import MappedShmSync
from loongsage.transfer.shm_sync import ShmWeightSync
from loongsage.transfer.topology import Endpoint, Plan
from loongsage.transfer.transport import WeightTransport

EXECUTED = ("cuda_ipc", "shm", "collective", "relay_shm", "disk")


def discover(trainers, engine_actors, transfer: TransferConfig) -> tuple[Endpoint, list[Endpoint]]:
    """Host ids (Ray node ids) and devices reported by trainer rank 0 and each engine actor, with
    the `transfer` section's overrides applied."""
    (t_host, t_dev), *engines = ray.get([trainers.rank0.where.remote()] + [a.where.remote() for a in engine_actors])
    return (transfer.endpoint("trainer", t_host, t_dev),
            [transfer.endpoint(f"engine-{i}", h, d) for i, (h, d) in enumerate(engines)])


class WeightMesh:
    def __init__(self, routes: Plan, trainers, urls: dict[str, str], engine_dtype: str, bucket_mb: float,
                 backend: str, verify_every: int = 0, disk_dir: str | None = None, extensions: bool = True,
                 api_key: str | None = None):
        """`extensions`: the receivers are embedded engines, with LoongSage's routes (/map_weights,
        /share_weights, /weights_checksum); SGLang servers are not. `api_key`: the receivers' key."""
        groups = routes.by_transport()
        if "relay_shm" in groups and not extensions:
            raise ValueError(f"TransferMesh: {groups['relay_shm']} would be fed by a relay engine, but SGLang engines "
                             "cannot relay (no /share_weights); list their transfer.transports without 'shm' "
                             "(they then take the disk route)")
        todo = sorted(set(groups) - set(EXECUTED))
        if todo:
            raise NotImplementedError(f"TransferMesh: routes {todo} (for {[n for t in todo for n in groups[t]]}) are "
                                      "planned but have no transport yet; set transfer.transports to avoid them")
        self.plan = routes
        self.parts: dict[str, WeightTransport] = {}
        if "cuda_ipc" in groups:  # same GPU: the engine's own buffers written device to device (one copy);
            ipc_urls = [urls[n] for n in groups["cuda_ipc"]]  # SGLang: trainer-side device buffers + IPC handles
            self.parts["cuda_ipc"] = (MappedShmSync(trainers, ipc_urls, api_key) if extensions
                                      else ShmWeightSync(trainers, ipc_urls, engine_dtype, bucket_mb, on_device=True,
                                                         api_key=api_key))
        if "shm" in groups:  # one copy into engine-owned buffers; SGLang or GPU engines: staging buffers + handles
            shm_urls = [urls[n] for n in groups["shm"]]
            self.parts["shm"] = (MappedShmSync(trainers, shm_urls, api_key) if extensions and routes.on_cpu(groups["shm"])
                                 else ShmWeightSync(trainers, shm_urls, engine_dtype, bucket_mb, api_key=api_key))
        if "collective" in groups:
            self.parts["collective"] = DistributedWeightSync(trainers, [urls[n] for n in groups["collective"]],
                                                             engine_dtype, bucket_mb, backend, api_key=api_key)
        if "relay_shm" in groups:  # fed by the relays, after the collective part
            peers: dict[str, list[str]] = {}
            for r in routes.routes:
                if r.transport == "relay_shm":
                    peers.setdefault(urls[r.relay], []).append(urls[r.receiver])
            self.parts["relay_shm"] = RelayShmSync(peers, bucket_mb, api_key)
        if "disk" in groups:
            if disk_dir is None:
                raise ValueError("TransferMesh: a disk route needs disk_dir, a folder its receivers may load from")
            self.parts["disk"] = DiskWeightSync(trainers, [urls[n] for n in groups["disk"]], engine_dtype, disk_dir,
                                                api_key)
        first = next(p for p in self.parts.values() if hasattr(p, "bucket_names"))
        # the run loop's in-place fast path (no explicit pause) needs one bucket on every route
        self.buckets = max((p.buckets for p in self.parts.values()), key=len)
        self.names = [n for names in first.bucket_names for n in names]  # every exported tensor
        self.trainers, self.dtype, self.verify_every = trainers, engine_dtype, verify_every

    async def setup(self) -> None:
        await asyncio.gather(*[p.setup() for p in self.parts.values()])

    def begin(self, version: int) -> dict:
        begun = {name: part.begin(version) for name, part in self.parts.items()}
        if self.verify_every and version % self.verify_every == 0:  # submitted now: before the next train step
            begun["checksum"] = [r.weights_checksum.remote(self.names, self.dtype) for r in self.trainers.ranks]
        return begun

    async def deliver(self, version: int, begun: dict) -> dict[str, float]:
        names = [n for n in self.parts if n != "relay_shm"]
        results = await asyncio.gather(*[self.parts[n].deliver(version, begun[n]) for n in names])
        if "relay_shm" in self.parts:  # the relays hold the version now: fan it out on their hosts
            names.append("relay_shm")
            results.append(await self.parts["relay_shm"].deliver(version, begun["relay_shm"]))
        if "checksum" in begun:
            await self._verify(version, (await asyncio.gather(*begun["checksum"]))[0])
        out = {"time/weight_sync_s": max(r["time/weight_sync_s"] for r in results),
               "weight_sync/bytes": max(r["weight_sync/bytes"] for r in results)}
        for n, r in zip(names, results):
            out[f"time/weight_sync_{n}_s"] = r["time/weight_sync_s"]
        return out

    async def _verify(self, version: int, expected: int) -> None:
        """Every receiver's weights must be bit-identical to the trainer's export (in its dtype)."""
        clients = [c for p in self.parts.values() for c in p.clients]
        reports = await asyncio.gather(*[c.weights_checksum() for c in clients])
        bad = [(c.base_url, r["weight_version"]) for c, r in zip(clients, reports)
               if r["checksum"] != str(expected) or r["weight_version"] != str(version)]
        if bad:
            raise RuntimeError(f"weight sync to version {version}: checksum mismatch on {bad}")

    async def push(self, version: int) -> dict[str, float]:
        return await self.deliver(version, self.begin(version))

    async def aclose(self) -> None:
        await asyncio.gather(*[p.aclose() for p in self.parts.values()])
