"""The rollout producer: keeps groups generating inside the staleness window.

It admits a prompt whenever the buffer has room, runs its group (n samples + rewards) as its own
task, and puts the outcome into the buffer (finished, failed or cancelled): it only puts, the
controller only takes. At a weight update the controller asks it to cancel in-flight groups that
can no longer be trained in time: their requests are aborted on the engines that hold them, their
tasks cancelled; partial work is counted, not trained. A group the inference system failed (a
rollout `aborted`, or the group raised an engine error) is never trained nor scored as the agent's
failure: it is counted (`samples/aborted_by_system`, per rollout) and its prompt's slot goes to a
new group.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time

from loongsage.buffer import SampleBuffer
from loongsage.controller.sampler import PromptSampler
from loongsage.rollout.resume import system_failure
from loongsage.timeline import Timeline

log = logging.getLogger("loongsage.producer")


class BusyClock:
    """Cumulative seconds during which at least one unit of work was active (and those intervals
    on a timeline, when one is given)."""

    def __init__(self, timeline: Timeline | None = None, track: str = "engines: generate") -> None:
        self.active, self.total, self._since = 0, 0.0, 0.0
        self.timeline, self.track = timeline, track

    def start(self) -> None:
        if self.active == 0:
            self._since = time.perf_counter()
        self.active += 1

    def stop(self) -> None:
        self.active -= 1
        if self.active == 0:
            now = time.perf_counter()
            self.total += now - self._since
            if self.timeline is not None:
                self.timeline.add(self.track, "generate", self._since, now)

    def now(self) -> float:
        return self.total + (time.perf_counter() - self._since if self.active else 0.0)


class RolloutProducer:
    def __init__(self, rollout, sampler: PromptSampler, buffer: SampleBuffer, n: int, mask_failures: bool = True,
                 timeline: Timeline | None = None, source: str = "default", after_group=None, seed: int | None = None):
        """`rollout`: an `api.Rollout` (group / cancel); `mask_failures`: a group with a failed
        sample is not trained (single-turn aborts, or agent.on_failure=mask); `source`: the data
        source its groups are marked with; `after_group`: an async step each finished group goes
        through before it is buffered (the teachers' scoring), still inside the group's task; `seed`:
        the source's base of the per-prompt sampling seeds (None: unseeded)."""
        self.rollout, self.sampler, self.buffer = rollout, sampler, buffer
        self.n, self.mask_failures, self.source, self.after_group = n, mask_failures, source, after_group
        self.busy = BusyClock(timeline)
        self.cancelling: set[int] = set()
        self._tasks: dict[int, asyncio.Task] = {}
        self.counts = {"aborted_by_system": 0, "resumed_after_abort": 0}  # since the last `take_counts`
        self.seed = seed
        self._seeded = seed is not None and "seed" in inspect.signature(rollout.group).parameters
        self.cursor_of: dict[int, int] = {}  # seq -> the sampler cursor of its prompt, until its fate
        self.ledger = None  # a PromptLedger (controller/ledger.py), or None
        self.skip: set[int] = set()  # cursors settled before the checkpoint a resumed run started from
        self.admitting = asyncio.Event()  # cleared while a held-out evaluation has the engines (sources.py)
        self.admitting.set()
        buffer.on_settle = self.settle  # evicted stale, or filtered when taken

    def settle(self, seq: int, fate: str, step: int | None = None) -> None:
        """Group `seq` met its fate (ledger.FATES) at `step` (default: the current version)."""
        cursor = self.cursor_of.pop(seq, None)
        if cursor is not None and self.ledger is not None:
            self.ledger.settle(self.source, cursor, fate, self.buffer.version if step is None else step)

    def resume_cursor(self) -> int:
        """Where a resumed run's sampler starts: the prompt of the oldest group without a fate
        (generating, buffered, or taken for a batch not yet trained: drawn again), else the next."""
        return min(self.cursor_of.values(), default=self.sampler.taken)

    def group_seed(self, cursor: int) -> int | None:
        """The sampling seed of prompt instance `cursor` (sample j of its group: seed + j)."""
        return None if not self._seeded else (self.seed * 1_000_003 + cursor * 1024) % 2**31

    def take_counts(self) -> dict[str, int]:
        """Rollouts the system aborted (masked) and model calls continued after an abort, since the
        last call."""
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return out

    async def run(self) -> None:
        while True:
            await self.buffer.wait_for_room()
            await self.admitting.wait()
            row, cursor = self.sampler.take(1)[0], self.sampler.taken - 1
            if cursor in self.skip:  # settled before the checkpoint this run resumed from
                self.skip.discard(cursor)
                continue
            seq = self.buffer.admit()
            self.cursor_of[seq] = cursor
            task = asyncio.create_task(self._one(seq, row, self.group_seed(cursor)))
            self._tasks[seq] = task
            task.add_done_callback(lambda _, s=seq: self._tasks.pop(s, None))

    async def _one(self, seq: int, row, seed: int | None = None) -> None:
        self.busy.start()
        stopped = False
        try:
            group = await (self.rollout.group(row, self.n, seq, seed=seed) if seed is not None
                           else self.rollout.group(row, self.n, seq))
            group.source, group.seq = self.source, seq
            for s in group.samples:
                s.source = self.source
            self.busy.stop()
            stopped = True
            self.counts["resumed_after_abort"] += group.stats.get("resumed_calls", 0)
            if self.after_group is not None and seq not in self.cancelling and not self._masked(group):
                await self.after_group(group)
        except asyncio.CancelledError:  # cancelled at a weight update (or the run is stopping)
            self.cancelling.discard(seq)
            self.buffer.cancel(seq)
            self.settle(seq, "cancelled")
            raise
        except Exception as exc:  # a broken request must not stop the run
            log.warning("group %d of %s failed: %s", seq, self.source, exc)
            system = system_failure(exc) is not None
            if system:
                self.counts["aborted_by_system"] += self.n
            self.buffer.fail(seq)
            self.settle(seq, "aborted" if system else "failed")
            return
        finally:
            if not stopped:
                self.busy.stop()
        if seq in self.cancelling:
            self.cancelling.discard(seq)
            self.buffer.cancel(seq)
            self.settle(seq, "cancelled")
        elif self._masked(group):
            self.counts["aborted_by_system"] += group.aborted
            self.buffer.fail(seq)
            self.settle(seq, "aborted" if group.aborted else "failed")
        else:
            self.buffer.put(seq, group)

    def _masked(self, group) -> bool:
        return bool(group.aborted or (group.failed and self.mask_failures))

    async def cancel_too_old(self) -> int:
        """Stops in-flight groups that would be out of the window at the next step."""
        old = [s for s in self.buffer.too_old() if s not in self.cancelling]
        for seq in old:
            self.cancelling.add(seq)
            await self.rollout.cancel(seq)  # on the engines that hold its requests
            task = self._tasks.get(seq)
            if task is not None:  # an agent may go on calling the model: its episodes are stopped too
                task.cancel()
        return len(old)

    async def stop(self) -> None:
        """Cancels the groups in flight; every group still without a fate (buffered, or taken for a
        batch that will not train) is `cancelled` in the ledger."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for seq in list(self.cursor_of):
            self.settle(seq, "cancelled")
