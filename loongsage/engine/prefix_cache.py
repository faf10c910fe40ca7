"""The prefix cache: finished sequences' K/V stay in their (free) slots, and a new sequence that
starts with one of their token prefixes reuses it instead of prefilling it again. Entries are
evicted least recently used first; a weight update drops them all, so K/V computed by old weights is
never served as new. This module only keeps the entries; moving K/V between slots is the core's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class CacheEntry:
    tokens: np.ndarray  # the token ids whose K/V the slot holds
    used: int  # scheduler tick of last use (LRU)


class PrefixCache:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.entries: dict[int, CacheEntry] = {}  # slot -> entry

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, slot: int) -> bool:
        return slot in self.entries

    def get(self, slot: int) -> CacheEntry | None:
        return self.entries.get(slot)

    def pop(self, slot: int) -> CacheEntry:
        return self.entries.pop(slot)

    def put(self, slot: int, entry: CacheEntry) -> None:
        self.entries[slot] = entry

    def clear(self) -> None:
        self.entries.clear()

    def least_recent(self) -> int:
        return min(self.entries, key=lambda s: self.entries[s].used)

    def lookup(self, ids: list[int], limit: int) -> tuple[int | None, int]:
        """(slot, length) of the longest cached prefix of `ids` no longer than `limit`, or (None, 0)."""
        if not self.entries:
            return None, 0
        arr = np.asarray(ids)
        best, best_len = None, 0
        for slot, entry in self.entries.items():
            m = min(len(entry.tokens), limit)
            if m <= best_len:
                continue
            diff = np.flatnonzero(entry.tokens[:m] != arr[:m])
            common = int(diff[0]) if diff.size else m
            if common > best_len:
                best, best_len = slot, common
        return (best, best_len) if best_len > 0 else (None, 0)
