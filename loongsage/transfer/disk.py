"""The disk route, the universal fallback, whole: trainer rank 0 writes each version as an HF folder
(safetensors in the receivers' dtype, plus config and tokenizer files) into a folder the receivers
may read, and every receiver loads it through `/update_weights_from_disk`, which SGLang and the
embedded engine both serve. The folder must be visible to the receivers (the same machine, or a
shared file system); the previous version's folder is removed once every receiver confirmed the new.

    trainer rank (DiskSender.write)  ──files──►  engine route (/update_weights_from_disk)
            ▲ begin                                   ▲ deliver, then finish: version confirmed
            └──────────── controller (DiskWeightSync) ┘
"""
from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

from fastapi import APIRouter, Request

from loongsage.api import InferenceClient, WeightSource
from loongsage.models.hf_folder import write_hf_folder
from loongsage.transfer.dtypes import dtype_from_name
from loongsage.transfer.receiving import Receiver, apply_update
from loongsage.transfer.transport import BaseTransport
from loongsage.wire import Strict, body_of, error, openapi_body, parse


# ---- engine side ----------------------------------------------------------------------------------
class UpdateFromDisk(Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    flush_cache: bool = True
    rid: str | None = None


class DiskReceiver(Receiver):
    def routes(self) -> APIRouter:
        router, host = APIRouter(), self.host

        @router.post("/update_weights_from_disk", openapi_extra=openapi_body(UpdateFromDisk))
        async def update_from_disk(request: Request):
            req = parse(UpdateFromDisk, await body_of(request))
            try:
                path = host.allowed_path(req.model_path)
            except ValueError as exc:
                return error(403, str(exc))
            res = await apply_update(host, lambda: host.load_folder(path), req.weight_version, req.flush_cache,
                                     req.abort_all_requests)
            if isinstance(res, dict):
                res["num_paused_requests"] = 0
            return res
        return router


# ---- trainer side -----------------------------------------------------------------------------------
class DiskSender:
    def __init__(self, source: WeightSource):
        self.source = source

    def write(self, path: str, names: list[str], dtype: str | None) -> float:
        """All ranks gather chunk by chunk; rank 0 writes the HF folder; returns the bytes written."""
        cast = dtype_from_name(dtype) if dtype else None
        weights = {}
        for chunk, sd in self.source.export(self.source.chunks(names)):
            if self.source.rank == 0:
                weights.update({n: sd[n].to(dtype=cast or sd[n].dtype, device="cpu", copy=True) for n in chunk})
        if self.source.rank != 0:
            return 0.0
        write_hf_folder(Path(path), weights, self.source.model_path, None)
        return float(sum(t.numel() * t.element_size() for t in weights.values()))


# ---- controller side ----------------------------------------------------------------------------------
class DiskWeightSync(BaseTransport):
    def __init__(self, trainers, clients: list[InferenceClient], engine_dtype: str, folder: str):
        """`folder`: one the receivers may load from (their `--weight-roots`; the runtime chooses it)."""
        self.trainers, self.clients, self.dtype = trainers, clients, engine_dtype
        self.names = [m[0] for m in trainers.weight_meta()]
        self.buckets = [list(range(len(self.names)))]  # one folder per version
        self.bucket_names = [self.names]
        self.root = Path(folder)
        self.root.mkdir(parents=True, exist_ok=True)
        self._previous: Path | None = None

    def begin(self, version: int) -> tuple[list, float]:
        path = str(self.root / f"v{version}")
        return ([r.transfer.remote("disk", "write", path, self.names, self.dtype) for r in self.trainers.ranks],
                time.perf_counter())

    async def deliver(self, version: int, begun: tuple[list, float]) -> dict[str, float]:
        refs, t0 = begun
        sent = (await asyncio.gather(*refs))[0]
        path = self.root / f"v{version}"
        await asyncio.gather(*[c.update_weights_from_disk(str(path), weight_version=version) for c in self.clients])
        out = await self.finish(version, t0, sent)
        if self._previous is not None and self._previous != path:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path
        return out
