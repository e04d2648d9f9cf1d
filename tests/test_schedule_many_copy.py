"""schedule_many's fast path: on PostgreSQL with psycopg 3 the rows go in with
COPY on the caller's own connection (bench/enqueue.py).  It must write what
schedule() writes, stay inside the caller's transaction however it was begun,
raise driver errors as SQLAlchemy does, and still wake LISTENers on commit."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from helpers import count, job_row, make_app
from sqlalchemy import exc as sa_exc

import duebox
from duebox import FakeClock
from duebox.db import NOTIFY_CHANNEL
from duebox.producer import NewJob
from duebox.tables import job

START = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
PG_ONLY = pytest.mark.parametrize("database_url", [pytest.param("postgres",
                                                                marks=pytest.mark.postgres)],
                                  indirect=True)


@pytest.fixture
def app(database_url: str) -> Any:
    a = make_app(database_url, clock=FakeClock(START))
    yield a
    a.dispose()


def kwargs() -> list[dict[str, Any]]:
    return [
        {"payload": None},
        {"payload": {"a": [1, 2.5, "é\u2028"], "b": None}, "headers": {"trace": "x"},
         "priority": -3, "tenant": "acme", "delay": 90,
         "expires_at": START + timedelta(days=2)},
        {"payload": "just text", "at": START + timedelta(hours=1), "headers": {}},
    ]


def comparable(row: Any) -> dict[str, Any]:
    values = dict(row._mapping)
    assert values.pop("shard") == values["id"].int % 1024
    values.pop("id")
    return values


def test_schedule_many_writes_what_schedule_writes(app: duebox.Duebox) -> None:
    """Column for column (a JSON null stays a JSON null, not SQL NULL)."""
    with app.engine.begin() as conn:
        many = app.schedule_many(conn, [app.new_job("effect", **kw) for kw in kwargs()])
        one = [app.schedule(conn, "effect", **kw) for kw in kwargs()]
    assert isinstance(many, list)
    for a, b in zip(many, one, strict=True):
        assert comparable(job_row(app.engine, a)) == comparable(job_row(app.engine, b))
    with app.engine.connect() as conn:
        nulls = conn.execute(sa.select(sa.func.count()).where(job.c.payload.is_(None))).scalar()
    assert nulls == 0


def test_a_job_built_by_hand_is_encoded_at_insert(app: duebox.Duebox) -> None:
    """NewJob made without new_job() (as schedule occurrences are) has no
    cached JSON; the insert encodes it."""
    new = NewJob(task="effect", queue="default", payload={"k": 1}, due_at=START,
                 max_attempts=3, headers={"h": True})
    with app.engine.begin() as conn:
        [job_id] = app.schedule_many(conn, [new])  # type: ignore[misc]
    row = job_row(app.engine, job_id)
    assert (row.payload, row.headers) == ({"k": 1}, {"h": True})


@pytest.mark.parametrize("end", ["commit", "rollback"])
@pytest.mark.parametrize("notify", [True, False])
def test_a_connection_not_yet_begun_gets_the_jobs_with_its_commit(
    app: duebox.Duebox, end: str, notify: bool
) -> None:
    """Commit-as-you-go: the COPY joins the transaction the caller's
    commit() or rollback() ends, as an execute() would (without the NOTIFY
    after it, which would begin it anyway)."""
    app.configure(notify=notify)
    with app.engine.connect() as conn:
        ids = app.schedule_many(conn, [app.new_job("effect") for _ in range(3)])
        getattr(conn, end)()
    assert isinstance(ids, list)
    assert count(app.engine, job) == (3 if end == "commit" else 0)


@PG_ONLY
@pytest.mark.parametrize("kind", ["connection", "async_connection"])
async def test_a_driver_error_is_a_sqlalchemy_error_and_writes_nothing(
    app: duebox.Duebox, kind: str
) -> None:
    """A row the database refuses (a queue name longer than the column, only
    possible by building NewJob by hand) fails the COPY with SQLAlchemy's
    DataError, like an INSERT would, and the transaction writes nothing."""
    good = app.new_job("effect")
    bad = NewJob(task="effect", queue="q" * 300, payload=None, due_at=START, max_attempts=3)

    async def attempt() -> None:
        if kind == "connection":
            with app.engine.begin() as conn:
                app.schedule_many(conn, [good, bad])
        else:
            async with app.async_engine.begin() as aconn:
                await app.schedule_many(aconn, [good, bad])  # type: ignore[misc]

    with pytest.raises(sa_exc.DataError) as info:
        await attempt()
    assert isinstance(info.value.orig, psycopg.errors.StringDataRightTruncation)
    assert count(app.engine, job) == 0
    await app.adispose()


@PG_ONLY
@pytest.mark.parametrize("kind", ["connection", "async_session"])
async def test_schedule_many_wakes_listeners_on_commit_only(
    app: duebox.Duebox, kind: str
) -> None:
    dsn = app.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listener:
        await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        gen = listener.notifies(timeout=0.5)

        async def received() -> int:
            return len([n async for n in gen])

        jobs = [app.new_job("effect") for _ in range(5)]
        if kind == "connection":
            with app.engine.connect() as conn:
                app.schedule_many(conn, jobs)
                conn.rollback()
        else:
            from sqlalchemy.ext.asyncio import AsyncSession

            async with AsyncSession(app.async_engine) as s:
                await app.schedule_many(s, jobs)  # type: ignore[misc]
                await s.rollback()
        assert await received() == 0  # rolled back: no wake-up, no jobs
        gen = listener.notifies(timeout=5, stop_after=1)
        waiting = asyncio.ensure_future(received())
        with app.engine.begin() as conn:
            app.schedule_many(conn, jobs)
        assert await waiting == 1
    assert count(app.engine, job) == 5
    await app.adispose()
