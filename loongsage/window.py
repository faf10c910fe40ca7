"""Window strategies: which groups may start, and which finished ones the trainer may take.

Pure and synchronous (no asyncio, no I/O): `buffer.SampleBuffer` owns the state and asks its
strategy two questions, so a strategy is a small object users can replace by config
(`rollout.window: "module:attr"`, see docs/extending.md).

Versions: the trainer's version v counts finished optimizer steps; step t (1-based) trains on
version t-1 and produces version t. A group whose oldest token came from version m has staleness
(t - 1) - m at step t and may be trained only if that is <= k (`max_staleness`). The buffer evicts
what is out of the window whatever the strategy; strategies bound admission so that almost
nothing ever is.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WindowState:
    """What a strategy sees. Groups are numbered in admission order (`seq`)."""
    max_staleness: int  # k
    batch_groups: int  # B: groups consumed per training step
    max_inflight: int | None = None  # cap on concurrently running groups (engine capacity)
    version: int = 0
    running: set[int] = field(default_factory=set)  # seqs still generating
    uncollected: set[int] = field(default_factory=set)  # seqs admitted, neither taken nor dropped yet
    accepted: int = 0  # finished and buffered or trained (freed by eviction and discarding)

    def oldest_uncollected(self) -> int | None:
        return min(self.uncollected) if self.uncollected else None


class StalenessWindow:
    """The default: admission keeps every group inside the staleness window. All groups admitted so
    far (accepted + running) may not exceed (k + 1 + v) * B, so whatever is in flight can be
    consumed by the time the trainer is k versions further; k = 0 is the synchronous schedule (one
    batch admitted, trained, then the next). Finished groups are taken in the order they finish."""
    name = "staleness"

    def capacity(self, s: WindowState) -> int:
        room = (s.max_staleness + 1 + s.version) * s.batch_groups - (s.accepted + len(s.running))
        if s.max_inflight is not None:
            room = min(room, s.max_inflight - len(s.running))
        return max(0, room)

    def collectable(self, seq: int, s: WindowState) -> bool:
        return True


class WindowedFifo(StalenessWindow):
    """The same admission, but the trainer may only take a finished group whose sequence number is
    within B of the oldest group not yet collected: fast groups cannot crowd slow ones out of a
    batch (the training distribution does not drift towards easy prompts), while inside the window
    any finished group is taken at once (no head-of-line blocking)."""
    name = "windowed_fifo"

    def collectable(self, seq: int, s: WindowState) -> bool:
        head = s.oldest_uncollected()
        return head is None or seq - head < s.batch_groups


STRATEGIES = {cls.name: cls for cls in (StalenessWindow, WindowedFifo)}
