"""duebox.brokers.kafka_offsets: what a ``kafka://`` consumer may commit.
Messages of a partition finish out of order; the offset committed is the
lowest one received and not finished (or the next after the last
received), and a partition that moved to another consumer meanwhile
takes no finish from before.  (Committing against a broker is
tests/test_kafka_broker.py's.)"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from duebox.brokers.kafka_offsets import OffsetTracker

TP, OTHER = ("orders", 0), ("orders", 1)


def tracker() -> OffsetTracker:
    return OffsetTracker(asyncio.Event())


def positions(t: OffsetTracker) -> dict[object, int]:
    return {tp: pos for tp, (_, pos) in t.to_commit().items()}


def test_out_of_order_finishes_commit_only_below_the_first_unfinished() -> None:
    t = tracker()
    gen = [t.received(TP, offset) for offset in (10, 11, 12)]
    assert len(set(gen)) == 1
    assert positions(t) == {TP: 10}
    assert t.finished(TP, 12, gen[0])
    assert t.finished(TP, 11, gen[0])
    assert positions(t) == {TP: 10}  # 10 still runs
    assert t.finished(TP, 10, gen[0])
    assert positions(t) == {TP: 13}
    assert t.dirty.is_set()


def test_partitions_are_counted_apart() -> None:
    t = tracker()
    t.received(TP, 5)
    g = t.received(OTHER, 100)
    t.finished(OTHER, 100, g)
    assert positions(t) == {TP: 5, OTHER: 101}
    assert set(t.to_commit([OTHER])) == {OTHER}


def test_a_finish_from_before_a_rebalance_counts_for_nothing() -> None:
    t = tracker()
    old = t.received(TP, 7)
    t.parts.pop(TP)  # revoked (on_partitions_revoked), then assigned again
    new = t.received(TP, 7)
    assert new != old
    assert t.finished(TP, 7, old) is False
    assert positions(t) == {TP: 7}
    assert t.finished(OTHER, 1, new) is False  # never assigned here


def test_what_was_committed_is_not_committed_again() -> None:
    t = tracker()
    g = t.received(TP, 1)
    t.finished(TP, 1, g)
    part, pos = t.to_commit()[TP]
    part.committed = pos
    assert t.to_commit() == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=30, unique=True),
       st.data())
def test_the_position_never_passes_an_unfinished_offset(received: list[int],
                                                        data: st.DataObject) -> None:
    t = tracker()
    gen = 0
    for offset in received:
        gen = t.received(TP, offset)
    done = data.draw(st.sets(st.sampled_from(received)))
    for offset in done:
        t.finished(TP, offset, gen)
    pending = set(received) - done
    assert positions(t)[TP] == (min(pending) if pending else max(received) + 1)
