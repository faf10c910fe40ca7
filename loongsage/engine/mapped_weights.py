"""Double-buffered weights in shared memory, for the one-copy same-host (or same-GPU) weight sync.

The parameters become views into the active one of two flat /dev/shm buffers. The trainer maps both
once and writes each new version straight into the standby buffer (casting on the fly) while the
engine keeps generating from the active one; `flip` then points the parameters at the other buffer,
between two engine steps: one copy per version instead of copy-in plus copy-out. An engine on a GPU
keeps both buffers in device memory, and a trainer on the same GPU writes them through CUDA IPC.
"""
from __future__ import annotations

import torch

from loongsage.transfer.tensor_handles import (SHM_PREFIX, flat_layout, release_shared, serialize_payload,
                                               shared_buffer)


class MappedWeights:
    def __init__(self, params: dict[str, torch.Tensor], shm_prefix: str = SHM_PREFIX):
        dtypes = {p.dtype for p in params.values()}
        if len(dtypes) != 1:
            raise ValueError(f"mapped weights need one parameter dtype, the model has {sorted(map(str, dtypes))}")
        self.layout = flat_layout(list(params.items()))
        numel = self.layout[-1]["end"]
        dtype = dtypes.pop()
        device = next(iter(params.values())).device  # on a GPU the handles are CUDA IPC handles (cuda_ipc route)
        self.buffers = [shared_buffer(numel, dtype, device, shm_prefix) for _ in range(2)]
        self.active = 0
        with torch.no_grad():
            for m in self.layout:
                self.buffers[0][m["start"]:m["end"]].copy_(params[m["name"]].reshape(-1))
        self._point(params, 0)

    def _point(self, params: dict[str, torch.Tensor], idx: int) -> None:
        buf = self.buffers[idx]
        for m in self.layout:
            params[m["name"]].data = buf[m["start"]:m["end"]].view(m["shape"])
        self.active = idx

    def handles(self) -> list[str]:
        """One `flattened_bucket` handle per buffer (pickled once: the trainer maps them once)."""
        return [serialize_payload({"flattened_tensor": b, "metadata": self.layout}) for b in self.buffers]

    def flip(self, params: dict[str, torch.Tensor], standby: int) -> int:
        """Serve the standby buffer (which the sender has just written); returns the tensor count."""
        if standby != 1 - self.active:
            raise ValueError(f"flip to buffer {standby}, but buffer {self.active} is the active one")
        start = self.buffers[self.active].untyped_storage().data_ptr()
        first = params[self.layout[0]["name"]]
        if first.untyped_storage().data_ptr() != start:
            raise RuntimeError("the weights were replaced since they were mapped (memory released?); map them again")
        self._point(params, standby)
        return len(self.layout)

    @property
    def nbytes(self) -> int:
        return self.buffers[0].numel() * self.buffers[0].element_size()

    def release(self) -> None:
        for b in self.buffers:
            release_shared(b)
