"""The actors one run drives: trainer group, engine group, router and weight sync, started and
stopped together (so SFT, bootstrap and RL share one way of bringing a run up and down)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray

from loongsage.cluster.config import RayConfig
from loongsage.cluster.ray_setup import init_ray
from loongsage.engine.config import EngineConfig
from loongsage.heap import freeze_long_lived
from loongsage.rollout.config import RolloutConfig
from loongsage.rollout.engine_group import EngineGroup
from loongsage.rollout.router import Router
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.group import TrainerGroup
from loongsage.transfer.config import TransferConfig
from loongsage.transfer.mesh import WeightMesh, discover
from loongsage.transfer.topology import plan


@dataclass
class Runtime:
    trainers: TrainerGroup
    engines: EngineGroup
    router: Router
    sync: WeightMesh
    ray_started: bool
    reference: TrainerGroup | None = None  # frozen initial policy, for a KL penalty


    @classmethod
    async def start(cls, model_dir: str, trainer: TrainerConfig, engine: EngineConfig, rollout: RolloutConfig,
                    ray_cfg: RayConfig, with_reference: bool = False,
                    transfer: TransferConfig | None = None) -> "Runtime":
        started = init_ray(ray_cfg)
        trainers = engines = reference = None
        try:
            # Trainer ranks, engines (and the reference) start in parallel: each spends seconds
            # importing torch and loading weights in its own process.
            parts = await asyncio.gather(
                asyncio.to_thread(TrainerGroup, trainer, model_dir),
                asyncio.to_thread(EngineGroup, model_dir, engine, rollout),
                *([asyncio.to_thread(TrainerGroup, trainer, model_dir)] if with_reference else []),
                return_exceptions=True)
            trainers, engines = (p if not isinstance(p, BaseException) else None for p in parts[:2])
            reference = parts[2] if with_reference and not isinstance(parts[2], BaseException) else None
            failed = [p for p in parts if isinstance(p, BaseException)]
            if failed:
                raise failed[0]
            transfer = transfer or TransferConfig()
            routes = plan(*discover(trainers, engines.actors, transfer))
            sync = WeightMesh(routes, trainers, {f"engine-{i}": u for i, u in enumerate(engines.urls)},
                              engine.dtype, rollout.weight_bucket_mb,
                              "nccl" if trainer.device.startswith("cuda") else "gloo",
                              transfer.verify_every if rollout.engine == "embedded" else 0,  # SGLang: no checksum route
                              transfer.disk_dir, extensions=rollout.engine == "embedded")
            await sync.setup()
            freeze_long_lived()  # the controller's imports and clients: out of the cyclic GC's full passes (heap.py)
        except BaseException:
            for group in (engines, trainers, reference):
                if group is not None:
                    group.shutdown()
            if started:
                ray.shutdown()
            raise
        return cls(trainers, engines, Router(engines.urls), sync, started, reference)

    async def close(self) -> None:
        await self.router.aclose()
        await self.sync.aclose()
        self.engines.shutdown()
        self.trainers.shutdown()
        if self.reference is not None:
            self.reference.shutdown()
        if self.ray_started:
            ray.shutdown()
