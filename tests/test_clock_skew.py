"""Never early when a process's clock runs ahead: every due-time decision
follows the database server's clock (:class:`duebox.DatabaseClock`)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import reset_tables
from helpers import Running, job_rows, make_app, schedule_committed, us

import duebox
from duebox.clock import DatabaseClock, SystemClock

SKEW = timedelta(seconds=3)


class AheadClock(SystemClock):
    """This machine's clock, running ``SKEW`` ahead of the real time."""

    def now(self) -> datetime:
        return super().now() + SKEW


@pytest.fixture
def pg_url(pg_server_url: str) -> str:
    reset_tables(pg_server_url)
    return pg_server_url


def test_observe_keeps_a_lower_bound_from_the_tightest_reading() -> None:
    clock = DatabaseClock()
    t = datetime(2030, 1, 1, tzinfo=UTC)
    ms = timedelta(milliseconds=1)
    # The server said t+100ms somewhere between t and t+10ms: the offset kept
    # is server - after (90 ms), so now() can only lag the server.
    clock.observe(t, t + 100 * ms, t + 10 * ms)
    assert clock.offset == 90 * ms
    # A tighter reading (1 ms round trip) wins over a looser later one.
    clock.observe(t, t + 100 * ms, t + 1 * ms)
    clock.observe(t, t + 100 * ms, t + 50 * ms)
    assert clock.offset == 99 * ms
    # Naive server times (MariaDB's UTC_TIMESTAMP) are UTC.
    clock.observe(t, (t + 100 * ms).replace(tzinfo=None), t + 1 * ms)
    assert clock.offset == 99 * ms


def test_sqlite_has_no_server_clock_to_follow(tmp_path: Any) -> None:
    app = make_app(f"sqlite:///{tmp_path}/c.db", clock=DatabaseClock(AheadClock()))
    with app.engine.connect() as conn:
        app.clock.sync(conn)  # type: ignore[attr-defined]
    assert app.clock.offset == timedelta(0)  # type: ignore[attr-defined]
    app.dispose()


@pytest.mark.postgres
def test_a_clock_running_ahead_is_pulled_back_to_the_servers(pg_url: str) -> None:
    clock = DatabaseClock(AheadClock())
    app = make_app(pg_url, clock=clock)
    with app.engine.connect() as conn:
        clock.sync(conn)
        server = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    app.dispose()
    assert -SKEW - timedelta(seconds=1) < clock.offset < -SKEW + timedelta(seconds=1)
    assert clock.now() <= server + timedelta(seconds=1)


@pytest.mark.postgres
async def test_a_worker_whose_clock_runs_ahead_never_starts_early(pg_url: str) -> None:
    """The worker's and relay's clocks are 3 s fast; jobs due within the
    next 2 s must still start only at their due time by the database's
    clock (which the handler stamps)."""
    app = make_app(pg_url, clock=DatabaseClock(AheadClock()))
    started: dict[uuid.UUID, datetime] = {}

    @app.task("stamp")
    def stamp(payload: Any, ctx: duebox.JobContext) -> None:
        started[ctx.job_id] = ctx.session.execute(sa.text("SELECT clock_timestamp()")).scalar_one()

    # Due times from the server's clock, as a producer with a correct clock
    # would write them.
    base = _server_now(app)
    ids = [schedule_committed(app, "stamp", at=base + timedelta(seconds=0.5 + 0.3 * i))
           for i in range(5)]
    async with Running(app, relays=1, workers=1) as r:
        await r.wait(lambda: len(started) == len(ids), timeout=30, what="every job ran")
    rows = job_rows(app.engine)
    app.dispose()
    for job_id in ids:
        early_us = us(rows[job_id].due_at) - us(started[job_id])
        assert early_us <= 0, f"job {job_id} started {early_us} us before its due time"


def _server_now(app: duebox.Duebox) -> datetime:
    with app.engine.connect() as conn:
        return conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()  # type: ignore[no-any-return]
