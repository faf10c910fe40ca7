"""An exact weight checksum both ends of a sync compute the same way: the raw bits of every tensor,
summed as integers (weighted by position in name order), in the receiver's dtype. Integer sums
do not depend on reduction order or thread count, so equal weights give equal numbers and one
flipped bit changes them."""
from __future__ import annotations

import torch

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_checksum(named: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype | None = None) -> int:
    total = 0
    for i, name in enumerate(sorted(names)):
        t = named[name].detach()
        t = (t.to(dtype) if dtype is not None else t).contiguous().cpu().reshape(-1)
        total += (i + 1) * int(t.view(_BITS[t.element_size()]).to(torch.int64).sum())
    return total % (1 << 61)
