"""Bucket planning for weight syncs: which tensors travel together (pure; trainer ranks and
transports both use it)."""
from __future__ import annotations


def plan_buckets(meta: list[tuple[str, str, list[int]]], bucket_bytes: int, elem_size: int) -> list[list[int]]:
    """Indices of `meta` per bucket, in order; a tensor larger than a bucket gets its own."""
    buckets, current, size = [], [], 0
    for i, (_, _, shape) in enumerate(meta):
        n = elem_size
        for d in shape:
            n *= d
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets
