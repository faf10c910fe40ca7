"""Same-host tensor handles for `/update_weights_from_tensor` (SGLang's serialized form).

A handle is a base64 string of a pickled list of (name, tensor) pairs, where each tensor
lives in shared memory (CPU: a /dev/shm file; GPU: a CUDA IPC handle), so only the handle
crosses the HTTP request. Loading goes through a restricted unpickler: an HTTP body can name
torch's storage-rebuild functions and plain containers, never arbitrary code, and only /dev/shm
files under the receiver's prefix (a run names its buffers `loongsage-<run id>-...` itself, so an
engine maps nothing else: not Ray's object store, not another program's memory).
"""
from __future__ import annotations

import base64
import io
import os
import pickle
import re
import secrets
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import torch
import torch.multiprocessing as tmp
import torch.multiprocessing.reductions

from loongsage.transfer.shm_names import SHM_PREFIX

_SHM_NAME = re.compile(r"/[A-Za-z0-9_.-]+")
_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
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
    ("types", "SimpleNamespace"),  # flattened-bucket metadata (SGLang admits it too)
}


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]] | dict, prefix: str = SHM_PREFIX) -> str:
    """Handles for tensors, copying CPU tensors into named shared buffers (under `prefix`) first.
    The copies' files are unlinked once the last process that mapped them exits."""
    items = list(named.items()) if isinstance(named, dict) else list(named)
    return _dump([(name, _shared(t, prefix)) for name, t in items])


def serialize_flattened_bucket(named: list[tuple[str, torch.Tensor]] | dict, prefix: str = SHM_PREFIX) -> str:
    """One flat shared tensor plus metadata (`load_format="flattened_bucket"`): one handle, not one per tensor."""
    items = list(named.items()) if isinstance(named, dict) else list(named)
    if len({t.dtype for _, t in items}) > 1:
        raise ValueError("a flattened bucket holds one dtype; split the tensors by dtype first")
    flat = torch.cat([t.reshape(-1) for _, t in items])
    return _dump({"flattened_tensor": _shared(flat, prefix), "metadata": flat_layout(items)})


def flat_layout(items: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> list[SimpleNamespace]:
    """Where each tensor sits in a flattened bucket, in SGLang's `FlattenedTensorMetadata` fields
    (name, shape, dtype, start_idx, end_idx, numel), so SGLang's own `FlattenedTensorBucket` rebuilds
    the tensors. A bucket holds one dtype, so offsets count its elements (SGLang's own buckets are
    bytes; its reconstruction slices, then views, and reads either). A SimpleNamespace because
    SGLang's restricted unpickler admits it and reads the fields as attributes. `dtype`: the
    bucket's, when the tensors are cast on their way in (default: each tensor's own)."""
    meta, start = [], 0
    for name, t in items:
        meta.append(SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=dtype or t.dtype, start_idx=start,
                                    end_idx=start + t.numel(), numel=t.numel()))
        start += t.numel()
    return meta


def unflatten_bucket(payload) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(payload, dict) or "flattened_tensor" not in payload or "metadata" not in payload:
        raise ValueError("flattened_bucket: expected a dict with 'flattened_tensor' and 'metadata'")
    flat = payload["flattened_tensor"]
    try:
        return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in payload["metadata"]]
    except (AttributeError, TypeError, RuntimeError) as exc:
        raise ValueError(f"flattened_bucket: bad metadata ({exc})") from None


def shared_buffer(numel: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                  prefix: str = SHM_PREFIX) -> torch.Tensor:
    """A buffer other processes can map: on CPU a /dev/shm file we name (`/<prefix><random>`, mode
    0600) and map through torch's shared-memory allocator, so its pickled handle is torch's own
    (SGLang reads it) and names our file; on a GPU plain device memory (its handle is a CUDA IPC
    handle, valid for processes on the same device)."""
    if torch.device(device).type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    tmp.set_sharing_strategy("file_system")
    nbytes = max(1, numel) * torch.empty(0, dtype=dtype).element_size()
    name = f"/{prefix}{secrets.token_hex(8)}"
    fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    storage = torch.UntypedStorage._new_shared_filename_cpu(b"", name.encode(), nbytes)
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))


def release_shared(t: torch.Tensor) -> None:
    """Removes a shared buffer's /dev/shm file (processes that mapped it keep their mapping); without
    this, files of processes killed at shutdown stay behind. GPU buffers are freed with their tensor."""
    if t.device.type != "cpu":
        return
    name = t.untyped_storage()._share_filename_cpu_()[1].decode()
    try:
        os.unlink("/dev/shm" + name)
    except OSError:
        pass


