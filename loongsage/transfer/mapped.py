"""The one-copy route to embedded engines on the trainer's host (`shm`, CPU engines) or GPU
(`cuda_ipc`) whole. Each engine keeps its weights in two shared buffers (`MappedWeights`, handed out
once by `/map_weights`); trainer rank 0 maps them once and writes every version straight into the
standby buffer, casting on the fly, then the engine flips to it between two steps (`/flip_weights`)
and confirms the version. One copy instead of two (into a staging buffer, then out of it); the
standby buffer is the snapshot that lets the next train step overlap the delivery. SGLang engines
have no such routes: they take the staging-buffer route (`staged.py`).
"""
from __future__ import annotations

import asyncio
import time

import torch
from fastapi import APIRouter, Request
from pydantic import Field

from loongsage.api import InferenceClient, WeightHost, WeightSource
from loongsage.transfer.receiving import Receiver, apply_update
from loongsage.transfer.tensor_handles import (
    SHM_PREFIX,
    deserialize_named_tensors,
    flat_layout,
    release_shared,
    serialize_payload,
    shared_buffer,
)
from loongsage.transfer.transport import BaseTransport
from loongsage.wire import Strict, body_of, error, openapi_body, parse


# ---- engine side ----------------------------------------------------------------------------------
class MappedWeights:
    """The parameters become views into the active one of two flat shared buffers (/dev/shm files
    named under the run's prefix, or device memory shared by CUDA IPC handles on a GPU)."""

    def __init__(self, params: dict[str, torch.Tensor], shm_prefix: str = SHM_PREFIX):
        dtypes = {p.dtype for p in params.values()}
        if len(dtypes) != 1:
            raise ValueError(f"mapped weights need one parameter dtype, the model has {sorted(map(str, dtypes))}")
        self.layout = flat_layout(list(params.items()))
        numel = self.layout[-1].end_idx
        dtype = dtypes.pop()
        device = next(iter(params.values())).device  # on a GPU the handles are CUDA IPC handles (cuda_ipc route)
        self.buffers = [shared_buffer(numel, dtype, device, shm_prefix) for _ in range(2)]
        self.active = 0
        with torch.no_grad():
            for m in self.layout:
                self.buffers[0][m.start_idx:m.end_idx].copy_(params[m.name].reshape(-1))
        self._point(params, 0)

    def _point(self, params: dict[str, torch.Tensor], idx: int) -> None:
        buf = self.buffers[idx]
        for m in self.layout:
            params[m.name].data = buf[m.start_idx:m.end_idx].view(m.shape)
        self.active = idx

    def handles(self) -> list[str]:
        """One `flattened_bucket` handle per buffer (pickled once: the trainer maps them once)."""
        return [serialize_payload({"flattened_tensor": b, "metadata": self.layout}) for b in self.buffers]

    def flip(self, params: dict[str, torch.Tensor], standby: int) -> int:
        """Serve the standby buffer (which the sender has just written); returns the tensor count."""
        if standby != 1 - self.active:
            raise ValueError(f"flip to buffer {standby}, but buffer {self.active} is the active one")
        start = self.buffers[self.active].untyped_storage().data_ptr()
        first = params[self.layout[0].name]
        if first.untyped_storage().data_ptr() != start:
            raise RuntimeError("the weights were replaced since they were mapped (memory released?); map them again")
        self._point(params, standby)
        return len(self.layout)

    @property
    def nbytes(self) -> int:
        return self.buffers[0].numel() * self.buffers[0].element_size()

    def release(self) -> None:
        for b in self.buffers:
            release_shared(b)


class FlipWeights(Strict):
    """LoongSage extension: serve the standby mapped buffer the trainer has just written."""
    standby: int = Field(ge=0, le=1)
    weight_version: str | int | None = None
    flush_cache: bool = True


class MappedReceiver(Receiver):
    """The engine's mapped buffers (made on the first `/map_weights`, released at shutdown)."""

    def __init__(self, host: WeightHost):
        super().__init__(host)
        self.mapped: MappedWeights | None = None

    def routes(self) -> APIRouter:
        router, host = APIRouter(), self.host

        @router.post("/map_weights")
        async def map_weights():
            """LoongSage extension: the weights move into two shared buffers (the active one and a
            standby one); returns a handle for each and which one is active."""
            def build():
                if self.mapped is None:
                    self.mapped = MappedWeights(host.parameters(), host.shm_prefix)
                m = self.mapped
                return {"handles": m.handles(), "active": m.active, "bytes": m.nbytes}
            try:
                return await host.run(build)
            except ValueError as exc:
                return error(400, str(exc))

        @router.post("/flip_weights", openapi_extra=openapi_body(FlipWeights))
        async def flip_weights(request: Request):
            """LoongSage extension: serve the standby buffer from the next step on."""
            req = parse(FlipWeights, await body_of(request))
            if self.mapped is None:
                return error(400, "no mapped weights; call /map_weights first")
            return await apply_update(host, lambda: self.mapped.flip(host.parameters(), req.standby),
                                      req.weight_version, req.flush_cache, False)
        return router

    def release(self) -> None:
        if self.mapped is not None:
            self.mapped.release()


