"""The universal fallback: trainer rank 0 writes each version as an HF folder (safetensors in the
receivers' dtype, plus config and tokenizer files) and every receiver loads it through
`/update_weights_from_disk`, which SGLang and the embedded engine both serve. The folder must be
visible to the receivers (the same machine, or a shared file system); the previous version's folder
is removed once every receiver has confirmed the new one.
"""
from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

from loongsage.rollout.client import EngineClient
from loongsage.trainer.group import TrainerGroup
from loongsage.transfer.transport import WeightTransport


class DiskWeightSync(WeightTransport):
    def __init__(self, trainers: TrainerGroup, engine_urls: list[str], engine_dtype: str, folder: str,
                 api_key: str | None = None):
        """`folder`: one the receivers may load from (their `--weight-roots`; the runtime chooses it)."""
        self.trainers = trainers
        self.clients = [EngineClient(u, api_key) for u in engine_urls]
        self.dtype = engine_dtype
        self.names = [m[0] for m in trainers.weight_meta()]
        self.buckets = [list(range(len(self.names)))]  # one file per version
        self.bucket_names = [self.names]
        self.root = Path(folder)
        self.root.mkdir(parents=True, exist_ok=True)
        self._previous: Path | None = None

    def begin(self, version: int) -> tuple[list, float]:
        path = str(self.root / f"v{version}")
        return [r.write_weights.remote(path, self.names, self.dtype) for r in self.trainers.ranks], time.perf_counter()

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
