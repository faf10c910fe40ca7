"""Same-host weights in one copy: each embedded engine keeps its weights in two shared buffers
(`/map_weights`, once); trainer rank 0 writes every version straight into the standby buffer of each
engine, casting on the fly, then the engine flips to it between two steps (`/flip_weights`) and
confirms the version. One copy instead of two (into a staging buffer, then out of it); the engine's
standby buffer is the snapshot that lets the next train step overlap the delivery.

SGLang engines have no such routes: they take the two-copy handle path (`shm_sync.py`).
"""
from __future__ import annotations

import asyncio
import time

from loongsage.rollout.client import EngineClient
from loongsage.trainer.group import TrainerGroup
from loongsage.transfer.transport import WeightTransport


class MappedShmSync(WeightTransport):
    def __init__(self, trainers: TrainerGroup, engine_urls: list[str],
                 api_key: str | None = None):
        self.trainers = trainers
        self.clients = [EngineClient(u, api_key) for u in engine_urls]
        self.bucket_names = [[m[0] for m in trainers.weight_meta()]]
        self.buckets = [list(range(len(self.bucket_names[0])))]  # one write and one flip per version
        self.standby: dict[str, int] = {}

    async def setup(self) -> None:
        infos = await asyncio.gather(*[c.map_weights() for c in self.clients])
        await self.trainers.rank0.map_receivers.remote({c.base_url: i["handles"] for c, i in zip(self.clients, infos)})
        self.standby = {c.base_url: 1 - i["active"] for c, i in zip(self.clients, infos)}

    def begin(self, version: int) -> tuple[list, float, dict[str, int]]:
        targets = dict(self.standby)
        return [r.write_mapped.remote(targets) for r in self.trainers.ranks], time.perf_counter(), targets

    async def deliver(self, version: int, begun: tuple[list, float, dict[str, int]]) -> dict[str, float]:
        refs, t0, targets = begun
        written = (await asyncio.gather(*refs))[0]
        await asyncio.gather(*[c.flip_weights(targets[c.base_url], weight_version=version) for c in self.clients])
        self.standby = {url: 1 - idx for url, idx in targets.items()}
        return await self.finish(version, t0, written * len(self.clients))
