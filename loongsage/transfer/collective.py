"""A stand-alone process group for weight broadcasts, apart from any training group.

Trainer rank 0 and every engine (rank_offset + its TP rank) meet in a group of their own,
exactly as SGLang's `/init_weights_update_group` does; gloo on CPU, NCCL on GPU. The group is
built straight from a TCPStore, so it never touches (or needs) the default process group.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from loongsage.cluster.network import LOOPBACK, Rendezvous, tcp_store

DTYPE_NAMES = {
    "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "int64": torch.int64, "int32": torch.int32,
}


def dtype_from_name(name: str) -> torch.dtype:
    key = name.removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def new_weight_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int,
    group_name: str = "weight_update_group", timeout_s: float = 120.0, own_address: str = LOOPBACK,
    rendezvous: Rendezvous | None = None,
) -> dist.ProcessGroup:
    """Rank 0 holds `rendezvous` (the store's socket, bound on its node's address); every member's
    gloo sockets bind `own_address`, the address of the node it runs on."""
    if (rank == 0) != (rendezvous is not None):
        raise ValueError("the weight group's rank 0, and only it, holds the rendezvous socket")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(group_name, tcp_store(master_address, master_port, world_size, rendezvous, timeout))
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=own_address)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()
