"""The sample buffer: the one owner of the groups between the rollout producer and the trainer,
and of the staleness window that bounds them.

    producer (puts only)                         controller (takes only)
      await wait_for_room(); seq = admit()          groups = await take(step, B, cap, informative)
      ... generate the group ...                    ... train ...
      put(seq, group) | fail(seq) | cancel(seq)     advance()   (the new version is on the engines)

Every admitted group ends in exactly one of: running, buffered, trained, evicted (stale),
discarded (uninformative), cancelled, failed; `counts()` says how many. Which groups may start and
which finished ones may be taken is the window strategy's call (`window.py`); that nothing stale is
ever trained is the buffer's own check.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from loongsage.sample import Group
from loongsage.window import StalenessWindow, WindowState


@dataclass
class Taken:
    groups: list[Group]  # the batch: in the window, informative
    sampled: list[Group]  # every group looked at (the batch plus the discarded ones), for metrics
    dropped_samples: int  # samples of groups evicted as stale


class SampleBuffer:
    def __init__(self, max_staleness: int, batch_groups: int, max_inflight: int | None = None,
                 strategy=None):
        if max_staleness < 0 or batch_groups < 1:
            raise ValueError("max_staleness must be >= 0 and batch_groups >= 1")
        self.state = WindowState(max_staleness, batch_groups, max_inflight)
        self.strategy = strategy or StalenessWindow()
        self.start_version: dict[int, int] = {}  # seq -> version when it was admitted (running groups)
        self._ready: OrderedDict[int, Group] = OrderedDict()  # finished groups, in the order they finished
        self._next_seq = 0
        self._changed = asyncio.Event()
        self.dropped_stale = self.cancelled = self.failed = self.discarded = self.trained = 0
        self.on_settle: Callable[[int, str], None] | None = None  # (seq, "dropped_stale" | "filtered")

    # ---- views ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.state.version

    @property
    def running(self) -> int:
        return len(self.state.running)

    def buffered(self) -> int:
        return len(self._ready)

    def resume_at(self, version: int) -> None:
        """A resumed run at `version`: the groups of the steps before count as accepted and trained."""
        self.state.version, self.state.accepted = version, version * self.state.batch_groups
        self.trained = version * self.state.batch_groups

    def capacity(self) -> int:
        """How many more groups may be admitted now."""
        return self.strategy.capacity(self.state)

    def is_stale(self, min_version: int, step: int | None = None) -> bool:
        """Whether a group whose oldest token is from `min_version` is out of the window at `step`."""
        step = self.state.version + 1 if step is None else step
        return (step - 1) - min_version > self.state.max_staleness

    def too_old(self) -> list[int]:
        """Running groups that can no longer be trained at the next step (to be cancelled)."""
        return [seq for seq, v in self.start_version.items() if self.is_stale(v, self.state.version + 1)]

    def counts(self) -> dict[str, int]:
        return {"running": self.running, "buffered": self.buffered(), "trained": self.trained,
                "dropped_stale": self.dropped_stale, "discarded": self.discarded, "cancelled": self.cancelled,
                "failed": self.failed}

    # ---- producer side -----------------------------------------------------------------------
    async def wait_for_room(self) -> None:
        while self.capacity() == 0:
            self._changed.clear()
            await self._changed.wait()

    def admit(self) -> int:
        if self.capacity() == 0:
            raise RuntimeError(f"admitting a group exceeds the window capacity ({self.counts()})")
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self.state.running.add(seq)
        self.state.uncollected.add(seq)
        self.start_version[seq] = self.state.version
        return seq

    def put(self, seq: int, group: Group) -> None:
        """A running group finished: buffered until the trainer takes it."""
        self._leave_running(seq)
        self.state.accepted += 1
        self._ready[seq] = group
        self._poke()

    def cancel(self, seq: int) -> None:
        """A running group was cancelled because it could no longer make the window."""
        self._leave_running(seq)
        self.state.uncollected.discard(seq)
        self.cancelled += 1
        self._poke()

    def fail(self, seq: int) -> None:
        self._leave_running(seq)
        self.state.uncollected.discard(seq)
        self.failed += 1
        self._poke()

    def _leave_running(self, seq: int) -> None:
        if seq not in self.state.running:
            raise RuntimeError(f"group {seq} is not running")
        self.state.running.discard(seq)
        self.start_version.pop(seq, None)

    # ---- controller side -----------------------------------------------------------------------
    def collectable(self) -> int:
        """Finished groups the strategy lets the trainer take now."""
        return sum(self.strategy.collectable(seq, self.state) for seq in self._ready)

    async def take(self, step: int, want: int, cap: int, informative: Callable[[Group], bool]) -> Taken:
        """Up to `want` groups for `step` that are in the window and `informative`; stale ones are
        evicted, uninformative ones discarded (their places freed), at most `cap` looked at. Waits
        for groups to finish; cancelled while waiting, it takes nothing."""
        kept: list[tuple[int, Group]] = []
        sampled: list[Group] = []
        dropped = 0
        try:
            while len(kept) < want and len(sampled) < cap:
                seq, group = await self._next_collectable()
                del self._ready[seq]
                self.state.uncollected.discard(seq)
                if self.is_stale(group.min_version, step):
                    self.state.accepted -= 1
                    self.dropped_stale += 1
                    dropped += len(group.samples)
                    self._settled(seq, "dropped_stale")
                elif not informative(group):
                    self.state.accepted -= 1
                    self.discarded += 1
                    sampled.append(group)
                    self._settled(seq, "filtered")
                else:
                    kept.append((seq, group))
                    sampled.append(group)
                self._poke()
        except asyncio.CancelledError:  # the kept groups go back, in order: nothing taken is lost
            for seq, group in reversed(kept):
                self._ready[seq] = group
                self._ready.move_to_end(seq, last=False)
                self.state.uncollected.add(seq)
            raise
        self.trained += len(kept)
        return Taken([g for _, g in kept], sampled, dropped)

    async def _next_collectable(self) -> tuple[int, Group]:
        while True:
            for seq, group in self._ready.items():
                if self.strategy.collectable(seq, self.state):
                    return seq, group
            self._changed.clear()
            await self._changed.wait()

    def advance(self) -> None:
        """The new version is on the engines: v -> v + 1."""
        self.state.version += 1
        self._poke()

    def _settled(self, seq: int, fate: str) -> None:
        if self.on_settle is not None:
            self.on_settle(seq, fate)

    def _poke(self) -> None:
        self._changed.set()
