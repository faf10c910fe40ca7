"""Weight-sync bandwidth per transport, side by side in one run, for payloads from ~10 MB to ~1 GB:
memcpy into a reused buffer (the ceiling); the shared-memory path of embedded engines (one copy: the
sender writes into the receiver's mapped standby buffer, the receiver flips to it); the two-copy
shared-memory path SGLang takes (sender copies into a reused /dev/shm staging buffer, the receiver
copies out into its own weights); the collective (gloo broadcast to a receiver process); and the
disk path (safetensors save, receiver loads and copies).

    python benchmarks/weight_sync.py [--sizes-mb 10 100 1000] [--repeats 3]

Prints a table, then one JSON object as the last line with, for the largest size:
memcpy_gbps, shm_gbps, collective_gbps, disk_gbps, shm_over_memcpy, shm_over_disk.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from loongsage.rollout.launcher import free_port
from loongsage.transfer.collective import broadcast, new_weight_group


def _receiver(kind: str, numel: int, repeats: int, port: int, shm: torch.Tensor | None, path: str | None,
              go: mp.Event, done: mp.Event) -> None:
    torch.set_num_threads(1)
    weights = torch.empty(numel)
    weights.fill_(0.0)  # touch the pages once: a real receiver's weights are resident
    group = new_weight_group("gloo", "127.0.0.1", port, 1, 2, "bench") if kind == "collective" else None
    for _ in range(repeats):
        if kind == "collective":
            broadcast(group, weights)
            continue
        go.wait()
        go.clear()
        if kind == "shm":
            weights = shm  # flip: the freshly written standby buffer becomes the weights
        elif kind == "shm_two_copy":
            weights.copy_(shm)
        else:
            weights.copy_(load_file(path)["w"])
        done.set()


def measure(kind: str, numel: int, repeats: int) -> float:
    """Seconds per transfer (best of `repeats`), sender to receiver's own weights."""
    src = torch.randn(numel)
    if kind == "memcpy":
        dst = torch.empty(numel)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        return min(times)
    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Event()
    shm = torch.zeros(numel).share_memory_() if kind.startswith("shm") else None  # touched: resident, reused
    path = os.path.join(tempfile.mkdtemp(prefix="bench-disk-"), "w.safetensors") if kind == "disk" else None
    port = free_port()
    proc = ctx.Process(target=_receiver, args=(kind, numel, repeats, port, shm, path, go, done))
    proc.start()
    group = new_weight_group("gloo", "127.0.0.1", port, 0, 2, "bench") if kind == "collective" else None
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        if kind == "collective":
            broadcast(group, src)
        else:
            if kind.startswith("shm"):
                shm.copy_(src)
            else:
                save_file({"w": src}, path)
            go.set()
            done.wait()
            done.clear()
        times.append(time.perf_counter() - t)
    proc.join()
    if path:
        os.remove(path)
    return min(times) if kind != "collective" else min(times[1:] or times)  # the first broadcast connects


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = {}
    kinds = ("memcpy", "shm", "shm_two_copy", "collective", "disk")
    print(f"{'size MB':>8s} {'memcpy':>8s} {'shm':>8s} {'shm 2cp':>8s} {'collect.':>8s} {'disk':>8s}   (GB/s)")
    for mb in args.sizes_mb:
        numel = int(mb * 1e6 / 4)
        gbps = {k: numel * 4 / 1e9 / measure(k, numel, args.repeats) for k in kinds}
        rows[mb] = gbps
        print(f"{mb:8.0f} " + " ".join(f"{gbps[k]:8.2f}" for k in kinds), flush=True)
    big = rows[max(rows)]
    out = {"size_mb": max(rows), **{f"{k}_gbps": round(v, 3) for k, v in big.items()},
           "shm_over_memcpy": round(big["shm"] / big["memcpy"], 3), "shm_over_disk": round(big["shm"] / big["disk"], 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
