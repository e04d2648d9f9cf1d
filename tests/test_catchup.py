"""Catch-up after an outage, with an injected clock: a relay down for three
simulated days, the misfire policies' exact counts, the catch-up rate limit,
priority-first draining, expiry, and never a dispatch before the due time."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import duebox
from duebox import FakeClock, JobMessage, JobState, Settings
from duebox.brokers.base import (
    BrokerContext,
    Delivery,
    Outgoing,
    PublishingBroker,
    PublishResult,
)
from duebox.brokers.memory import MemoryBroker
from duebox.relay import Relay
from duebox.tables import job, schedule

T0 = datetime(2030, 1, 1, tzinfo=UTC)
RATE = 40.0


class RecordingBroker(PublishingBroker):
    """Accepts every message and records (clock time, delay, message)."""

    capabilities = replace(MemoryBroker.capabilities, name="recording")

    def __init__(self, url: str, context: BrokerContext, max_delay: float | None = None) -> None:
        self.capabilities = replace(self.capabilities, max_delay=max_delay)
        super().__init__(url, context)
        self.log: list[tuple[datetime, float, JobMessage]] = []

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        now = self.context.clock.now()
        self.log.extend((now, out.delay, out.message) for out in batch)
        return [PublishResult(out.message.job_id, True) for out in batch]

    def consume(self, queues: Sequence[str], prefetch: int,
                wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        raise NotImplementedError


_APPS: list[duebox.Duebox] = []


@pytest.fixture(autouse=True)
def _dispose() -> Iterator[None]:
    yield
    while _APPS:
        _APPS.pop().dispose()


def make(url: str, clock: FakeClock, max_delay: float | None = None, **settings: Any
         ) -> tuple[duebox.Duebox, Relay, RecordingBroker]:
    values: dict[str, Any] = {"poll_interval": 1.0, "batch_size": 100, "catchup_rate": RATE,
                              "catchup_after": 60.0, "misfire_grace": 10.0}
    values.update(settings)
    app = duebox.Duebox(url, "sql://", clock=clock, settings=Settings(**values))
    _APPS.append(app)
    app.add_task("tick", lambda payload, ctx: None)
    app.add_task("late", lambda payload, ctx: None, max_lateness=62)
    broker = RecordingBroker("recording://", BrokerContext(app.engine, clock, app.settings),
                             max_delay)
    # Recovery (and the expiry sweep) on the first pass only: later expiries
    # must come from the claim path.
    relay = Relay(app, broker=broker, recover_interval=3600)
    return app, relay, broker


def check_never_early(broker: RecordingBroker) -> None:
    """Invariant 1 at the publish: visible no earlier than the due time."""
    for now, delay, msg in broker.log:
        assert now + timedelta(seconds=delay) >= msg.due_at, msg.job_id


def check_rate(broker: RecordingBroker, relay: Relay, start: datetime) -> int:
    """Overdue releases never exceed the token bucket: burst + rate x elapsed."""
    (pipeline,) = relay.pipelines
    after = pipeline.catchup.after
    times = sorted(now for now, _, msg in broker.log
                   if msg.due_at <= now - timedelta(seconds=after))
    for i, t in enumerate(times):
        bucket = pipeline.catchup.bucket
        allowed = bucket.burst + bucket.rate * (t - start).total_seconds()
        assert i + 1 <= allowed + 1e-6, f"{i + 1} overdue jobs released by {t}"
    return len(times)


def states(app: duebox.Duebox) -> dict[str, int]:
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(job.c.state, sa.func.count()).group_by(job.c.state))
        return {str(s): int(n) for s, n in rows}


@pytest.mark.parametrize(("misfire", "outage_runs"),
                         [("fire_all", 3 * 24 * 60), ("fire_once", 1), ("skip", 0)])
async def test_three_days_down_with_a_one_minute_schedule(
    database_url: str, misfire: str, outage_runs: int
) -> None:
    clock = FakeClock(T0)
    app, relay, broker = make(database_url, clock)
    with Session(app.engine) as s, s.begin():
        sid = app.schedules.add(s, "every-minute", "tick", "* * * * *", misfire=misfire)
    await relay.run_pass()
    assert broker.log == []
    (pipeline,) = relay.pipelines

    clock.advance(3 * 86400 + 30)  # the relay is down for three days
    restart = clock.now()
    end = restart + timedelta(minutes=4)
    throttled_waits = []
    while clock.now() < end:
        await relay.run_pass()
        busy = pipeline.catchup.throttled or relay.schedules.pending
        if pipeline.catchup.throttled and not relay.schedules.pending:
            throttled_waits.append(pipeline.seconds_until_next())
        clock.advance(1 if busy else 10)

    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(job.c.nominal_fire_at, job.c.state, job.c.id)
                            .where(job.c.schedule_id == sid)
                            .order_by(job.c.nominal_fire_at)).all()
        cursor = conn.execute(sa.select(schedule.c.next_fire_at)).scalar()
    outage = [r.nominal_fire_at for r in rows if r.nominal_fire_at <= T0 + timedelta(days=3)]
    after = [r.nominal_fire_at for r in rows if r.nominal_fire_at > T0 + timedelta(days=3)]
    # Exactly what the policy promises for the outage...
    assert len(outage) == outage_runs
    if misfire == "fire_once":
        assert outage == [T0 + timedelta(days=3)]  # the most recent missed fire time
    if misfire == "fire_all":
        assert outage == [T0 + timedelta(minutes=m) for m in range(1, outage_runs + 1)]
    # ...and every minute since, on time, none missing and none twice.
    assert after == [T0 + timedelta(days=3, minutes=m) for m in range(1, 5)]
    assert cursor == T0 + timedelta(days=3, minutes=5)
    assert len({r.id for r in rows}) == len(rows)
    assert all(r.state == JobState.ENQUEUED for r in rows)
    published = [msg.job_id for _, _, msg in broker.log]
    assert sorted(published) == sorted(r.id for r in rows)  # each exactly once

    check_never_early(broker)
    check_rate(broker, relay, restart)
    outage_ids = {r.id for r in rows if r.nominal_fire_at <= T0 + timedelta(days=3)}
    assert len(outage_ids & set(published)) == outage_runs
    if misfire == "fire_all":
        # 4320 jobs at 40/s take 108 s: the limit really was in force, and the
        # relay slept for tokens instead of spinning.
        last = max(now for now, _, msg in broker.log if msg.due_at <= T0 + timedelta(days=3))
        assert (last - restart).total_seconds() >= outage_runs / RATE - 2
        assert throttled_waits
        assert min(throttled_waits) > 0


@pytest.mark.parametrize("max_delay", [None, 900.0])
async def test_backlog_drains_most_urgent_first_and_drops_what_is_too_late(
    database_url: str, max_delay: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(T0)
    app, relay, broker = make(database_url, clock, max_delay=max_delay, catchup_rate=50.0)
    outage = timedelta(days=2)
    ids: dict[str, list[uuid.UUID]] = {k: [] for k in
                                       ("urgent", "normal", "late", "expiring", "future")}
    with app.engine.begin() as conn:

        def put(kind: str, task: str = "tick", **kw: Any) -> None:
            job_id = app.schedule(conn, task, **kw)
            assert isinstance(job_id, uuid.UUID)
            ids[kind].append(job_id)

        for i in range(120):
            put("normal", at=T0 + timedelta(seconds=i))
        for i in range(30):
            put("urgent", at=T0 + timedelta(hours=1, seconds=i), priority=9)
        for _ in range(10):  # overdue by 61 s at restart; too late (62 s) three passes later
            put("late", "late", at=T0 + outage - timedelta(seconds=61), priority=-1)
        for _ in range(5):
            put("expiring", at=T0 + timedelta(minutes=5), priority=5,
                expires_at=T0 + timedelta(minutes=30))
        for i in range(3):  # due after the restart: within reach of either broker
            put("future", at=T0 + outage + timedelta(minutes=10 + i))

    clock.advance(outage.total_seconds())
    restart = clock.now()
    with caplog.at_level(logging.WARNING, logger="duebox.relay"):
        first = await relay.run_pass()
    assert "catch-up: 160 overdue jobs and 0 schedules" in caplog.text
    overdue_first = {msg.job_id for now, _, msg in broker.log
                     if msg.due_at <= now - timedelta(seconds=60)}
    # One bounded batch of 50 (one second of tokens): every urgent job first,
    # then the oldest normal ones.
    assert len(overdue_first) == 50
    assert set(ids["urgent"]) <= overdue_first
    assert overdue_first - set(ids["urgent"]) == set(ids["normal"][:20])
    assert first.caught_up == 50
    assert first.expired == 5  # past expires_at: swept before anything was claimed
    (pipeline,) = relay.pipelines
    assert pipeline.catchup.throttled
    assert pipeline.seconds_until_next() > 0  # waits for tokens, does not spin

    for _ in range(10):
        clock.advance(1)
        await relay.run_pass()

    published = {msg.job_id for _, _, msg in broker.log}
    assert set(ids["normal"]) | set(ids["urgent"]) <= published
    assert not (set(ids["late"]) | set(ids["expiring"])) & published  # never run
    with app.engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(sa.select(job))}
    assert {rows[i].state for i in ids["late"] + ids["expiring"]} == {JobState.EXPIRED}
    assert set(ids["future"]) <= published  # handed over with the remaining delay
    check_never_early(broker)
    assert check_rate(broker, relay, restart) == 150
    assert states(app) == {"ENQUEUED": 153, "EXPIRED": 15}


async def test_steady_state_jobs_are_not_throttled(database_url: str) -> None:
    """Jobs due within ``catchup_after`` bypass the catch-up limit."""
    clock = FakeClock(T0)
    app, relay, broker = make(database_url, clock, catchup_rate=1.0)
    with app.engine.begin() as conn:
        for i in range(90):
            app.schedule(conn, "tick", at=T0 - timedelta(seconds=i % 30))
    stats = await relay.run_pass()
    assert (stats.published, stats.caught_up) == (90, 0)
    check_never_early(broker)
