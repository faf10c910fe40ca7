"""Which physical GPU a process means by `cuda:i`. Each Ray actor sees its own CUDA_VISIBLE_DEVICES,
so `cuda:0` in two processes may be two different GPUs (or, for actors sharing a GPU fraction, the
same one): the planner compares physical ids, so `cuda_ipc` is chosen only for a truly shared device."""
from __future__ import annotations

import os


def physical_device(device: str, visible: str | None = None) -> str:
    """`cpu`, or `cuda:<id>` where id is the entry of CUDA_VISIBLE_DEVICES (an index or a GPU UUID)
    that the process's `cuda:i` refers to. `visible` defaults to this process's environment."""
    if not device.startswith("cuda"):
        return "cpu"
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not visible:
        return f"cuda:{index}"
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise ValueError(f"{device}: only {len(ids)} visible device(s) (CUDA_VISIBLE_DEVICES={visible!r})")
    return f"cuda:{ids[index]}"
