"""The trainer group: N `TrainerRank` Ray actors driven together by the controller."""
from __future__ import annotations

import asyncio

import ray
import torch

from loongsage.algo.config import LossConfig
from loongsage.cluster.actors import stop_actors
from loongsage.extensions import search_path
from loongsage.trainer.batch import TrainBatch
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.step import combine_metrics
from loongsage.trainer.worker import TrainerRank
from loongsage.transfer.shm_names import SHM_PREFIX


class TrainerGroup:
    def __init__(self, cfg: TrainerConfig, model_path: str, shm_prefix: str = SHM_PREFIX, placement=None,
                 role: str = "trainer"):
        """`shm_prefix`: the run's prefix for the shared-memory buffers its ranks hand to engines;
        `placement`: the run's RunPlacement (rank r is its member `{role}-{r}`), or None: each rank
        requests its own resources."""
        self.cfg = cfg
        self.stepping = asyncio.Lock()  # held for a whole run step (all its optimizer steps)
        world = cfg.world_size
        actor = ray.remote(TrainerRank)
        own = {"num_cpus": 0, "num_gpus": cfg.gpus_per_rank if cfg.device.startswith("cuda") else 0,
               "resources": dict(cfg.resources)}
        self.ranks = [actor.options(**(placement.options(f"{role}-{r}") if placement else own)).remote(
            cfg, str(model_path), r, world, shm_prefix, search_path()) for r in range(world)]
        try:
            master = ray.get(self.ranks[0].open_rendezvous.remote())  # on rank 0's node, by rank 0
            ray.get([r.setup.remote(*master) for r in self.ranks])
        except BaseException:
            self.shutdown()
            raise

    @property
    def rank0(self):
        return self.ranks[0]

    def _rank_shards(self, batch: TrainBatch) -> list[TrainBatch]:
        """One shard per data-parallel replica, given to all its tensor-parallel ranks and pipeline
        stages (Megatron's layout: tensor-parallel fastest, then data, then pipeline)."""
        tp, dp = self.cfg.tensor_parallel_size, self.cfg.data_parallel_size
        shards = batch.shards(dp)
        return [shards[(r // tp) % dp] for r in range(len(self.ranks))]

    def _replica_leads(self, per_rank: list) -> list:
        """Per replica, the results of its first rank in the last pipeline stage (where logprobs and
        losses are computed; its tensor-parallel peers return the same)."""
        tp, dp = self.cfg.tensor_parallel_size, self.cfg.data_parallel_size
        last = len(self.ranks) - tp * dp
        return [per_rank[last + tp * d] for d in range(dp)]

    async def compute_logprobs(self, batch: TrainBatch, with_entropy: bool = False):
        outs = await asyncio.gather(*[r.compute_logprobs.remote(s, with_entropy)
                                      for r, s in zip(self.ranks, self._rank_shards(batch))])
        outs = self._replica_leads(outs)
        lp = torch.cat([o[0] for o in outs])[: batch.size]
        ent = torch.cat([o[1] for o in outs])[: batch.size] if with_entropy else None
        return lp, ent

    async def train_step(self, batch: TrainBatch, loss: str, loss_cfg: LossConfig | None, last: bool = True
                         ) -> dict[str, float]:
        denominator = batch.num_tokens if (loss_cfg is None or loss_cfg.aggregation == "token_mean") else batch.num_sequences
        per_rank = await asyncio.gather(*[r.train_step.remote(s, loss, loss_cfg, max(denominator, 1.0), last)
                                          for r, s in zip(self.ranks, self._rank_shards(batch))])
        return combine_metrics(self._replica_leads(per_rank))

    async def train_steps(self, batch: TrainBatch, loss_cfg: LossConfig, mini_batches: int = 1, epochs: int = 1
                          ) -> dict[str, float]:
        """A run step's update: `epochs` passes over the batch, each in `mini_batches` optimizer steps
        over equal slices of its rows (the proximal logprobs must already be in the batch when there
        are several). Metrics: averages over the optimizer steps (sums and maxima where they add up)."""
        slices = [idx.tolist() for idx in torch.arange(batch.size).chunk(min(mini_batches, batch.size))]
        plan = [s for _ in range(epochs) for s in slices]
        async with self.stepping:
            if len(plan) == 1:
                return await self.train_step(batch, "policy", loss_cfg)
            results = []
            for i, rows in enumerate(plan):
                results.append(await self.train_step(batch.select(rows), "policy", loss_cfg, last=i == len(plan) - 1))
        out = combine_metrics(results, additive_divisor=epochs)
        out["train/optimizer_steps"] = float(len(plan))
        out["loss/clip_frac_first"], out["loss/clip_frac_last"] = (results[0].get("loss/clip_frac", 0.0),
                                                                   results[-1].get("loss/clip_frac", 0.0))
        return out

    async def skip_step(self) -> dict[str, float]:
        """Every rank's version and schedule advance without an update (a step with nothing to train)."""
        async with self.stepping:
            return (await asyncio.gather(*[r.skip_step.remote() for r in self.ranks]))[0]

    def full_state_dict_on_rank0(self) -> dict[str, torch.Tensor]:
        """The full HF-named weights (a collective over all ranks; rank 0's result)."""
        return ray.get([r.full_state_dict.remote() for r in self.ranks])[0]

    def weight_meta(self) -> list[tuple[str, str, list[int]]]:
        return ray.get(self.rank0.weight_meta.remote())

    async def save(self, path: str) -> None:
        await asyncio.gather(*[r.save.remote(path) for r in self.ranks])

    async def load(self, path: str) -> None:
        await asyncio.gather(*[r.load.remote(path) for r in self.ranks])

    async def offload_optimizer(self) -> int:
        """Every rank's optimizer state to host memory; the bytes moved, summed."""
        return sum(await asyncio.gather(*[r.offload_optimizer.remote() for r in self.ranks]))

    async def reload_optimizer(self) -> int:
        return sum(await asyncio.gather(*[r.reload_optimizer.remote() for r in self.ranks]))

    async def version(self) -> int:
        return await self.rank0.version.remote()

    def shutdown(self) -> None:
        stop_actors(self.ranks, "shutdown", timeout_s=10.0)
