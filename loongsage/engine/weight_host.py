"""The embedded engine as a `WeightHost`: what the weight routes of `loongsage/transfer/` may do to
it (load tensors or a folder between two steps, read the served weights), and nothing else."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from loongsage.engine.core import EngineCore
from loongsage.engine.security import EngineSecurity


class EngineWeights:
    def __init__(self, core: EngineCore, host: str, security: EngineSecurity):
        self.core, self.host, self.security = core, host, security
        self.shm_prefix = security.shm_prefix

    @property
    def weight_version(self) -> int:
        return self.core.weight_version

    @property
    def device(self) -> torch.device:
        return self.core.runner.device

    def allowed_path(self, path: str) -> str:
        return self.security.weights_path(path, self.core.model_path)

    async def run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.core.call(fn))

    async def update(self, load: Callable[[], int], version: int | None, flush_cache: bool = True,
                     abort_all: bool = False) -> int:
        return await asyncio.wrap_future(self.core.call(self.core.set_weights, load, version, flush_cache, abort_all))

    def parameters(self) -> dict[str, torch.Tensor]:
        return self.core.runner.named_parameters()

    def load(self, named: list[tuple[str, torch.Tensor]]) -> int:
        return self.core.runner.load_weights(named)

    def load_folder(self, path: str) -> int:
        return self.core.runner.load_from_disk(path)
