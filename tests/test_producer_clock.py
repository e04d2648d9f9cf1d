"""Never early when the *producer's* clock lags: ``delay=`` counts on the
database's clock, the one relays and workers follow (docs/design.md,
"Clocks").  It used to be added to the producing host's clock, so a producer
30 s behind made ``delay=40`` run 10 s after the call.

In process, with a producer clock that lags (fast: nothing waits for the
delay), on PostgreSQL (single insert, COPY, reschedule) and MariaDB; then
once for real: the producer is a process under Debian's ``faketime``, the
relay and worker run with the true clock, and the job must not start before
the delay has passed on the database's clock.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from conftest import IN_CI, reset_tables
from helpers import Running, effect_rows, job_row, make_app, us
from sqlalchemy.orm import Session

import duebox
from duebox.clock import DatabaseClock, SystemClock, as_utc, server_now_sql

LAG = timedelta(seconds=30)


class LaggingClock(SystemClock):
    """This machine's clock, ``LAG`` behind the real time (and the server's)."""

    def now(self) -> datetime:
        return super().now() - LAG


@pytest.fixture
def lagging_app(server_url: str) -> Iterator[duebox.Duebox]:
    app = make_app(server_url, clock=DatabaseClock(LaggingClock()))
    yield app
    app.dispose()


def server_now(conn: sa.Connection) -> datetime:
    sql = server_now_sql(conn.dialect.name)
    assert sql is not None
    return as_utc(conn.execute(sql).scalar_one())


def test_delay_counts_from_the_database_clock_not_the_producers(
    lagging_app: duebox.Duebox,
) -> None:
    app = lagging_app
    with app.engine.begin() as conn:
        before = server_now(conn)
        one = app.schedule(conn, "effect", delay=40)
        keyed = app.schedule(conn, "effect", delay=timedelta(seconds=40), key="k")
        now_job = app.schedule(conn, "effect")
    with Session(app.engine) as s, s.begin():
        many = app.schedule_many(s, [app.new_job("effect", delay=40) for _ in range(3)])
        at_job = app.schedule(s, "effect", at=before + timedelta(seconds=40))
    assert isinstance(many, list)
    for job_id in [one, keyed, *many]:
        assert job_row(app.engine, job_id).due_at >= before + timedelta(seconds=40)
    # No delay: due at the database's "now", not 30 s in its past.
    assert job_row(app.engine, now_job).due_at >= before
    # at= is an absolute instant: exactly as given, whatever the clocks say.
    assert job_row(app.engine, at_job).due_at == before + timedelta(seconds=40)
    with app.engine.begin() as conn:
        app.reschedule(conn, one, delay=60)
    assert job_row(app.engine, one).due_at >= before + timedelta(seconds=60)


async def test_delay_counts_from_the_database_clock_in_async_sessions(
    lagging_app: duebox.Duebox,
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    app = lagging_app
    sql = server_now_sql(app.engine.dialect.name)
    assert sql is not None
    async with AsyncSession(app.async_engine) as s, s.begin():
        before = as_utc((await s.execute(sql)).scalar_one())
        one = await app.schedule(s, "effect", delay=40)  # type: ignore[misc]
        many = await app.schedule_many(  # type: ignore[misc]
            s, [app.new_job("effect", delay=40) for _ in range(2)])
    for job_id in [one, *many]:
        assert job_row(app.engine, job_id).due_at >= before + timedelta(seconds=40)
    await app.adispose()


def test_an_app_with_its_own_clock_keeps_counting_on_it(server_url: str) -> None:
    """A clock the app was given on purpose (a test's FakeClock) is the
    app's time: delays count on it, not on the server's."""
    fake = duebox.FakeClock(datetime(2031, 1, 1, tzinfo=UTC))
    app = make_app(server_url, clock=fake)
    try:
        with app.engine.begin() as conn:
            job_id = app.schedule(conn, "effect", delay=5)
        assert job_row(app.engine, job_id).due_at == datetime(2031, 1, 1, 0, 0, 5, tzinfo=UTC)
    finally:
        app.dispose()


# --- for real: a producer process under faketime --------------------------------------

PRODUCER = textwrap.dedent('''
    import sys
    import sqlalchemy as sa
    import duebox

    app = duebox.Duebox(sys.argv[1])
    app.add_task("effect", lambda p, c: None)
    with app.engine.begin() as conn:
        server = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
        job_id = app.schedule(conn, "effect", delay=float(sys.argv[2]))
    app.dispose()
    print(job_id, server.isoformat(), flush=True)
''')
FAKETIME = shutil.which("faketime")


@pytest.mark.slow
@pytest.mark.postgres
async def test_a_producer_process_whose_clock_lags_never_makes_a_job_early(
    pg_server_url: str,
) -> None:
    """The producer runs under ``faketime -f -20s``; the relay and worker run
    here with the true clock.  ``delay=25`` must not start before 25 s after
    the call on the database's clock (it used to start after 5 s)."""
    if FAKETIME is None:
        if IN_CI:
            pytest.fail("faketime is required under CI=true (apt-get install -y faketime)")
        pytest.skip("faketime is not installed")
    reset_tables(pg_server_url)
    delay = 25.0
    env = {**os.environ, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    producer = await asyncio.create_subprocess_exec(
        FAKETIME, "-f", "-20s", sys.executable, "-c", PRODUCER, pg_server_url, str(delay),
        env=env, stdout=asyncio.subprocess.PIPE)
    stdout, _ = await asyncio.wait_for(producer.communicate(), timeout=60)
    assert producer.returncode == 0
    job_text, server_text = stdout.decode().split()
    called = datetime.fromisoformat(server_text)
    app = make_app(pg_server_url)
    try:
        row = job_row(app.engine, job_text)
        assert row.due_at >= called + timedelta(seconds=delay), (row.due_at, called)
        async with Running(app) as r:
            await r.wait(lambda: job_row(app.engine, job_text).state == "SUCCEEDED",
                         timeout=delay + 30, what="the delayed job to run")
        [effect] = effect_rows(app.engine).values()
        # The worker's own clock is the machine's true one, as is the server's.
        assert effect.started_us >= us(called + timedelta(seconds=delay))
        assert job_row(app.engine, job_text).started_at >= called + timedelta(seconds=delay)
    finally:
        await app.adispose()
