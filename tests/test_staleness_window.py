"""The sample buffer and its window strategies: hand-checked schedules and hypothesis properties."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.buffer import SampleBuffer
from loongsage.sample import Group, Sample
from loongsage.window import StalenessWindow, WindowedFifo


def _group(start_version: int, reward_spread: bool = True) -> Group:
    rewards = [0.0, 1.0] if reward_spread else [1.0, 1.0]
    samples = [Sample([1], [2], [1], [0.0], [start_version], reward=r) for r in rewards]
    return Group(samples, rewards, "default")


def _take(buf: SampleBuffer, step: int, want: int, informative=lambda g: True):
    return asyncio.run(buf.take(step, want, want * 4, informative))


def test_k0_is_the_synchronous_schedule():
    buf = SampleBuffer(max_staleness=0, batch_groups=4)
    assert buf.capacity() == 4
    seqs = [buf.admit() for _ in range(4)]
    assert buf.capacity() == 0
    with pytest.raises(RuntimeError, match="capacity"):
        buf.admit()
    for s in seqs:
        buf.put(s, _group(0))
    assert len(_take(buf, 1, 4).groups) == 4
    assert buf.capacity() == 0  # nothing new until the update is done
    buf.advance()
    assert buf.capacity() == 4


def test_k1_lets_one_batch_run_ahead_and_stale_groups_are_evicted():
    buf = SampleBuffer(max_staleness=1, batch_groups=2)
    assert buf.capacity() == 4
    assert not buf.is_stale(min_version=0, step=2) and buf.is_stale(min_version=0, step=3)
    seqs = [buf.admit() for _ in range(4)]
    buf.put(seqs[0], _group(0, reward_spread=False))
    taken = asyncio.run(buf.take(1, 1, 1, lambda g: len(set(g.rewards)) > 1))  # uninformative: discarded
    assert taken.groups == [] and buf.discarded == 1 and buf.capacity() == 1  # its place is given back
    buf.put(seqs[1], _group(0))
    buf.advance()
    buf.advance()  # version 2: a group from version 0 is too old at step 3
    assert buf.too_old() == [seqs[2], seqs[3]]  # the running ones can no longer make it either
    buf.cancel(seqs[2])
    buf.fail(seqs[3])
    fresh = _group(2)
    buf.put(buf.admit(), fresh)
    taken = asyncio.run(buf.take(3, 1, 1, lambda g: True))  # evicts the stale one on the way
    assert taken.groups == [fresh] and taken.dropped_samples == 2 and buf.dropped_stale == 1
    assert buf.counts() == {"running": 0, "buffered": 0, "trained": 1, "dropped_stale": 1, "discarded": 1,
                            "cancelled": 1, "failed": 1}


def test_max_inflight_caps_running_groups():
    buf = SampleBuffer(max_staleness=3, batch_groups=2, max_inflight=3)
    for _ in range(3):
        buf.admit()
    assert buf.capacity() == 0


def test_windowed_fifo_takes_only_within_b_of_the_oldest_uncollected():
    """Groups 0..5 admitted with B = 2: 3, 4 and 5 finish first, but only groups within 2 of the
    oldest uncollected (0) may be taken, so the trainer waits for 0 and 1 instead of running ahead
    with the fast ones; then the window moves on as its oldest groups are taken."""
    buf = SampleBuffer(max_staleness=2, batch_groups=2, strategy=WindowedFifo())
    seqs = [buf.admit() for _ in range(6)]
    for s in (3, 4, 5):
        buf.put(seqs[s], _group(0))
    assert buf.collectable() == 0

    async def scenario():
        waiting = asyncio.create_task(buf.take(1, 2, 8, lambda g: True))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing collectable: it waits (the default strategy would not)
        buf.put(seqs[1], _group(0))  # within the window
        await asyncio.sleep(0.01)
        assert not waiting.done()  # one of two
        buf.put(seqs[0], _group(0))
        return await waiting
    taken = asyncio.run(scenario())
    assert len(taken.groups) == 2 and buf.collectable() == 1  # head 2 (running): only 3 is inside
    buf.put(seqs[2], _group(0))
    assert buf.collectable() == 2  # 2 and 3
    assert len(_take(buf, 2, 2).groups) == 2 and buf.collectable() == 2  # head 4: 4 and 5


def test_the_default_strategy_takes_in_finish_order():
    buf = SampleBuffer(max_staleness=2, batch_groups=2, strategy=StalenessWindow())
    seqs = [buf.admit() for _ in range(4)]
    groups = {s: _group(0) for s in seqs}
    for s in (3, 1, 2, 0):
        buf.put(s, groups[s])
    taken = _take(buf, 1, 2)
    assert taken.groups == [groups[3], groups[1]]


def test_a_cancelled_take_gives_back_what_it_held():
    buf = SampleBuffer(max_staleness=1, batch_groups=2)
    seqs = [buf.admit() for _ in range(2)]
    first = _group(0)
    buf.put(seqs[0], first)

    async def scenario():
        task = asyncio.create_task(buf.take(1, 2, 4, lambda g: True))
        await asyncio.sleep(0.01)  # holds the first, waits for the second
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(scenario())
    assert buf.buffered() == 1 and buf.trained == 0 and _take(buf, 1, 1).groups == [first]


@settings(max_examples=300, deadline=None)
@given(k=st.integers(0, 3), batch=st.integers(1, 4), ops=st.lists(st.integers(0, 99), min_size=1, max_size=300),
       inflight=st.one_of(st.none(), st.integers(1, 8)), fifo=st.booleans())
def test_window_is_never_exceeded_and_every_group_is_accounted_for(k, batch, ops, inflight, fifo):
    """A random interleaving of admissions, completions (in any order), failures, training steps
    (taking what may be taken, some of it uninformative) and cancellations: no trained group is ever
    staler than k; windowed FIFO never takes beyond B of the oldest uncollected; every admitted
    group ends up running, buffered, trained, evicted, discarded, cancelled or failed, never lost."""
    buf = SampleBuffer(max_staleness=k, batch_groups=batch, max_inflight=inflight,
                       strategy=WindowedFifo() if fifo else StalenessWindow())
    running: dict[int, int] = {}  # seq -> start version
    admitted = 0
    for op in ops:
        kind = op % 5
        if kind == 0 and buf.capacity() > 0:
            seq = buf.admit()
            running[seq] = buf.version
            admitted += 1
        elif kind == 1 and running:
            seq = sorted(running)[op % len(running)]  # groups finish in any order
            buf.put(seq, _group(running.pop(seq), reward_spread=op % 3 != 0))
        elif kind == 2 and running and op % 7 == 0:
            buf.fail(sorted(running)[op % len(running)])
            running = {s: v for s, v in running.items() if s in buf.state.running}
        elif kind == 3:
            step = buf.version + 1
            # take() evicts stale groups without counting them as looked at and waits for others to
            # finish: with no producer here, ask only for what the fresh collectable groups can give.
            # (Stale ones exist: a discarded group frees its place, which the next version's
            # admission can fill beyond what the trainer then takes.)
            ready = sum(buf.strategy.collectable(s, buf.state) and not buf.is_stale(g.min_version, step)
                        for s, g in buf._ready.items())
            if ready:
                head = buf.state.oldest_uncollected()
                seqs_before = dict(buf._ready)
                taken = asyncio.run(buf.take(step, min(batch, ready), ready, lambda g: len(set(g.rewards)) > 1))
                for g in taken.groups:
                    assert (step - 1) - g.min_version <= k  # the window holds for everything trained
                    if fifo:
                        seq = next(s for s, grp in seqs_before.items() if grp is g)
                        assert seq - head < batch
                buf.advance()
                for seq in buf.too_old():
                    running.pop(seq)
                    buf.cancel(seq)
        assert buf.running == len(running)
        assert buf.running + buf.state.accepted <= (k + 1 + buf.version) * batch
        c = buf.counts()
        assert admitted == sum(c.values())
