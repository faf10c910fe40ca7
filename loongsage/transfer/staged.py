"""The staging-buffer route (SGLang's way of taking weights from the same host or GPU) whole:
trainer rank 0 copies each bucket into a shared buffer it allocated once (/dev/shm on CPU, its GPU
memory on the `cuda_ipc` route) and every receiver loads the bucket by handle through
`/update_weights_from_tensor` (flattened_bucket): only the handle crosses HTTP. Two copies (into
the buffer, out of it); embedded engines on the trainer's host take the one-copy `mapped` route.

`begin` submits one packing call per bucket now, so all are ordered before the trainer's next step;
`deliver` feeds the receivers bucket by bucket as each is packed (loading k overlaps packing k + 1)
and confirms the version. The next version is packed only after this one was confirmed, so a
buffer is never rewritten while a receiver reads it.
"""
from __future__ import annotations

import asyncio
import time
from typing import Literal

from fastapi import APIRouter, Request

from loongsage.api import InferenceClient, WeightSource
from loongsage.transfer.buckets import plan_buckets
from loongsage.transfer.dtypes import dtype_from_name
from loongsage.transfer.receiving import Receiver, apply_update
from loongsage.transfer.tensor_handles import SharedBuckets, deserialize_named_tensors, unflatten_bucket
from loongsage.transfer.transport import BaseTransport
from loongsage.wire import Strict, body_of, error, openapi_body, parse


# ---- engine side ----------------------------------------------------------------------------------
class UpdateFromTensor(Strict):
    serialized_named_tensors: list[str]
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    rid: str | None = None


class StagedReceiver(Receiver):
    def routes(self) -> APIRouter:
        router, host = APIRouter(), self.host

        @router.post("/update_weights_from_tensor", openapi_extra=openapi_body(UpdateFromTensor))
        async def update_from_tensor(request: Request):
            req = parse(UpdateFromTensor, await body_of(request))
            if len(req.serialized_named_tensors) != 1:
                return error(400, f"serialized_named_tensors: expected one entry (tp_size 1), got "
                                  f"{len(req.serialized_named_tensors)}")
            try:
                payload = deserialize_named_tensors(req.serialized_named_tensors[0], host.shm_prefix)
                named = unflatten_bucket(payload) if req.load_format == "flattened_bucket" else payload
            except ValueError as exc:
                return error(400, str(exc))
            return await apply_update(host, lambda: host.load(named), req.weight_version, req.flush_cache,
                                      req.abort_all_requests)
        return router


# ---- trainer side -----------------------------------------------------------------------------------
class StagedSender:
    def __init__(self, source: WeightSource):
        self.source = source
        self._buffers: dict[bool, SharedBuckets] = {}  # on_device -> reused buffers

    def pack(self, k: int, names: list[str], dtype: str | None, receivers: int = 1,
             on_device: bool = False) -> tuple[list[str], float]:
        """Bucket `k`: gathered alone (all ranks), copied by rank 0 into its reused shared buffer;
        one handle per receiver (`load_format="flattened_bucket"`). `on_device`: the buffers live on
        the trainer's GPU and the handles are CUDA IPC handles."""
        (_, sd), = self.source.export([names])
        if self.source.rank != 0:
            return [], 0.0
        if on_device not in self._buffers:
            self._buffers[on_device] = (SharedBuckets(self.source.device) if on_device
                                        else SharedBuckets(prefix=self.source.shm_prefix))
        shared = self._buffers[on_device]
        held = shared.fill_one(k, [(n, sd[n]) for n in names], dtype_from_name(dtype) if dtype else None)
        return shared.handles_of(k, receivers), held

    def release(self) -> None:
        for b in self._buffers.values():
            b.release()


# ---- controller side ----------------------------------------------------------------------------------
class ShmWeightSync(BaseTransport):
    def __init__(self, trainers, clients: list[InferenceClient], engine_dtype: str = "float32",
                 bucket_mb: float = 64.0, on_device: bool = False):
        self.trainers, self.clients, self.on_device, self.dtype = trainers, clients, on_device, engine_dtype
        meta = trainers.weight_meta()
        elem = 2 if engine_dtype in ("bfloat16", "float16") else 4
        self.buckets = plan_buckets(meta, int(bucket_mb * 2**20), elem)
        self.bucket_names = [[meta[i][0] for i in b] for b in self.buckets]

    def begin(self, version: int) -> tuple[list[list], float]:
        """One packing call per bucket and rank, all submitted now (before the next train step)."""
        return ([[r.transfer.remote("staged", "pack", k, names, self.dtype, len(self.clients), self.on_device)
                  for r in self.trainers.ranks] for k, names in enumerate(self.bucket_names)], time.perf_counter())

    async def deliver(self, version: int, begun: tuple[list[list], float]) -> dict[str, float]:
        """Bucket by bucket: the receivers load bucket k while the trainer packs k + 1."""
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
