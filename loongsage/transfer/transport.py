"""What every controller-side route shares (the contract is `api.WeightTransport`).

`begin(version)` submits the trainer side at once, so it is ordered before the trainer's next step
(ranks snapshot the weights); `deliver(version, begun)` feeds the receivers and ends with `finish`,
which requires every receiver to report the new version (a mismatch is an error, never served).
Receivers' clients belong to the mesh, which closes them.
"""
from __future__ import annotations

import asyncio
import time

from loongsage.api import InferenceClient


async def confirm_version(clients: list[InferenceClient], version: int) -> None:
    """Every receiver must report `version` before it serves again; a mismatch is an error."""
    infos = await asyncio.gather(*[c.model_info() for c in clients])
    bad = [(c.base_url, i["weight_version"]) for c, i in zip(clients, infos) if str(i["weight_version"]) != str(version)]
    if bad:
        raise RuntimeError(f"weight sync to version {version} not confirmed by {bad}")


class BaseTransport:
    clients: list[InferenceClient]
    buckets: list[list[int]]

    async def setup(self) -> None:
        return None

    def begin(self, version: int):
        raise NotImplementedError

    async def deliver(self, version: int, begun) -> dict[str, float]:
        raise NotImplementedError

    async def finish(self, version: int, t0: float, sent: float) -> dict[str, float]:
        await confirm_version(self.clients, version)
        return {"time/weight_sync_s": time.perf_counter() - t0, "weight_sync/bytes": sent}

    async def push(self, version: int) -> dict[str, float]:
        return await self.deliver(version, self.begin(version))

    async def aclose(self, gone: list[InferenceClient] = ()) -> None:
        """Release what setup made; `gone`: receivers that died (what they shared is removed too)."""
        return None
