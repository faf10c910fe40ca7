"""Optimizer state off the accelerator while a colocated engine generates on it.

In colocated placement a trainer rank and an engine time-share one device: Adam's two moments are
twice the weights, room the engine's KV cache needs while it generates. They go to host memory
after each step and come back before the next (`TrainerRank.offload_optimizer` / `reload_optimizer`).
On a CPU device there is nothing to move.
"""
from __future__ import annotations

import torch


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind `optimizer`: itself, or those Megatron's wrappers hold
    (`ChainedOptimizer.chained_optimizers`, `MegatronOptimizer.optimizer`)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if hasattr(optimizer, "chained_optimizers"):
        return [o for inner in optimizer.chained_optimizers for o in torch_optimizers(inner)]
    inner = getattr(optimizer, "optimizer", None)
    return torch_optimizers(inner) if inner is not None else []


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if hasattr(t, "device_mesh"):  # a DTensor (FSDP2 shards): its local shard moves, its layout stays
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(t.to_local().to(device, non_blocking=True), t.device_mesh, t.placements,
                                  run_check=False)
    return t.to(device, non_blocking=True)


def move_optimizer_state(optimizer, device: str | torch.device) -> int:
    """Moves every state tensor of `optimizer` (and of the optimizers it wraps) to `device`;
    returns the bytes moved (0 when all were there already)."""
    device = torch.device(device)
    moved = 0
    for opt in torch_optimizers(optimizer):
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != device and value.dim() > 0:
                    state[key] = _moved(value, device)
                    moved += value.numel() * value.element_size()
    if moved and device.type == "cpu":
        torch.cuda.synchronize()  # the copies are asynchronous: done before the engine takes the memory
    return moved
