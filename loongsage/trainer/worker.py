"""One trainer rank as a Ray actor: joins torch.distributed, holds a backend, serves the controller.

Rank 0 also joins the weight-update group with the engines and broadcasts weights there.
"""
from __future__ import annotations

import datetime
import os
import queue
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from loongsage.algo.losses import LossConfig
from loongsage.cluster.network import Rendezvous, node_address, tcp_store, use_interface_of
from loongsage.trainer.batch import TrainBatch
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.step import write_hf_folder
from loongsage.heap import freeze_long_lived
from loongsage.transfer.buckets import plan_buckets
from loongsage.transfer.checksum import checksum_order, checksum_part, finish_checksum
from loongsage.transfer.collective import broadcast, dtype_from_name, new_weight_group
from loongsage.transfer.devices import physical_device
from loongsage.transfer.tensor_handles import SHM_PREFIX, SharedBuckets, deserialize_named_tensors

EXPORT_CHUNK_MB = 64  # weights gathered at a time for a mapped write, a checksum or a disk export


class TrainerRank:
    """Made in two calls: the actor first (rank 0 then opens the rendezvous on its own node's
    address), then `setup` on every rank with that address."""

    def __init__(self, cfg: dict, model_path: str, rank: int, world: int, shm_prefix: str = SHM_PREFIX):
        self.cfg = TrainerConfig.model_validate(cfg)
        self.rank, self.world, self.model_path, self.shm_prefix = rank, world, model_path, shm_prefix
        self.address = node_address()
        self._rendezvous: Rendezvous | None = None

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address of the training group's store (and, later, of the weight group's)."""
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
        if self.cfg.backend == "fsdp":
            from loongsage.trainer.fsdp import FSDPBackend

            self.backend = FSDPBackend(self.cfg, self.model_path)
        elif self.cfg.backend == "megatron":
            from loongsage.trainer.megatron import MegatronBackend

            self.backend = MegatronBackend(self.cfg, self.model_path)
        else:  # validated by the config schema
            raise ValueError(f"trainer.backend: unknown {self.cfg.backend!r}")
        self.weight_group = None
        self._sender: threading.Thread | None = None
        self._send_error: BaseException | None = None
        self._shm = SharedBuckets(prefix=self.shm_prefix)  # /dev/shm staging buffers (shm route, SGLang receivers)
        self._on_device = SharedBuckets(self.backend.device)  # cuda_ipc route, SGLang receivers
        self._mapped: dict[str, list[dict]] = {}  # receiver -> its two mapped weight buffers
        self._meta = self.backend.weight_meta()  # the exported tensors: fixed for the rank's life
        self._all_chunks = self._chunks()  # what a mapped write gathers at a time, every version
        freeze_long_lived()  # torch, the model, the optimizer: out of the cyclic GC's full passes (heap.py)
        return self.backend.version

    def where(self) -> tuple[str, str]:
        """(host id, device) for the TransferMesh planner."""
        import ray

        device = str(self.backend.device)
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        return ray.get_runtime_context().get_node_id(), physical_device(device)

    def compute_logprobs(self, batch: TrainBatch, with_entropy: bool = False):
        return self.backend.compute_logprobs(batch, with_entropy)

    def train_step(self, batch: TrainBatch, loss: str, loss_cfg: dict | None, denominator: float) -> dict:
        cfg = None if loss_cfg is None else LossConfig.model_validate(loss_cfg)
        return self.backend.train_step(batch, loss, cfg, denominator)

    def full_state_dict(self, names: list[str] | None = None):
        return self.backend.full_state_dict(names)

    def weight_meta(self) -> list:
        return list(self._meta)

    def init_weight_group(self, world_size: int, group_name: str, backend: str) -> bool:
        """Rank 0 joins the weight group as its master, on the rendezvous it opened for it."""
        if self.rank == 0:
            rdv = self._rendezvous
            if rdv is None:
                raise RuntimeError("init_weight_group before open_rendezvous")
            self._rendezvous = None
            self.weight_group = new_weight_group(backend, rdv.host, rdv.port, 0, world_size, group_name,
                                                 own_address=self.address, rendezvous=rdv)
        return True

    def destroy_weight_group(self) -> None:
        self._join_sender()
        self.weight_group = None

    def _export(self, buckets: list[list[str]]):
        """(names, full tensors on rank 0 / None elsewhere) per bucket, each gathered alone: an export
        never holds more than one bucket beside the sharded model. A collective: every rank must
        consume it to the end with the same buckets."""
        for names in buckets:
            yield names, self.backend.full_state_dict(names)

    def _chunks(self, names: list[str] | None = None) -> list[list[str]]:
        """`names` (default: every exported tensor) in buckets of about EXPORT_CHUNK_MB, in order."""
        meta = self._meta
        if names is not None:
            keep = set(names)
            meta = [m for m in meta if m[0] in keep]
        return [[meta[i][0] for i in b] for b in plan_buckets(meta, EXPORT_CHUNK_MB * 2**20, 4)]

    def broadcast_weights(self, buckets: list[list[str]], dtype: str | None) -> float:
        """Gathers the weights bucket by bucket (all ranks); rank 0 packs one flat tensor per bucket (a
        snapshot) and hands each to a sender thread as soon as it is packed, so bucket k is on the wire
        while k + 1 is gathered and packed, and the next train step may start once the last is packed:
        the weights of version v travel while v+1 trains. Receivers confirm the version themselves."""
        self._join_sender()
        if self.rank == 0 and self.weight_group is None:
            raise RuntimeError("broadcast_weights before init_weight_group")
        cast = dtype_from_name(dtype) if dtype else None
        packed: queue.Queue = queue.Queue()
        if self.rank == 0:
            self._sender = threading.Thread(target=self._send, args=(packed,), name="weight-sender", daemon=True)
            self._sender.start()
        sent = 0.0
        try:
            for names, sd in self._export(buckets):
                if self.rank == 0:
                    flat = torch.cat([sd[n].reshape(-1) for n in names])
                    flat = flat.to(device=self.backend.device, dtype=cast or flat.dtype)  # NCCL: on the GPU
                    packed.put(flat)
                    sent += flat.numel() * flat.element_size()
        finally:
            packed.put(None)  # the sender stops after the last bucket (or at once, if packing failed)
        return sent

    def weights_checksum(self, names: list[str], dtype: str | None) -> int | None:
        """The exported weights' checksum in the receivers' dtype (rank 0; a collective on all ranks),
        gathered chunk by chunk."""
        order = checksum_order(names)
        cast = dtype_from_name(dtype) if dtype else None
        total = 0
        for _, sd in self._export(self._chunks(names)):
            if self.rank == 0:
                total += checksum_part(sd, order, cast)
        return finish_checksum(total) if self.rank == 0 else None

    def pack_shared(self, k: int, names: list[str], dtype: str | None, receivers: int = 1,
                    on_device: bool = False) -> tuple[list[str], float]:
        """Bucket `k` of a staging-buffer sync: gathered alone (all ranks), copied by rank 0 into its
        reused shared buffer; returns one handle per receiver (`load_format="flattened_bucket"`): only
        the handle crosses HTTP. One call per bucket, all submitted before the next train step, so the
        receivers load bucket k while rank 0 packs k + 1. `on_device`: the buffers live on the trainer's
        GPU and the handles are CUDA IPC handles."""
        (_, sd), = self._export([names])
        if self.rank != 0:
            return [], 0.0
        shared = self._on_device if on_device else self._shm
        held = shared.fill_one(k, [(n, sd[n]) for n in names], dtype_from_name(dtype) if dtype else None)
        return shared.handles_of(k, receivers), held

    def map_receivers(self, handles: dict[str, list[str]]) -> bool:
        """Rank 0 maps each same-host receiver's two weight buffers (`/map_weights`) once."""
        if self.rank != 0:
            return True
        exported = {m[0] for m in self._meta}
        for name, pair in handles.items():  # shm and cuda_ipc receivers are mapped by their own transports
            self._mapped[name] = [deserialize_named_tensors(h, self.shm_prefix) for h in pair]
            missing = sorted({m["name"] for m in self._mapped[name][0]["metadata"]} - exported)
            if missing:
                raise KeyError(f"receiver {name} maps {missing}, which the trainer does not export")
        return True

    def write_mapped(self, targets: dict[str, int]) -> float:
        """Rank 0 writes the exported weights, gathered chunk by chunk, straight into each receiver's
        standby buffer (`targets`: receiver -> buffer index), casting to the receiver's dtype: the only
        copy of a same-host sync. Runs before the next train step, so it is a snapshot of this version."""
        written = 0.0
        with torch.no_grad():
            for names, sd in self._export(self._all_chunks):
                if self.rank != 0:
                    continue
                for name, idx in targets.items():
                    payload = self._mapped[name][idx]
                    flat, where = payload["flattened_tensor"], _slices(payload)
                    for n in names:
                        if n in where:
                            flat[where[n]].copy_(sd[n].reshape(-1))
        if self.rank == 0:  # per receiver (the transport multiplies by their number)
            written = max((float(f.numel() * f.element_size())
                           for f in (self._mapped[n][i]["flattened_tensor"] for n, i in targets.items())), default=0.0)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the receiver flips right after: the copies must have landed
        return written

    def write_weights(self, path: str, names: list[str], dtype: str | None) -> float:
        """Rank 0 writes the exported weights (in the receivers' dtype) as an HF folder: the disk
        transport, which any engine can load (`/update_weights_from_disk`)."""
        cast = dtype_from_name(dtype) if dtype else None
        weights = {}
        for chunk, sd in self._export(self._chunks(names)):
            if self.rank == 0:
                weights.update({n: sd[n].to(dtype=cast or sd[n].dtype, device="cpu", copy=True) for n in chunk})
        if self.rank != 0:
            return 0.0
        write_hf_folder(Path(path), weights, self.model_path, None)
        return float(sum(t.numel() * t.element_size() for t in weights.values()))

    def _send(self, packed: queue.Queue) -> None:
        try:
            while (flat := packed.get()) is not None:
                broadcast(self.weight_group, flat)
        except BaseException as exc:  # reported by the next broadcast_weights
            self._send_error = exc
            while packed.get() is not None:  # let the packer finish its snapshot
                pass

    def _join_sender(self) -> None:
        if self._sender is not None:
            self._sender.join()
            self._sender = None
        if self._send_error is not None:
            exc, self._send_error = self._send_error, None
            raise RuntimeError(f"the previous weight broadcast failed: {exc}") from exc

    def save(self, path: str) -> None:
        self.backend.save(path)

    def load(self, path: str) -> None:
        self.backend.load(path)

    def version(self) -> int:
        return self.backend.version

    def shutdown(self) -> None:
        self._shm.release()
        self._on_device.release()
        self._mapped = {}
        if dist.is_initialized():
            dist.destroy_process_group()


def _slices(payload: dict) -> dict[str, slice]:
    """Where each tensor sits in a mapped flat buffer (computed once per buffer, kept with it)."""
    if "_slices" not in payload:
        payload["_slices"] = {m["name"]: slice(m["start"], m["end"]) for m in payload["metadata"]}
    return payload["_slices"]
