"""Starting jobs on time: the sql:// worker's claim-ahead, the relay's timer for
near-due jobs, and the engine's ping of idle pooled connections.

Each test can fail on what it guards: a job handed over early (invariant 1), a
claimed-ahead job lost or charged an attempt when its worker stops, a near-due
job published through the broker's delay instead of the timer, a stale pooled
connection handed to a caller."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import sqlalchemy as sa
from helpers import (
    Running,
    all_final,
    attempt_rows,
    check_no_early_start,
    effect_rows,
    job_row,
    make_app,
    schedule_committed,
    us,
    wait_for,
)

import duebox.db
from duebox.consumers import Worker
from duebox.tables import attempt


async def test_sql_claims_ahead_and_starts_each_job_at_its_due_time(database_url: str) -> None:
    app = make_app(database_url, "sql://?lookahead=0.5")
    try:
        ids = [schedule_committed(app, delay=0.4 + 0.03 * i) for i in range(8)]
        async with Running(app, relays=0, workers=1, concurrency=8) as r:
            await r.wait(lambda: all_final(app.engine, ids), timeout=15, what="the jobs to run")
        check_no_early_start(app.engine)
        for job_id in ids:
            row = job_row(app.engine, job_id)
            [att] = attempt_rows(app.engine, job_id)
            # Claimed ahead, but recorded as started at (or after) the due time.
            assert row.started_at >= row.due_at
            assert att.started_at >= row.due_at
    finally:
        await app.adispose()


async def test_a_stopping_sql_worker_gives_claimed_ahead_jobs_back(database_url: str) -> None:
    app = make_app(database_url, "sql://?lookahead=30")
    try:
        job_id = schedule_committed(app, delay=20)
        stop = asyncio.Event()
        worker = Worker(app, concurrency=2)
        task = asyncio.create_task(worker.run(stop))
        try:
            await wait_for(lambda: job_row(app.engine, job_id).state == "RUNNING", timeout=10,
                           what="the job to be claimed ahead", check=lambda: _alive(task))
            assert effect_rows(app.engine) == {}  # held, not run: it is due in 20 s
        finally:
            stop.set()
            await task
        row = job_row(app.engine, job_id)
        assert (row.state, row.attempt, row.lease_owner, row.started_at) == (
            "SCHEDULED", 0, None, None)
        with app.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(attempt)).scalar() == 0
    finally:
        await app.adispose()


def _alive(task: asyncio.Task[None]) -> None:
    if task.done():
        task.result()
        raise AssertionError("the worker stopped")


async def test_the_relay_holds_near_due_jobs_and_publishes_them_on_time(
        database_url: str, amqp_vhost: str) -> None:
    # RabbitMQ's TTL tiers would deliver these late: the relay times them itself.
    app = make_app(database_url, f"{amqp_vhost}?prefix=t{uuid.uuid4().hex[:8]}")
    try:
        async with Running(app, relays=1, workers=1) as r:
            relay = r.relays[0]
            # Declaring the tier topology takes a while on a busy machine.
            await r.wait(lambda: relay.totals.passes >= 1, timeout=60, what="a first pass")
            ids = [schedule_committed(app, delay=1.5 + 0.05 * i) for i in range(4)]
            await r.wait(lambda: relay.totals.held >= len(ids), timeout=10,
                         what="the relay to hold the near-due jobs")
            await r.wait(lambda: all_final(app.engine, ids), timeout=15, what="the jobs to run")
        check_no_early_start(app.engine)
        effects = effect_rows(app.engine)
        for job_id in ids:
            row = job_row(app.engine, job_id)
            assert row.published_at is not None
            # Published by the timer just before the due time, not 1.5 s ahead
            # with a broker delay.
            assert (row.due_at - row.published_at).total_seconds() < 0.5
            late_ms = (effects[str(job_id)].started_us - us(row.due_at)) / 1000
            assert 0 <= late_ms < 1000, late_ms
    finally:
        await app.adispose()


@pytest.mark.postgres
def test_a_connection_dropped_while_idle_is_replaced_not_handed_out(
        pg_server_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(duebox.db, "_PING_AFTER_IDLE", 0.0)
    engine = duebox.db.create_sync_engine(pg_server_url, pool_size=1, max_overflow=0)
    admin = sa.create_engine(pg_server_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
        with admin.connect() as conn:
            assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
        deadline = time.monotonic() + 10
        with admin.connect() as conn:  # until the server has really dropped it
            while conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"),
                               {"p": pid}).scalar():
                assert time.monotonic() < deadline, "the backend did not terminate"
                time.sleep(0.01)
        with engine.connect() as conn:  # the pooled one is dead: pinged, replaced
            assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar() != pid
    finally:
        engine.dispose()
        admin.dispose()
