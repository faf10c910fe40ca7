"""Verification, a step of its own after delivery: every `every`-th version, each receiver's exact
weight checksum (`/weights_checksum`, a LoongSage extension of embedded engines) must equal the
trainer's export in the receivers' dtype (`checksum.py`: integer sums, independent of reduction
order), so a route that delivers wrong bits is caught, never trained against. SGLang has no such
route: runs with SGLang engines verify nothing (verify_every 0).
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter

from loongsage.api import InferenceClient, WeightSource
from loongsage.transfer.checksum import checksum_order, checksum_part, finish_checksum, weights_checksum
from loongsage.transfer.dtypes import dtype_from_name
from loongsage.transfer.receiving import Receiver


class ChecksumReceiver(Receiver):
    def routes(self) -> APIRouter:
        router, host = APIRouter(), self.host

        @router.get("/weights_checksum")
        async def checksum():
            """The exact checksum of the served weights, and their version."""
            def compute():
                params = host.parameters()
                return host.weight_version, weights_checksum(params, list(params))
            version, value = await host.run(compute)
            return {"weight_version": str(version), "checksum": str(value)}
        return router


class ChecksumSender:
    def __init__(self, source: WeightSource):
        self.source = source

    def checksum(self, names: list[str], dtype: str | None) -> int | None:
        """The exported weights' checksum in the receivers' dtype (rank 0; a collective on all ranks),
        gathered chunk by chunk."""
        order = checksum_order(names)
        cast = dtype_from_name(dtype) if dtype else None
        total = 0
        for _, sd in self.source.export(self.source.chunks(names)):
            if self.source.rank == 0:
                total += checksum_part(sd, order, cast)
        return finish_checksum(total) if self.source.rank == 0 else None


class ChecksumVerifier:
    def __init__(self, trainers, clients: list[InferenceClient], names: list[str], dtype: str, every: int):
        self.trainers, self.clients, self.names, self.dtype, self.every = trainers, clients, names, dtype, every

    def begin(self, version: int) -> list | None:
        """The trainer's checksum of `version`, submitted with the transfer (before the next step)."""
        if not self.every or version % self.every:
            return None
        return [r.transfer.remote("verify", "checksum", self.names, self.dtype) for r in self.trainers.ranks]

    async def check(self, version: int, begun: list | None) -> None:
        if begun is not None:
            await self.check_against(version, (await asyncio.gather(*begun))[0])

    async def check_against(self, version: int, expected: int) -> None:
        """Every receiver's weights must be bit-identical to `expected` and report `version`."""
        reports = await asyncio.gather(*[c.weights_checksum() for c in self.clients])
        bad = [(c.base_url, r["weight_version"]) for c, r in zip(self.clients, reports)
               if r["checksum"] != str(expected) or r["weight_version"] != str(version)]
        if bad:
            raise RuntimeError(f"weight sync to version {version}: checksum mismatch on {bad}")
