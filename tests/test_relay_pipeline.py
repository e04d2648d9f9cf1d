"""The pipelined relay: the mark of a confirmed batch rides in the next
claim's transaction (``dispatched.mark_and_claim``; one statement on
PostgreSQL).  The fold must keep the mark's fence: a stale relay's mark
changes nothing, and the claim beside it still happens."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from helpers import make_app, memory_url, wait_for

import duebox
from duebox import FakeClock, JobState
from duebox.brokers.base import BrokerContext, Outgoing, PublishResult
from duebox.brokers.memory import MemoryBroker
from duebox.errors import BrokerError, DatabaseError
from duebox.leases import claims, jobstore, recovery
from duebox.leases.dispatch_marks import mark_and_claim
from duebox.relay import Relay
from duebox.tables import job

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def app(database_url: str) -> Iterator[duebox.Duebox]:
    a = make_app(database_url, clock=FakeClock(T0))
    yield a
    a.dispose()


def add(app: duebox.Duebox, n: int, delay: float = 0.0) -> list[uuid.UUID]:
    with app.engine.begin() as conn:
        return [app.schedule(conn, "noop", delay=delay) for _ in range(n)]  # type: ignore[misc]


def rows(app: duebox.Duebox, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str | None]]:
    with app.engine.connect() as conn:
        got = conn.execute(sa.select(job.c.id, job.c.state, job.c.lease_owner)
                           .where(job.c.id.in_(list(ids)))).all()
    return {r.id: (str(r.state), r.lease_owner) for r in got}


def claim(app: duebox.Duebox, owner: str, *, now: float, limit: int = 100,
          marks: Sequence[tuple[str, Sequence[uuid.UUID]]] = (),
          fence: sa.ColumnElement[bool] | None = None,
          ) -> tuple[list[int], list[jobstore.JobRecord]]:
    with app.engine.begin() as conn:
        return mark_and_claim(
            conn, marks=marks, owner=owner, horizon=at(now), limit=limit, now=at(now),
            lease_until=at(now + 30), fence=fence)


def test_folded_mark_of_a_stale_owner_changes_nothing(app: duebox.Duebox) -> None:
    """Relay A claimed and published, stalled past its lease; recovery gave the
    jobs to relay B.  A's late mark, folded into its next claim, must leave
    B's lease alone (B publishes and marks them itself) — and A's claim of
    other jobs still happens in the same statement."""
    first = add(app, 3)
    _, recs = claim(app, "A#1", now=1)
    assert {r.id for r in recs} == set(first)
    with app.engine.begin() as conn:  # A's lease expired: back to SCHEDULED
        assert recovery.recover(conn, now=at(40), margin=1, redeliver_after=900,
                                limit=100).dispatching == 3
    _, recs = claim(app, "B#1", now=41)
    assert {r.id for r in recs} == set(first)
    later = add(app, 2)

    counts, recs = claim(app, "A#2", now=42, marks=[("A#1", first)])

    assert counts == [0]
    assert {r.id for r in recs} == set(later)
    assert all(r.lease_owner == "A#2" for r in recs)
    assert rows(app, first) == dict.fromkeys(first, (JobState.DISPATCHING, "B#1"))

    # B's own mark, folded the same way, does mark them.
    counts, recs = claim(app, "B#2", now=43, marks=[("B#1", first)])
    assert counts == [3]
    assert recs == []
    assert rows(app, first) == dict.fromkeys(first, (JobState.ENQUEUED, None))


def test_folded_mark_keeps_the_shard_fence(app: duebox.Duebox) -> None:
    """A sharded relay's fence (its shard generation, still current) is on the
    folded mark as on the plain one: a lost shard marks nothing."""
    ids = add(app, 2)
    claim(app, "A#1", now=1)
    lost = job.c.shard < 0  # what ShardOwner.fence() is once nothing is owned
    counts, _ = claim(app, "A#2", now=2, marks=[("A#1", ids)], fence=lost)
    assert counts == [0]
    assert rows(app, ids) == dict.fromkeys(ids, (JobState.DISPATCHING, "A#1"))


def test_several_marks_and_an_empty_claim(app: duebox.Duebox) -> None:
    a, b = add(app, 2), add(app, 3)
    with app.engine.begin() as conn:
        claims.claim_for_dispatch(conn, owner="R#1", horizon=at(1), limit=2, now=at(1),
                                    lease_until=at(30))
        claims.claim_for_dispatch(conn, owner="R#2", horizon=at(1), limit=3, now=at(1),
                                    lease_until=at(30))
    assert {o for _, o in rows(app, a).values()} == {"R#1"}
    counts, recs = claim(app, "R#3", now=2, marks=[("R#1", a), ("R#x", b), ("R#2", b)])
    assert counts == [2, 0, 3]
    assert recs == []
    assert {s for s, _ in rows(app, a + b).values()} == {JobState.ENQUEUED}


class Recording(MemoryBroker):
    """memory://, recording each publish, failing the ``fail_at``-th,
    each taking ``seconds``."""

    fail_at: int | None = None
    seconds = 0.0

    def __init__(self, url: str, context: BrokerContext) -> None:
        super().__init__(url, context)
        self.batches: list[list[uuid.UUID]] = []

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        self.batches.append([o.message.job_id for o in batch])
        await asyncio.sleep(self.seconds)
        if self.fail_at is not None and len(self.batches) == self.fail_at:
            raise BrokerError("broker down")
        return await super().publish(batch)


def recording_relay(app: duebox.Duebox, batch: int) -> tuple[Relay, Recording]:
    ctx = BrokerContext(app.engine, app.clock, app.settings, "relay")
    broker = Recording(f"memory://pipeline-{uuid.uuid4().hex[:8]}", ctx)
    return Relay(app, broker=broker, batch_size=batch), broker


async def test_pipelined_pass_publishes_and_marks_every_batch(app: duebox.Duebox) -> None:
    ids = add(app, 23)
    relay, broker = recording_relay(app, 5)
    stats = await relay.run_pass()
    assert (stats.claimed, stats.published, stats.marked, stats.lost_marks) == (23, 23, 23, 0)
    assert [len(b) for b in broker.batches] == [5, 5, 5, 5, 3]
    assert rows(app, ids) == dict.fromkeys(ids, (JobState.ENQUEUED, None))
    assert relay.pipelines[0]._unmarked == []


async def test_publish_failure_releases_the_batch_claimed_meanwhile(
        app: duebox.Duebox) -> None:
    """Batch 2 fails while batch 3 is already claimed: both go back to
    SCHEDULED at once, batch 1 (confirmed) is still marked."""
    ids = add(app, 15)
    relay, broker = recording_relay(app, 5)
    broker.fail_at = 2
    with pytest.raises(BrokerError):
        await relay.run_pass()
    states = rows(app, ids)
    first = set(broker.batches[0])
    assert {states[i] for i in first} == {(JobState.ENQUEUED, None)}
    assert {states[i] for i in ids if i not in first} == {(JobState.SCHEDULED, None)}
    assert relay.pipelines[0]._unmarked == []


async def test_claim_failure_still_marks_the_batch_being_published(
        app: duebox.Duebox, monkeypatch: pytest.MonkeyPatch) -> None:
    """The database fails the claim of batch 2 while batch 1 is at the
    broker: batch 1 is published and marked all the same, not left to its
    lease expiry."""
    ids = add(app, 10)
    relay, broker = recording_relay(app, 5)
    (pipeline,) = relay.pipelines
    real = pipeline.claim_and_mark
    calls = []

    def flaky(*args: object, **kw: object) -> object:
        if len(args) == 2:  # the pipeline's claims (owner, marks), not the catch-up's
            calls.append(args)
        if len(calls) == 2:
            raise DatabaseError("claim: connection lost")
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "claim_and_mark", flaky)
    with pytest.raises(DatabaseError):
        await relay.run_pass()
    states = rows(app, ids)
    first = set(broker.batches[0])
    assert len(broker.batches) == 1
    assert {states[i] for i in first} == {(JobState.ENQUEUED, None)}
    assert {states[i] for i in ids if i not in first} == {(JobState.SCHEDULED, None)}
    assert relay.pipelines[0]._unmarked == []


async def test_a_publish_slower_than_the_lease_is_left_to_the_pipeline_publishing_it(
        database_url: str) -> None:
    """The broker confirms each batch after twice the claim's lease.  The
    relay's own recovery (every 50 ms) runs meanwhile, beside its pipeline,
    and must leave that claim to the pipeline still publishing it: each job
    is claimed, published and marked once, none recovered, no mark lost.
    (Another relay's recovery does take it back: the claimer may be paused.)"""
    app = make_app(database_url, lease_seconds=0.4, clock_skew_margin=0.05)
    broker = Recording(memory_url(), BrokerContext(app.engine, app.clock, app.settings, "r"))
    broker.seconds = 1.0
    ids = add(app, 6)
    relay = Relay(app, broker=broker, batch_size=3, recover_interval=0.05)
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_for(lambda: set(rows(app, ids).values()) == {(JobState.ENQUEUED, None)},
                       timeout=30, what="every job published and marked",
                       check=lambda: running.result() if running.done() else None)
    finally:
        stop.set()
        await running
        app.dispose()
    t = relay.totals
    assert (t.claimed, t.published, t.marked, t.lost_marks, t.recovered) == (6, 6, 6, 0, 0), t
    assert sorted(i for batch in broker.batches for i in batch) == sorted(ids)
