"""One trainer rank as a Ray actor: joins torch.distributed, holds a backend, serves the controller.

It is also the trainer side of every weight route: it exports the weights bucket by bucket (the
`api.WeightSource` the routes' senders read) and runs their steps (`transfer(route, method, ...)`),
so each route's code stays in its own module under `loongsage/transfer/`.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from loongsage.algo.config import LossConfig
from loongsage.cluster.network import Rendezvous, node_address, tcp_store, use_interface_of
from loongsage.extensions import resolve, use_search_path
from loongsage.heap import freeze_long_lived
from loongsage.trainer.batch import TrainBatch
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.rng import load_rng, save_rng
from loongsage.transfer.buckets import plan_buckets
from loongsage.transfer.devices import physical_device
from loongsage.transfer.senders import SENDERS
from loongsage.transfer.tensor_handles import SHM_PREFIX

EXPORT_CHUNK_MB = 64  # weights gathered at a time for a mapped write, a checksum or a disk export


def backend_class(name: str):
    """`trainer.backend`: fsdp, megatron, or a user's TrainBackend class (module:attr or registered)."""
    if name == "fsdp":
        from loongsage.trainer.fsdp import FSDPBackend

        return FSDPBackend
    if name == "megatron":
        from loongsage.trainer.megatron import MegatronBackend

        return MegatronBackend
    return resolve(name, "trainer_backend")


class TrainerRank:
    """Made in two calls: the actor first (rank 0 then opens the rendezvous on its own node's
    address), then `setup` on every rank with that address."""

    def __init__(self, cfg: TrainerConfig, model_path: str, rank: int, world: int, shm_prefix: str = SHM_PREFIX,
                 extensions: dict | None = None):
        """`extensions`: the controller's `extensions.search_path()`, so user losses, KL estimators and
        backends named in the config import here too."""
        use_search_path(extensions)
        self.cfg = cfg
        self.rank, self.world, self.model_path, self.shm_prefix = rank, world, model_path, shm_prefix
        self.address = node_address()
        self._rendezvous: Rendezvous | None = None
        self._senders: dict = {}

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address of the training group's store."""
        self._rendezvous = Rendezvous.open(self.address)
        return self._rendezvous.address

    def setup(self, master_addr: str, master_port: int) -> int:
        use_interface_of(self.address)
        if self.cfg.cpu_affinity and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cfg.cpu_affinity)
        torch.set_num_threads(self.cfg.threads)
        backend = "nccl" if self.cfg.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = datetime.timedelta(minutes=10)
        store = tcp_store(master_addr, master_port, self.world, self._rendezvous, timeout)
        self._rendezvous = None
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        self.backend = backend_class(self.cfg.backend)(self.cfg, self.model_path)
        self.meta = self.backend.weight_meta()  # the exported tensors: fixed for the rank's life
        freeze_long_lived()  # torch, the model, the optimizer: out of the cyclic GC's full passes (heap.py)
        return self.backend.version

    def where(self) -> tuple[str, str]:
        """(host id, device) for the TransferMesh planner."""
        import ray

        device = str(self.backend.device)
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        return ray.get_runtime_context().get_node_id(), physical_device(device)

    def placement_group(self) -> str | None:
        """The id of the placement group Ray placed this rank in."""
        from loongsage.cluster.placement import placement_group_of_this_actor

        return placement_group_of_this_actor()

    def compute_logprobs(self, batch: TrainBatch, with_entropy: bool = False):
        return self.backend.compute_logprobs(batch, with_entropy)

    def train_step(self, batch: TrainBatch, loss: str, loss_cfg: LossConfig | None, denominator: float,
                   last: bool = True) -> dict:
        return self.backend.train_step(batch, loss, loss_cfg, denominator, last)

    def skip_step(self) -> dict:
        return self.backend.skip_step()

    def full_state_dict(self, names: list[str] | None = None):
        return self.backend.full_state_dict(names)

    def weight_meta(self) -> list:
        return list(self.meta)

    # ---- the weight source of every route's sender (api.WeightSource) -------------------------
    @property
    def device(self) -> torch.device:
        return self.backend.device

    def export(self, buckets: list[list[str]]):
        """(names, full tensors on rank 0 / None elsewhere) per bucket, each gathered alone: an export
        never holds more than one bucket beside the sharded model. A collective: every rank must
        consume it to the end with the same buckets."""
        for names in buckets:
            yield names, self.backend.full_state_dict(names)

    def chunks(self, names: list[str] | None = None) -> list[list[str]]:
        """`names` (default: every exported tensor) in buckets of about EXPORT_CHUNK_MB, in order."""
        meta = self.meta
        if names is not None:
            keep = set(names)
            meta = [m for m in meta if m[0] in keep]
        return [[meta[i][0] for i in b] for b in plan_buckets(meta, EXPORT_CHUNK_MB * 2**20, 4)]

    def transfer(self, route: str, method: str, *args):
        """Runs a step of a weight route's trainer side (transfer/<route>.py), on every rank."""
        if route not in self._senders:
            self._senders[route] = SENDERS[route](self)
        return getattr(self._senders[route], method)(*args)

    # ---- checkpoints and shutdown -------------------------------------------------------------
    def save(self, path: str) -> None:
        self.backend.save(path)
        save_rng(path, self.rank)

    def load(self, path: str) -> None:
        self.backend.load(path)
        load_rng(path, self.rank)

    def version(self) -> int:
        return self.backend.version

    def offload_optimizer(self) -> int:
        """Optimizer state to host memory (colocated placement: the engine generates on this
        device now); returns the bytes moved (0 on a CPU device, or a backend without one)."""
        from loongsage.trainer.offload import move_optimizer_state

        if self.backend.device.type == "cpu" or not hasattr(self.backend, "optimizer"):
            return 0
        moved = move_optimizer_state(self.backend.optimizer, "cpu")
        torch.cuda.empty_cache()
        return moved

    def reload_optimizer(self) -> int:
        """The optimizer state back on the rank's device, before it trains."""
        from loongsage.trainer.offload import move_optimizer_state

        if self.backend.device.type == "cpu" or not hasattr(self.backend, "optimizer"):
            return 0
        return move_optimizer_state(self.backend.optimizer, self.backend.device)

    def shutdown(self) -> None:
        for sender in self._senders.values():
            release = getattr(sender, "release", None)
            if release is not None:
                release()
        self._senders = {}
        if dist.is_initialized():
            dist.destroy_process_group()
