"""The sliding staleness window as a small pure component (no I/O, no asyncio).

Versions: the trainer's version v counts finished optimizer steps; step t (1-based) trains on
version t-1 and produces version t. A group whose oldest token came from version m has staleness
(t - 1) - m at step t and may be trained only if that is <= k (`max_staleness`).

Admission control keeps almost everything inside the window: with B groups consumed per step,
all groups admitted so far (accepted + running) may not exceed (k + 1 + v) * B, so whatever is in
flight can be consumed by the time the trainer is k versions further. k = 0 is the synchronous
schedule: one batch admitted, trained, then the next.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessWindow:
    max_staleness: int
    batch_groups: int  # groups consumed per training step
    max_inflight: int | None = None  # cap on concurrently running groups (engine capacity)
    version: int = 0
    running: int = 0  # admitted, still generating
    accepted: int = 0  # finished and buffered or trained (never decreases except by eviction)
    dropped_stale: int = 0
    cancelled: int = 0
    failed: int = 0
    discarded: int = 0  # finished but uninformative (dynamic sampling)
    trained: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.batch_groups < 1:
            raise ValueError("max_staleness must be >= 0 and batch_groups >= 1")

    # ---- admission ------------------------------------------------------------------------
    def capacity(self) -> int:
        """How many more groups may be admitted now."""
        room = (self.max_staleness + 1 + self.version) * self.batch_groups - (self.accepted + self.running)
        if self.max_inflight is not None:
            room = min(room, self.max_inflight - self.running)
        return max(0, room)

    def admit(self, n: int = 1) -> None:
        if n > self.capacity():
            raise RuntimeError(f"admitting {n} groups exceeds the window capacity {self.capacity()}")
        self.running += n

    # ---- completion ------------------------------------------------------------------------
    def finish(self) -> None:
        """A running group finished and went into the buffer."""
        self._leave_running()
        self.accepted += 1

    def cancel(self) -> None:
        """A running group was cancelled because it could no longer make the window."""
        self._leave_running()
        self.cancelled += 1

    def fail(self) -> None:
        self._leave_running()
        self.failed += 1

    def _leave_running(self) -> None:
        if self.running <= 0:
            raise RuntimeError("no running group to finish")
        self.running -= 1

    # ---- consumption -----------------------------------------------------------------------
    def is_stale(self, min_version: int, step: int | None = None) -> bool:
        """Whether a group whose oldest token is from `min_version` is out of the window at `step`."""
        step = self.version + 1 if step is None else step
        return (step - 1) - min_version > self.max_staleness

    def evict(self, n: int = 1) -> None:
        """Buffered groups found stale are dropped (counted, never trained); they free their place."""
        self.accepted -= n
        self.dropped_stale += n

    def discard(self, n: int = 1) -> None:
        """Buffered groups not worth training (e.g. all rewards equal) free their place too."""
        self.accepted -= n
        self.discarded += n

    def consume(self, n: int) -> None:
        self.trained += n

    def advance(self) -> None:
        """The trainer finished a step: version v -> v + 1."""
        self.version += 1

    def in_flight_too_old(self, start_version: int) -> bool:
        """A running group started at `start_version` can no longer be trained at the next step."""
        return self.is_stale(start_version, self.version + 1)
