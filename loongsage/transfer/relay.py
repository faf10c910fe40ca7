"""The relay fan-out whole: another host's relay engine receives each version over the collective,
then shares the weights it serves through reused shared-memory buckets with the other receivers on
its host (`/share_weights`, a LoongSage extension of embedded engines; the peers load them through
the staging-buffer route), so one cross-host transfer feeds a whole host. Runs after the collective
part has confirmed the relays; the peers then confirm too. No trainer side.
"""
from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from pydantic import Field

from loongsage.api import InferenceClient, WeightHost
from loongsage.transfer.buckets import plan_buckets
from loongsage.transfer.receiving import Receiver
from loongsage.transfer.tensor_handles import SharedBuckets
from loongsage.transfer.transport import BaseTransport
from loongsage.wire import Strict, body_of, openapi_body, parse


# ---- engine side ----------------------------------------------------------------------------------
class ShareWeights(Strict):
    """LoongSage extension: a relay engine shares the weights it serves with same-host peers."""
    receivers: int = Field(ge=1, le=1024)
    bucket_mb: float = Field(64.0, gt=0, le=65536)


class RelayReceiver(Receiver):
    def __init__(self, host: WeightHost):
        super().__init__(host)
        self.shared = SharedBuckets(prefix=host.shm_prefix)

    def routes(self) -> APIRouter:
        router, host = APIRouter(), self.host

        @router.post("/share_weights", openapi_extra=openapi_body(ShareWeights))
        async def share_weights(request: Request):
            """Copies the served weights into reused shared-memory buckets; returns, per bucket, one
            `flattened_bucket` handle per same-host receiver."""
            req = parse(ShareWeights, await body_of(request))

            def pack():
                params = list(host.parameters().items())
                meta = [(n, str(t.dtype), list(t.shape)) for n, t in params]
                buckets = plan_buckets(meta, int(req.bucket_mb * 2**20), params[0][1].element_size())
                held = self.shared.fill([[params[i] for i in b] for b in buckets])
                return host.weight_version, self.shared.handles(req.receivers), held
            version, handles, held = await host.run(pack)
            return {"weight_version": str(version), "handles": handles, "bytes": held}
        return router

    def release(self) -> None:
        self.shared.release()


# ---- controller side ----------------------------------------------------------------------------------
class RelayShmSync(BaseTransport):
    def __init__(self, peers_of_relay: dict[InferenceClient, list[InferenceClient]], bucket_mb: float = 64.0):
        self.relays = peers_of_relay
        self.clients = [p for peers in self.relays.values() for p in peers]
        self.bucket_mb = bucket_mb
        self.buckets: list[list[int]] = [[]]  # each relay splits by bucket_mb like the sender (same count)

    def begin(self, version: int) -> tuple[list, float]:
        return [], time.perf_counter()  # nothing on the trainer's side

    async def deliver(self, version: int, begun: tuple[list, float]) -> dict[str, float]:
        _, t0 = begun
        sizes = await asyncio.gather(*[self._fan_out(relay, peers, version) for relay, peers in self.relays.items()])
        return await self.finish(version, t0, float(sum(sizes)))

    async def _fan_out(self, relay: InferenceClient, peers: list[InferenceClient], version: int) -> float:
        shared = await relay.share_weights(len(peers), self.bucket_mb)
        if shared["weight_version"] != str(version):
            raise RuntimeError(f"relay {relay.base_url} serves version {shared['weight_version']}, expected {version}")
        handles = shared["handles"]
        for k, per_peer in enumerate(handles):
            last = k == len(handles) - 1
            await asyncio.gather(*[p.update_weights_from_tensor(h, weight_version=version if last else None,
                                                                load_format="flattened_bucket")
                                   for p, h in zip(peers, per_peer)])
        return float(shared["bytes"])
