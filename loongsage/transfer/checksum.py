"""An exact weight checksum both ends of a sync compute the same way: the raw bits of every tensor,
summed as integers (weighted by position in name order), in the receiver's dtype. Integer sums
do not depend on reduction order or thread count, so equal weights give equal numbers and one
flipped bit changes them."""
from __future__ import annotations

import torch

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_checksum(named: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype | None = None) -> int:
    return finish_checksum(checksum_part(named, checksum_order(names), dtype))


def checksum_order(names: list[str]) -> dict[str, int]:
    """Each tensor's weight in the sum: its position in name order (so swapped tensors differ)."""
    return {n: i + 1 for i, n in enumerate(sorted(names))}


def checksum_part(named: dict[str, torch.Tensor], order: dict[str, int], dtype: torch.dtype | None = None) -> int:
    """The terms of the tensors in `named` (one chunk of an export gathered chunk by chunk)."""
    total = 0
    for name, t in named.items():
        if name in order:
            t = t.detach()
            t = (t.to(dtype) if dtype is not None else t).contiguous().cpu().reshape(-1)
            total += order[name] * int(t.view(_BITS[t.element_size()]).to(torch.int64).sum())
    return total


def finish_checksum(total: int) -> int:
    return total % (1 << 61)
