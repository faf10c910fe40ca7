"""The staleness window: hand-checked schedules and hypothesis properties."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.buffer import StalenessWindow


def test_k0_is_the_synchronous_schedule():
    w = StalenessWindow(max_staleness=0, batch_groups=4)
    assert w.capacity() == 4
    w.admit(4)
    assert w.capacity() == 0
    for _ in range(4):
        w.finish()
    w.consume(4)
    assert w.capacity() == 0  # nothing new until the update is done
    w.advance()
    assert w.capacity() == 4


def test_k1_lets_one_batch_run_ahead_and_stale_groups_are_detected():
    w = StalenessWindow(max_staleness=1, batch_groups=2)
    assert w.capacity() == 4
    assert not w.is_stale(min_version=0, step=2) and w.is_stale(min_version=0, step=3)
    w.admit(4)
    with pytest.raises(RuntimeError):
        w.admit(1)
    w.finish()
    w.discard()  # an uninformative group gives its place back
    assert w.capacity() == 1
    w.max_inflight = 3
    assert w.capacity() == 0  # 3 still running


@settings(max_examples=300, deadline=None)
@given(k=st.integers(0, 3), batch=st.integers(1, 4), ops=st.lists(st.integers(0, 99), min_size=1, max_size=300),
       inflight=st.one_of(st.none(), st.integers(1, 8)))
def test_window_is_never_exceeded_and_every_group_is_accounted_for(k, batch, ops, inflight):
    """A random interleaving of admissions, completions (in any order), training steps and
    cancellations: no trained group is ever staler than k, and every admitted group ends up
    running, buffered, trained, evicted, discarded, cancelled or failed — never lost."""
    w = StalenessWindow(max_staleness=k, batch_groups=batch, max_inflight=inflight)
    running: list[int] = []  # start version of each running group
    buffered: list[int] = []
    admitted = trained = 0
    for op in ops:
        kind = op % 5
        if kind == 0 and w.capacity() > 0:
            w.admit()
            running.append(w.version)
            admitted += 1
        elif kind == 1 and running:
            start = running.pop(op % len(running))  # groups finish in any order
            w.finish()
            buffered.append(start)
        elif kind == 2 and running and op % 7 == 0:
            running.pop(op % len(running))
            w.fail()
        elif kind == 4 and buffered and op % 3 == 0:
            buffered.pop(0)  # uninformative (dynamic sampling): dropped, and its place freed
            w.discard()
        elif kind == 3 and len(buffered) >= batch:
            step = w.version + 1
            batch_groups = []
            while buffered and len(batch_groups) < batch:
                start = buffered.pop(0)
                if w.is_stale(start, step):
                    w.evict()
                else:
                    batch_groups.append(start)
            for start in batch_groups:
                assert (step - 1) - start <= k  # the window holds for everything trained
            w.consume(len(batch_groups))
            trained += len(batch_groups)
            w.advance()
            for start in [s for s in running if w.in_flight_too_old(s)]:
                running.remove(start)
                w.cancel()
        assert w.running == len(running)
        assert w.running + w.accepted <= (k + 1 + w.version) * batch
        assert admitted == (len(running) + len(buffered) + trained + w.dropped_stale + w.cancelled
                            + w.failed + w.discarded)
