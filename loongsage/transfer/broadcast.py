"""The collective route whole: weights from trainer rank 0 to receivers on other hosts over one
gloo (CPU) or NCCL (GPU) group of their own, exactly as SGLang's `/init_weights_update_group` and
`/update_weights_from_distributed` define it. Trainer rank 0 opens the group's store on its own
node's address (`cluster/network.py: Rendezvous`) and is rank 0; the receivers join as 1..N.

Buckets of about `bucket_mb` travel as the bytes of one flat tensor (flattened_bucket: a uint8
tensor, as SGLang's `FlattenedTensorBucket.empty` receives it; `wire_bucket`): rank 0 packs each
bucket (a snapshot) and a sender thread broadcasts it, so bucket k is on the wire while k + 1 is
gathered and packed, and the next train step may start once the last is packed; each receiver takes
the same bucket through its route. The last bucket carries the new version.
"""
from __future__ import annotations

import asyncio
import datetime
import queue
import threading
import time
from typing import Literal

import torch
import torch.distributed as dist
from fastapi import APIRouter, Request
from pydantic import Field

from loongsage.api import InferenceClient, WeightHost, WeightSource
from loongsage.cluster.network import LOOPBACK, Rendezvous, tcp_store
from loongsage.transfer.buckets import plan_buckets
from loongsage.transfer.dtypes import dtype_from_name
from loongsage.transfer.receiving import Receiver, apply_update
from loongsage.transfer.transport import BaseTransport
from loongsage.wire import Strict, body_of, error, openapi_body, parse


def new_weight_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int,
    group_name: str = "weight_update_group", timeout_s: float = 120.0, own_address: str = LOOPBACK,
    rendezvous: Rendezvous | None = None,
) -> dist.ProcessGroup:
    """A stand-alone process group for weight broadcasts, apart from any training group: built
    straight from a TCPStore, it never touches (or needs) the default process group. Rank 0 holds
    `rendezvous` (the store's socket, bound on its node's address); every member's gloo sockets bind
    `own_address`, the address of the node it runs on."""
    if (rank == 0) != (rendezvous is not None):
        raise ValueError("the weight group's rank 0, and only it, holds the rendezvous socket")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(group_name, tcp_store(master_address, master_port, world_size, rendezvous, timeout))
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=own_address)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")


