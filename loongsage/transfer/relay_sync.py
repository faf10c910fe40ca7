"""Fan-out on another host: the host's relay receives each version over the collective, then shares
the weights it serves through shared memory with the other receivers on its host (the relay's
`/share_weights`, a LoongSage extension of embedded engines), so one cross-host transfer feeds a
whole host. Runs after the collective part has confirmed the relays; the peers then confirm too.
"""
from __future__ import annotations

import asyncio
import time

from loongsage.rollout.client import EngineClient
from loongsage.transfer.transport import WeightTransport


class RelayShmSync(WeightTransport):
    def __init__(self, peers_of_relay: dict[str, list[str]], bucket_mb: float = 64.0, api_key: str | None = None):
        self.relays = {EngineClient(r, api_key): [EngineClient(p, api_key) for p in peers]
                       for r, peers in peers_of_relay.items()}
        self.clients = [p for peers in self.relays.values() for p in peers]
        self.bucket_mb = bucket_mb
        self.buckets: list[list[int]] = [[]]  # each relay splits by bucket_mb like the sender (same count)

    def begin(self, version: int) -> tuple[list, float]:
        return [], time.perf_counter()  # nothing on the trainer's side

    async def deliver(self, version: int, begun: tuple[list, float]) -> dict[str, float]:
        _, t0 = begun
        sizes = await asyncio.gather(*[self._fan_out(relay, peers, version) for relay, peers in self.relays.items()])
        return await self.finish(version, t0, float(sum(sizes)))

    async def _fan_out(self, relay: EngineClient, peers: list[EngineClient], version: int) -> float:
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

    async def aclose(self) -> None:
        await super().aclose()
        for relay in self.relays:
            await relay.aclose()
