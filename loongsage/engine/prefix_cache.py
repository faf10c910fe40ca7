"""The prefix cache: finished sequences' K/V stay in their (free) slots, and a new sequence that
starts with one of their token prefixes reuses it instead of prefilling it again. Entries are
evicted least recently used first; a weight update drops them all, so K/V computed by old weights is
never served as new. This module only keeps the entries; moving K/V between slots is the core's.

Lookups run at every admission, so the entries' tokens also live in one [slots, context] table and a
lookup compares the prompt with every entry in one array operation (a loop over entries cost more
than the forward pass at 256 admissions a step).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class CacheEntry:
    tokens: np.ndarray  # the token ids whose K/V the slot holds
    used: int  # scheduler tick of last use (LRU)


class PrefixCache:
    def __init__(self, enabled: bool = True, slots: int = 0, context_len: int = 0, min_tokens: int = 1):
        self.enabled = enabled
        self.min_tokens = min_tokens  # a shorter common prefix is not a hit
        self.entries: dict[int, CacheEntry] = {}  # slot -> entry
        self._table = np.zeros((slots, context_len), dtype=np.int64)
        self._lengths = np.zeros(slots, dtype=np.int64)  # 0 where a slot holds no entry
        self._used = np.zeros(slots, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, slot: int) -> bool:
        return slot in self.entries

    def get(self, slot: int) -> CacheEntry | None:
        return self.entries.get(slot)

    def pop(self, slot: int) -> CacheEntry:
        self._lengths[slot] = 0
        return self.entries.pop(slot)

    def put(self, slot: int, entry: CacheEntry) -> None:
        n = len(entry.tokens)
        self._table[slot, :n] = entry.tokens
        self._lengths[slot] = n
        self._used[slot] = entry.used
        self.entries[slot] = entry

    def clear(self) -> None:
        self.entries.clear()
        self._lengths[:] = 0

    def least_recent(self, above: int = -1, exclude: set[int] | None = None) -> int | None:
        """The slot after `above` of the least recently used entry, not one of `exclude`; or None."""
        held = np.flatnonzero(self._lengths[above + 1:]) + above + 1
        if exclude:
            held = held[~np.isin(held, list(exclude))]
        return int(held[self._used[held].argmin()]) if held.size else None

    def free_slot(self, above: int) -> int | None:
        """The last slot after `above` that holds no entry."""
        free = np.flatnonzero(self._lengths[above + 1:] == 0)
        return int(free[-1]) + above + 1 if free.size else None

    def lookup(self, ids: list[int], limit: int) -> tuple[int | None, int]:
        """(slot, length) of the longest cached prefix of `ids` no longer than `limit`, or (None, 0)
        when it is shorter than `min_tokens`."""
        m = min(limit, len(ids), self._table.shape[1])
        if not self.entries or m <= 0:
            return None, 0
        equal = self._table[:, :m] == np.asarray(ids[:m])
        common = np.where(equal.all(axis=1), m, equal.argmin(axis=1))
        common = np.minimum(common, self._lengths)
        best = int(common.argmax())
        return (best, int(common[best])) if common[best] >= max(self.min_tokens, 1) else (None, 0)