# ---- trainer side -----------------------------------------------------------------------------------
class MappedSender:
    def __init__(self, source: WeightSource):
        self.source = source
        self.mapped: dict[str, list[dict]] = {}  # receiver -> its two mapped weight buffers
        self._chunks = source.chunks()  # what a write gathers at a time, every version

    def map(self, handles: dict[str, list[str]]) -> bool:
        """Rank 0 maps each same-host receiver's two weight buffers (`/map_weights`) once."""
        if self.source.rank != 0:
            return True
        exported = {m[0] for m in self.source.meta}
        for name, pair in handles.items():
            self.mapped[name] = [deserialize_named_tensors(h, self.source.shm_prefix) for h in pair]
            missing = sorted({m.name for m in self.mapped[name][0]["metadata"]} - exported)
            if missing:
                raise KeyError(f"receiver {name} maps {missing}, which the trainer does not export")
        return True

    def write(self, targets: dict[str, int]) -> float:
        """Rank 0 writes the exported weights, gathered chunk by chunk, straight into each receiver's
        standby buffer (`targets`: receiver -> buffer index), casting to the receiver's dtype: the only
        copy of a same-host sync. Runs before the next train step, so it is a snapshot of this version."""
        with torch.no_grad():
            for names, sd in self.source.export(self._chunks):
                if self.source.rank != 0:
                    continue
                for name, idx in targets.items():
                    payload = self.mapped[name][idx]
                    flat, where = payload["flattened_tensor"], _slices(payload)
                    for n in names:
                        if n in where:
                            flat[where[n]].copy_(sd[n].reshape(-1))
        written = 0.0
        if self.source.rank == 0:  # per receiver (the transport multiplies by their number)
            written = max((float(f.numel() * f.element_size())
                           for f in (self.mapped[n][i]["flattened_tensor"] for n, i in targets.items())), default=0.0)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the receiver flips right after: the copies must have landed
        return written

    def unmap(self, receivers: list[str], dead: list[str]) -> bool:
        """Lets go of receivers' buffers (a mesh being rebuilt); a dead receiver's /dev/shm files are
        removed (it cannot: it was killed), a live one maps them again."""
        for name in receivers:
            pair = self.mapped.pop(name, None)
            if pair is not None and name in dead:
                for payload in pair:
                    release_shared(payload["flattened_tensor"])
        return True

    def release(self) -> None:
        self.mapped = {}


def _slices(payload: dict) -> dict[str, slice]:
    """Where each tensor sits in a mapped flat buffer (computed once per buffer, kept with it)."""
    if "_slices" not in payload:
        payload["_slices"] = {m.name: slice(m.start_idx, m.end_idx) for m in payload["metadata"]}
    return payload["_slices"]


# ---- controller side ----------------------------------------------------------------------------------
class MappedShmSync(BaseTransport):
    def __init__(self, trainers, clients: list[InferenceClient]):
        self.trainers, self.clients = trainers, clients
        self.bucket_names = [[m[0] for m in trainers.weight_meta()]]
        self.buckets = [list(range(len(self.bucket_names[0])))]  # one write and one flip per version
        self.standby: dict[str, int] = {}

    async def setup(self) -> None:
        infos = await asyncio.gather(*[c.map_weights() for c in self.clients])
        await self.trainers.rank0.transfer.remote("mapped", "map", {c.base_url: i["handles"]
                                                                    for c, i in zip(self.clients, infos)})
        self.standby = {c.base_url: 1 - i["active"] for c, i in zip(self.clients, infos)}

    def begin(self, version: int) -> tuple[list, float, dict[str, int]]:
        targets = dict(self.standby)
        return [r.transfer.remote("mapped", "write", targets) for r in self.trainers.ranks], time.perf_counter(), targets

    async def deliver(self, version: int, begun: tuple[list, float, dict[str, int]]) -> dict[str, float]:
        refs, t0, targets = begun
        written = (await asyncio.gather(*refs))[0]
        await asyncio.gather(*[c.flip_weights(targets[c.base_url], weight_version=version) for c in self.clients])
        self.standby = {url: 1 - idx for url, idx in targets.items()}
        return await self.finish(version, t0, written * len(self.clients))

    async def aclose(self, gone: list[InferenceClient] = ()) -> None:
        await self.trainers.rank0.transfer.remote("mapped", "unmap", [c.base_url for c in self.clients],
                                                  [c.base_url for c in gone])