def wire_bucket(tensors: list[torch.Tensor], dtype: torch.dtype | None, device) -> torch.Tensor:
    """One bucket as it goes on the wire: the tensors flattened into one of `dtype` (default: theirs),
    sent as its bytes, which is what SGLang's receiver allocates (uint8, the bucket's byte size)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat.to(device=device, dtype=dtype or flat.dtype).view(torch.uint8)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()


# ---- engine side ----------------------------------------------------------------------------------
class InitGroup(Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"
    rid: str | None = None


class UpdateFromDistributed(Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    load_format: Literal["flattened_bucket"] | None = None
    rid: str | None = None


class DestroyGroup(Strict):
    group_name: str = "weight_update_group"
    rid: str | None = None


class BroadcastReceiver(Receiver):
    def __init__(self, host: WeightHost):
        super().__init__(host)
        self.groups: dict[str, tuple[str, dist.ProcessGroup]] = {}

    def routes(self) -> APIRouter:
        router, host, groups = APIRouter(), self.host, self.groups

        @router.post("/init_weights_update_group", openapi_extra=openapi_body(InitGroup))
        async def init_group(request: Request):
            req = parse(InitGroup, await body_of(request))
            if req.group_name in groups:
                return error(400, f"group_name: a group named {req.group_name!r} already exists")
            try:
                groups[req.group_name] = req.backend, await asyncio.to_thread(
                    new_weight_group, req.backend, req.master_address, req.master_port, req.rank_offset,
                    req.world_size, req.group_name, own_address=host.host)
            except Exception as exc:
                return error(400, f"cannot join weight update group {req.group_name!r}: {exc}")
            return {"success": True, "message": f"joined {req.group_name} as rank {req.rank_offset}"}

        @router.post("/update_weights_from_distributed", openapi_extra=openapi_body(UpdateFromDistributed))
        async def update_from_distributed(request: Request):
            req = parse(UpdateFromDistributed, await body_of(request))
            backend, group = groups.get(req.group_name, (None, None))
            if group is None:
                return error(400, f"group_name: no weight update group {req.group_name!r}; call "
                                  "/init_weights_update_group first")
            if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
                return error(400, "names, dtypes and shapes must have the same length")
            try:
                dtypes = [dtype_from_name(d) for d in req.dtypes]
            except ValueError as exc:
                return error(400, f"dtypes: {exc}")

            def receive() -> int:
                dev = host.device if backend == "nccl" else torch.device("cpu")
                if req.load_format == "flattened_bucket":
                    if len(set(dtypes)) != 1:
                        raise ValueError("flattened_bucket needs one dtype for all tensors")
                    sizes = [int(torch.Size(s).numel()) for s in req.shapes]
                    raw = torch.empty(sum(sizes) * dtypes[0].itemsize, dtype=torch.uint8, device=dev)
                    broadcast(group, raw)  # the bucket's bytes (SGLang's FlattenedTensorBucket.empty does the same)
                    flat = raw.view(dtypes[0])
                    named = [(n, p.view(s)) for n, p, s in zip(req.names, flat.split(sizes), req.shapes)]
                else:
                    named = []
                    for n, d, s in zip(req.names, dtypes, req.shapes):
                        t = torch.empty(s, dtype=d, device=dev)
                        broadcast(group, t)
                        named.append((n, t))
                return host.load(named)

            return await apply_update(host, receive, req.weight_version, req.flush_cache, req.abort_all_requests)

        @router.post("/destroy_weights_update_group", openapi_extra=openapi_body(DestroyGroup))
        async def destroy_group(request: Request):
            req = parse(DestroyGroup, await body_of(request))
            if groups.pop(req.group_name, None) is None:
                return error(400, f"group_name: no weight update group {req.group_name!r}")
            return {"success": True, "message": f"destroyed {req.group_name}"}
        return router

    def release(self) -> None:
        self.groups.clear()


# ---- trainer side -----------------------------------------------------------------------------------
class BroadcastSender:
    def __init__(self, source: WeightSource):
        self.source = source
        self.group: dist.ProcessGroup | None = None
        self._rendezvous: Rendezvous | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def open(self) -> tuple[str, int]:
        """Rank 0: the group's store, on a socket bound to this node's address."""
        self._rendezvous = Rendezvous.open(self.source.address)
        return self._rendezvous.address

    def join(self, world_size: int, group_name: str, backend: str) -> bool:
        if self.source.rank == 0:
            rdv, self._rendezvous = self._rendezvous, None
            if rdv is None:
                raise RuntimeError("join before open")
            self.group = new_weight_group(backend, rdv.host, rdv.port, 0, world_size, group_name,
                                          own_address=self.source.address, rendezvous=rdv)
        return True

    def send(self, buckets: list[list[str]], dtype: str | None) -> float:
        """All ranks gather bucket by bucket; rank 0 packs one flat tensor per bucket and hands it to
        the sender thread at once: the weights of version v travel while v + 1 trains. Receivers
        confirm the version themselves."""
        self._join_thread()
        if self.source.rank == 0 and self.group is None:
            raise RuntimeError("send before join")
        cast = dtype_from_name(dtype) if dtype else None
        packed: queue.Queue = queue.Queue()
        if self.source.rank == 0:
            self._thread = threading.Thread(target=self._send, args=(packed,), name="weight-sender", daemon=True)
            self._thread.start()
        sent = 0.0
        try:
            for names, sd in self.source.export(buckets):
                if self.source.rank == 0:
                    flat = wire_bucket([sd[n] for n in names], cast, self.source.device)  # NCCL: on the GPU
                    packed.put(flat)
                    sent += flat.numel()
        finally:
            packed.put(None)  # the thread stops after the last bucket (or at once, if packing failed)
        return sent

    def _send(self, packed: queue.Queue) -> None:
        try:
            while (flat := packed.get()) is not None:
                broadcast(self.group, flat)
        except BaseException as exc:
            self._error = exc
            while packed.get() is not None:  # let the packer finish its snapshot
                pass

    def _join_thread(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"the previous weight broadcast failed: {exc}") from exc

    def release(self) -> None:
        self._join_thread()
        self.group = None


# ---- controller side ----------------------------------------------------------------------------------
class DistributedWeightSync(BaseTransport):
    def __init__(self, trainers, clients: list[InferenceClient], engine_dtype: str = "float32",
                 bucket_mb: float = 64.0, backend: str = "gloo", group_name: str = "loongsage_weights"):
        self.trainers, self.clients, self.dtype = trainers, clients, engine_dtype
        self.backend, self.group_name = backend, group_name
        self.meta = trainers.weight_meta()
        elem = 2 if engine_dtype in ("bfloat16", "float16") else 4
        self.buckets = plan_buckets(self.meta, int(bucket_mb * 2**20), elem)
        self.bucket_names = [[self.meta[i][0] for i in b] for b in self.buckets]

    async def setup(self) -> None:
        """Trainer rank 0 opens the group's store on its own node's address; the receivers join it."""
        host, port = await self.trainers.rank0.transfer.remote("broadcast", "open")
        world = 1 + len(self.clients)
        await asyncio.gather(
            self.trainers.rank0.transfer.remote("broadcast", "join", world, self.group_name, self.backend),
            *[c.init_weights_update_group(master_address=host, master_port=port, rank_offset=1 + i,
                                          world_size=world, backend=self.backend, group_name=self.group_name)
              for i, c in enumerate(self.clients)])

    def begin(self, version: int) -> tuple[list, float]:
        """Submits the trainer side now, so it is ordered before any later call to the trainer ranks."""
        return ([r.transfer.remote("broadcast", "send", self.bucket_names, self.dtype) for r in self.trainers.ranks],
                time.perf_counter())

    async def deliver(self, version: int, begun: tuple[list, float]) -> dict[str, float]:
        """Feeds every receiver bucket by bucket, then requires each to report `version`."""
        refs, t0 = begun
        sending = asyncio.ensure_future(asyncio.gather(*refs))
        for k, bucket in enumerate(self.buckets):
            last = k == len(self.buckets) - 1
            await asyncio.gather(*[c.update_weights_from_distributed(
                names=self.bucket_names[k], dtypes=[self.dtype] * len(bucket),
                shapes=[self.meta[i][2] for i in bucket], weight_version=version if last else None,
                group_name=self.group_name, flattened=True) for c in self.clients])
        return await self.finish(version, t0, (await sending)[0])

    async def aclose(self, gone: list[InferenceClient] = ()) -> None:
        """The group is left by every live receiver and the trainer (a rebuilt mesh makes a new one)."""
        await asyncio.gather(*[c.destroy_weights_update_group(self.group_name) for c in self.clients if c not in gone],
                             return_exceptions=True)
        await asyncio.gather(*[r.transfer.remote("broadcast", "release") for r in self.trainers.ranks])
