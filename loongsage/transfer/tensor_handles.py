"""Same-host tensor handles for `/update_weights_from_tensor` (SGLang's serialized form).

A handle is a base64 string of a pickled list of (name, tensor) pairs, where each tensor
lives in shared memory (CPU: a /dev/shm file; GPU: a CUDA IPC handle), so only the handle
crosses the HTTP request. Loading goes through a restricted unpickler: an HTTP body can name
torch's storage-rebuild functions and plain containers, never arbitrary code.
"""
from __future__ import annotations

import base64
import io
import pickle

import torch
import torch.multiprocessing as tmp
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing.reductions  # noqa: F401  (registers the tensor reductions)

_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.multiprocessing.reductions", "rebuild_parameter"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
    ("builtins", "slice"),
}


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]] | dict) -> str:
    """Handles for tensors, moving CPU tensors to shared memory when they are not there yet."""
    tmp.set_sharing_strategy("file_system")  # names, not file descriptors: any process can open them
    items = list(named.items()) if isinstance(named, dict) else list(named)
    shared = []
    for name, t in items:
        if t.device.type == "cpu" and not t.is_shared():
            t = t.contiguous().share_memory_()
        shared.append((name, t))
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(shared)
    return base64.b64encode(buf.getvalue()).decode()


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor handle")


def deserialize_named_tensors(payload: str):
    try:
        raw = base64.b64decode(payload, validate=True)
    except Exception as exc:
        raise ValueError(f"serialized_named_tensors: not valid base64 ({exc})") from None
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:
        raise ValueError(f"serialized_named_tensors: cannot load the handles ({exc})") from None
    return obj
