"""Weights to same-host engines through shared memory: trainer rank 0 copies each bucket into a
/dev/shm buffer it allocated once, and every engine loads the bucket from the handle through
`/update_weights_from_tensor` (flattened_bucket). Nothing but the handle crosses HTTP.
With `on_device` the buffers live on the trainer's GPU and the handles are CUDA IPC handles: the
`cuda_ipc` route to SGLang engines on the same GPU (SGLang's own colocated path).

Same interface as `DistributedWeightSync` (begin / deliver / push): `begin` submits one packing call
per bucket to the trainer ranks now, so all are ordered before their next train step; `deliver`
feeds the engines bucket by bucket as each is packed (loading k overlaps packing k + 1) and confirms
the version. The next version is packed only after this one was confirmed, so a buffer is
never rewritten while an engine reads it.
"""
from __future__ import annotations

import asyncio
import time

from loongsage.rollout.client import EngineClient
from loongsage.trainer.group import TrainerGroup
from loongsage.transfer.buckets import plan_buckets
from loongsage.transfer.transport import WeightTransport


class ShmWeightSync(WeightTransport):
    def __init__(self, trainers: TrainerGroup, engine_urls: list[str], engine_dtype: str = "float32",
                 bucket_mb: float = 64.0, on_device: bool = False,
                 api_key: str | None = None):
        self.trainers, self.on_device = trainers, on_device
        self.clients = [EngineClient(u, api_key) for u in engine_urls]
        self.dtype = engine_dtype
        meta = trainers.weight_meta()
        elem = 2 if engine_dtype in ("bfloat16", "float16") else 4
        self.buckets = plan_buckets(meta, int(bucket_mb * 2**20), elem)
        self.bucket_names = [[meta[i][0] for i in b] for b in self.buckets]

    def begin(self, version: int) -> tuple[list[list], float]:
        """One packing call per bucket and rank, all submitted now (before the next train step)."""
        return ([[r.pack_shared.remote(k, names, self.dtype, len(self.clients), self.on_device)
                  for r in self.trainers.ranks] for k, names in enumerate(self.bucket_names)], time.perf_counter())

    async def deliver(self, version: int, begun: tuple[list[list], float]) -> dict[str, float]:
        """Bucket by bucket: the engines load bucket k while the trainer packs k + 1."""
        refs, t0 = begun
        sent = 0.0
        for k, per_rank in enumerate(refs):
            handles, held = (await asyncio.gather(*per_rank))[0]
            sent += held
            last = k == len(refs) - 1
            await asyncio.gather(*[c.update_weights_from_tensor(h, weight_version=version if last else None,
                                                                load_format="flattened_bucket")
                                   for c, h in zip(self.clients, handles)])
        return await self.finish(version, t0, sent)