class SharedBuckets:
    """Flattened buckets in reused shared memory: one /dev/shm buffer per bucket, allocated when the
    bucket layout first appears (fresh shared memory is several times slower than a copy into a
    mapped buffer), refilled every version, released explicitly. Handles are made fresh per receiver
    and version: pickling a shared tensor takes a reference that the receiver's unpickling returns.
    The owner must not refill while a receiver may still be loading the previous version.
    On a GPU `device` the buffers are device memory and the handles CUDA IPC handles."""

    def __init__(self, device: str | torch.device = "cpu", prefix: str = SHM_PREFIX) -> None:
        self.device, self.prefix = torch.device(device), prefix
        self._bufs: list[tuple[torch.Tensor, list[dict]]] = []

    def fill(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], dtype: torch.dtype | None = None) -> float:
        """Copies (and casts) every tensor into its slice, bucket by bucket as `buckets` yields them (a
        lazy export holds one bucket at a time); returns the bytes held."""
        count = 0
        for k, bucket in enumerate(buckets):
            self.fill_one(k, bucket, dtype)
            count = k + 1
        for buf, _ in self._bufs[count:]:
            release_shared(buf)
        del self._bufs[count:]
        return float(sum(b.numel() * b.element_size() for b, _ in self._bufs))

    def fill_one(self, k: int, bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> float:
        """Bucket `k` alone (buckets are filled in order: 0, 1, ...); returns its bytes."""
        dtype = dtype or bucket[0][1].dtype
        meta = flat_layout(bucket, dtype)
        if k > len(self._bufs):
            raise IndexError(f"bucket {k} filled before bucket {len(self._bufs)}")
        if k == len(self._bufs) or self._bufs[k][1] != meta:  # a new layout: a new buffer, once
            buf = shared_buffer(sum(t.numel() for _, t in bucket), dtype, self.device,
                                self.prefix)
            if k < len(self._bufs):
                release_shared(self._bufs[k][0])
                self._bufs[k] = (buf, meta)
            else:
                self._bufs.append((buf, meta))
        buf = self._bufs[k][0]
        with torch.no_grad():  # sources may be parameters; the buffers stay plain tensors
            for m, (_, t) in zip(meta, bucket):  # no temporary: straight into the slice
                buf[m.start_idx:m.end_idx].copy_(t.reshape(-1))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # receivers read as soon as they get the handle
        return float(buf.numel() * buf.element_size())

    def handles(self, receivers: int) -> list[list[str]]:
        """Per bucket, one `flattened_bucket` handle per receiver."""
        return [self.handles_of(k, receivers) for k in range(len(self._bufs))]

    def handles_of(self, k: int, receivers: int) -> list[str]:
        buf, meta = self._bufs[k]
        return [serialize_payload({"flattened_tensor": buf, "metadata": meta}) for _ in range(receivers)]

    def release(self) -> None:
        for buf, _ in self._bufs:
            release_shared(buf)
        self._bufs = []


def serialize_payload(payload) -> str:
    """A handle for an already shared payload (e.g. a reused flattened bucket): no copy is made."""
    return _dump(payload)


def _shared(t: torch.Tensor, prefix: str) -> torch.Tensor:
    if t.device.type != "cpu":
        return t
    buf = shared_buffer(t.numel(), t.dtype, prefix=prefix)
    buf.copy_(t.reshape(-1))
    return buf.view(t.shape)


def _dump(obj) -> str:
    tmp.set_sharing_strategy("file_system")  # names, not file descriptors: any process can open them
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, shm_prefix: str):
        super().__init__(file)
        self.shm_prefix = shm_prefix

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
            return self._rebuild_named
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor handle")

    def _rebuild_named(self, cls, manager, handle, size, dtype=None):
        """torch's rebuild of a /dev/shm storage, for names under this receiver's prefix only."""
        name = handle.decode(errors="replace") if isinstance(handle, bytes) else str(handle)
        if not (_SHM_NAME.fullmatch(name) and name.startswith("/" + self.shm_prefix)):
            raise pickle.UnpicklingError(f"shared-memory name {name!r} is outside this receiver's prefix "
                                         f"{self.shm_prefix!r}")
        return torch.multiprocessing.reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


def deserialize_named_tensors(payload: str, shm_prefix: str = SHM_PREFIX):
    try:
        raw = base64.b64decode(payload, validate=True)
    except Exception as exc:
        raise ValueError(f"serialized_named_tensors: not valid base64 ({exc})") from None
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw), shm_prefix).load()
    except Exception as exc:
        raise ValueError(f"serialized_named_tensors: cannot load the handles ({exc})") from None
    return obj
