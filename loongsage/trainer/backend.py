"""The TrainBackend contract: what the controller may ask of a training backend (per rank).

Backends (torch FSDP2 now, Megatron-Core later) implement exactly this; the algorithm math they
call lives in `loongsage.algo`, never in backend files.
"""
from __future__ import annotations

from typing import Protocol

import torch

from loongsage.algo.config import LossConfig
from loongsage.trainer.batch import TrainBatch


class TrainBackend(Protocol):
    version: int

    def compute_logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token logprobs [B, L-1] of the batch's targets (and entropy), no gradient."""

    def train_step(self, batch: TrainBatch, loss: str, loss_cfg: LossConfig | None,
                   denominator: float) -> dict[str, float]:
        """One optimizer step over the batch in micro-batches; `loss` is "policy" or "sft"."""

    def weight_meta(self) -> list[tuple[str, str, list[int]]]:
        """(name, dtype, shape) of every exported tensor, in export order."""

    def full_state_dict(self, names: list[str] | None = None) -> dict[str, torch.Tensor] | None:
        """Full (unsharded) weights on rank 0 (None elsewhere): all, or only `names` (one bucket of a
        weight sync, gathered alone); a collective on all ranks, which must pass the same names."""

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...
