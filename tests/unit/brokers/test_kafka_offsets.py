"""duebox.brokers.kafka_offsets: what a ``kafka://`` consumer may commit.
Messages of a partition finish out of order; the offset committed is the
lowest one received and not finished (or the next after the last
received), and a partition that moved to another consumer meanwhile
takes no finish from before; an end offset below the position is a
truncation only when the partition no longer reaches it, fetched.
(Committing against a broker is tests/test_kafka_broker.py's, and
tests/test_kafka_tansu.py's on a broker whose end offset lags.)"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

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


class Consumer:
    """What the tracker asks of a consumer: end offsets, and a commit."""

    def __init__(self, end: int) -> None:
        self.end = end
        self.commits: list[dict[Any, int]] = []

    async def end_offsets(self, tps: list[Any]) -> dict[Any, int]:
        return dict.fromkeys(tps, self.end)

    async def commit(self, offsets: dict[Any, Any]) -> None:
        self.commits.append({tp: o.offset for tp, o in offsets.items()})


def finished_up_to(t: OffsetTracker, upto: int) -> None:
    for offset in range(upto):
        t.finished(TP, offset, t.received(TP, offset))


async def test_an_end_offset_below_the_position_is_confirmed_by_a_fetch() -> None:
    asked: list[dict[Any, int]] = []
    reaches = True

    async def reaching(wanted: Mapping[Any, int]) -> set[Any]:
        asked.append(dict(wanted))
        return set(wanted) if reaches else set()

    t = OffsetTracker(asyncio.Event(), reaching=reaching)
    t.consumer = consumer = Consumer(end=1)  # tansu: the newest batch's base + 1
    finished_up_to(t, 5)
    await t.commit()
    assert asked == [{TP: 4}]  # the last record read
    assert consumer.commits == [{TP: 5}]
    assert not t.truncated
    reaches = False  # gone: the topic was deleted, the cluster replaced
    finished_up_to(t, 8)
    await t.commit()
    assert t.truncated
    assert consumer.commits == [{TP: 5}]


async def test_an_end_offset_at_the_position_asks_nothing() -> None:
    async def reaching(wanted: Mapping[Any, int]) -> set[Any]:
        raise AssertionError("a Kafka's end offset is trusted as it is")

    t = OffsetTracker(asyncio.Event(), reaching=reaching)
    t.consumer = consumer = Consumer(end=5)
    finished_up_to(t, 5)
    await t.commit()
    assert consumer.commits == [{TP: 5}]
