"""Weights from trainer rank 0 to every engine over one collective group (gloo on CPU, NCCL on GPU).

Buckets of about `bucket_mb` are broadcast as single flat tensors while each engine receives the
same bucket through `/update_weights_from_distributed` (flattened_bucket). The last bucket carries
the new version; every engine must then report that version before it serves again.
"""
from __future__ import annotations

import asyncio
import time

from loongsage.rollout.client import EngineClient
from loongsage.trainer.group import TrainerGroup
from loongsage.transfer.buckets import plan_buckets
from loongsage.transfer.transport import WeightTransport


class DistributedWeightSync(WeightTransport):
    def __init__(self, trainers: TrainerGroup, engine_urls: list[str], engine_dtype: str = "float32",
                 bucket_mb: float = 64.0, backend: str = "gloo", group_name: str = "loongsage_weights",
                 api_key: str | None = None):
        self.trainers = trainers
        self.clients = [EngineClient(u, api_key) for u in engine_urls]
        self.dtype = engine_dtype
        self.backend, self.group_name = backend, group_name
        self.meta = trainers.weight_meta()
        elem = 2 if engine_dtype in ("bfloat16", "float16") else 4
        self.buckets = plan_buckets(self.meta, int(bucket_mb * 2**20), elem)
        self.bucket_names = [[self.meta[i][0] for i in b] for b in self.buckets]

    async def setup(self) -> None:
        """Trainer rank 0 opens the group's store on its own node's address; the engines join it."""
        host, port = await self.trainers.rank0.open_rendezvous.remote()
        world = 1 + len(self.clients)
        await asyncio.gather(
            self.trainers.rank0.init_weight_group.remote(world, self.group_name, self.backend),
            *[c.init_weights_update_group(master_address=host, master_port=port, rank_offset=1 + i,
                                          world_size=world, backend=self.backend, group_name=self.group_name)
              for i, c in enumerate(self.clients)])

    def begin(self, version: int) -> tuple[list, float]:
        """Submits the trainer side now, so it is ordered before any later call to the trainer ranks
        (they snapshot the weights, then send them while the next step trains)."""
        return [r.broadcast_weights.remote(self.bucket_names, self.dtype) for r in self.trainers.ranks], time.perf_counter()

    async def deliver(self, version: int, begun: tuple[list, float]) -> dict[str, float]:
        """Feeds every engine bucket by bucket, then requires each to report `version`."""
        refs, t0 = begun
        sending = asyncio.ensure_future(asyncio.gather(*refs))
        for k, bucket in enumerate(self.buckets):
            last = k == len(self.buckets) - 1
            await asyncio.gather(*[c.update_weights_from_distributed(
                names=self.bucket_names[k], dtypes=[self.dtype] * len(bucket),
                shapes=[self.meta[i][2] for i in bucket], weight_version=version if last else None,
                group_name=self.group_name, flattened=True) for c in self.clients])
        return await self.finish(version, t0, (await sending)[0])
