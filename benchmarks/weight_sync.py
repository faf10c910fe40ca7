"""Weight-sync bandwidth per transport, side by side in one run, for payloads from ~10 MB to ~1 GB,
each transfer checked bit for bit at the receiver (so on a GPU this is also the check of the CUDA IPC
and NCCL paths). On CPU: memcpy into a reused buffer (the ceiling); the shared-memory path of
embedded engines (one copy: the sender writes into the receiver's mapped standby buffer, the receiver
flips to it); the two-copy shared-memory path SGLang takes (a reused /dev/shm staging buffer, the
receiver copies out into its own weights); the collective (gloo broadcast to a receiver process);
and the disk path (safetensors save, receiver loads and copies). With `--device cuda` the same on
one GPU: device memcpy, CUDA IPC one-copy and two-copy, an NCCL broadcast, and disk. The handles
are LoongSage's own (`tensor_handles`: shared buffer, serialized handle, restricted unpickler).

    python benchmarks/weight_sync.py [--sizes-mb 10 100 1000] [--repeats 3] [--device cpu|cuda]

Prints a table, then one JSON object as the last line with, for the largest size:
memcpy_gbps, shm_gbps, collective_gbps, disk_gbps, shm_over_memcpy, shm_over_disk (on a GPU `shm`
names the CUDA IPC path), and `verified` (every transfer arrived bit-identical).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import tempfile
import time

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from loongsage.cluster.network import LOOPBACK, Rendezvous
from loongsage.transfer.broadcast import broadcast, new_weight_group
from loongsage.transfer.checksum import weights_checksum
from loongsage.transfer.tensor_handles import deserialize_named_tensors, serialize_payload, shared_buffer

KINDS = ("memcpy", "shm", "shm_two_copy", "collective", "disk")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _receiver(kind: str, device: str, numel: int, repeats: int, port: int, handle: str | None, path: str | None,
              go, done, result) -> None:
    torch.set_num_threads(1)
    weights = torch.zeros(numel, device=device)  # touched: a real receiver's weights are resident
    shared = deserialize_named_tensors(handle)["flattened_tensor"] if handle else None
    group = (new_weight_group("nccl" if device == "cuda" else "gloo", "127.0.0.1", port, 1, 2, "bench")
             if kind == "collective" else None)
    for _ in range(repeats):
        if kind == "collective":
            broadcast(group, weights)
            continue
        go.wait()
        go.clear()
        if kind == "shm":
            weights = shared  # flip: the freshly written standby buffer becomes the weights
        elif kind == "shm_two_copy":
            weights.copy_(shared)
        else:
            weights.copy_(load_file(path, device=device)["w"])
        _sync(device)
        done.set()
    _sync(device)
    result.put(weights_checksum({"w": weights}, ["w"]))


def _wait_for(done, proc) -> None:
    """Waits for the receiver's signal; a receiver that died is an error, not a hang."""
    while not done.wait(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"the receiver process died (exit code {proc.exitcode})")
    done.clear()


def _result(result, proc) -> int:
    while True:
        try:
            return result.get(timeout=0.5)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the receiver process died (exit code {proc.exitcode})") from None


def measure(kind: str, numel: int, repeats: int, device: str = "cpu") -> tuple[float, bool]:
    """(seconds per transfer, best of `repeats`; whether the receiver's weights equal the sender's bits)."""
    src = torch.randn(numel, device=device)
    if kind == "memcpy":
        dst = torch.empty(numel, device=device)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            _sync(device)
            times.append(time.perf_counter() - t)
        return min(times), torch.equal(dst, src)
    ctx = mp.get_context("spawn")
    go, done, result = ctx.Event(), ctx.Event(), ctx.Queue()
    shared = shared_buffer(numel, torch.float32, device) if kind.startswith("shm") else None
    if shared is not None:
        shared.zero_()  # resident, reused
    handle = serialize_payload({"flattened_tensor": shared, "metadata": []}) if shared is not None else None
    path = os.path.join(tempfile.mkdtemp(prefix="bench-disk-"), "w.safetensors") if kind == "disk" else None
    rdv = Rendezvous.open(LOOPBACK) if kind == "collective" else None
    proc = ctx.Process(target=_receiver, args=(kind, device, numel, repeats, rdv and rdv.port, handle, path, go, done,
                                               result))
    proc.start()
    group = (new_weight_group("nccl" if device == "cuda" else "gloo", LOOPBACK, rdv.port, 0, 2, "bench",
                              rendezvous=rdv) if rdv else None)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        if kind == "collective":
            broadcast(group, src)
            _sync(device)
        else:
            if kind.startswith("shm"):
                shared.copy_(src)
                _sync(device)
            else:
                save_file({"w": src.cpu()}, path)
            go.set()
            _wait_for(done, proc)
        times.append(time.perf_counter() - t)
    verified = _result(result, proc) == weights_checksum({"w": src}, ["w"])
    proc.join()
    if path:
        os.remove(path)
        os.rmdir(os.path.dirname(path))
    return (min(times) if kind != "collective" else min(times[1:] or times)), verified  # 1st broadcast connects


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rows, verified = {}, True
    names = ("memcpy", "cuda ipc", "ipc 2cp", "nccl", "disk") if args.device == "cuda" else \
            ("memcpy", "shm", "shm 2cp", "collect.", "disk")
    print(f"{'size MB':>8s} " + " ".join(f"{n:>8s}" for n in names) + "   (GB/s)")
    for mb in args.sizes_mb:
        numel = int(mb * 1e6 / 4)
        measured = {k: measure(k, numel, args.repeats, args.device) for k in KINDS}
        rows[mb] = {k: numel * 4 / 1e9 / s for k, (s, _) in measured.items()}
        bad = [k for k, (_, ok) in measured.items() if not ok]
        verified &= not bad
        print(f"{mb:8.0f} " + " ".join(f"{rows[mb][k]:8.2f}" for k in KINDS) + (f"   NOT VERIFIED: {bad}" if bad else ""),
              flush=True)
    big = rows[max(rows)]
    out = {"device": args.device, "size_mb": max(rows), **{f"{k}_gbps": round(v, 3) for k, v in big.items()},
           "shm_over_memcpy": round(big["shm"] / big["memcpy"], 3), "shm_over_disk": round(big["shm"] / big["disk"], 3),
           "verified": verified}
    print(json.dumps(out))
    if not verified:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
