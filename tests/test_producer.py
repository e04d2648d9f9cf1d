"""The producer API: schedule, schedule_many, cancel and reschedule inside the
caller's own transaction, with every kind of handle the API accepts, on
SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
from helpers import count, duebox_row_counts, job_row, make_app, observer
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import duebox
from duebox import (
    FakeClock,
    JobNotFoundError,
    JobState,
    JobStateError,
    ValidationError,
)
from duebox.leases import claims, dispatch_marks, jobstore
from duebox.tables import audit, job

# Every kind of handle the producer accepts; the visibility and rollback
# tests run on all of them, the other operations on a sync and an async one.
KINDS = ["session", "connection", "async_session", "async_connection", "own_async_engine"]
START = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
async def app(database_url: str) -> AsyncIterator[duebox.Duebox]:
    a = make_app(database_url, clock=FakeClock(START))
    yield a
    await a.adispose()


@pytest.fixture
def watcher(database_url: str) -> Any:
    eng = observer(database_url)
    yield eng
    eng.dispose()


async def resolve(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def async_url(url: str) -> str:
    return url.replace("sqlite://", "sqlite+aiosqlite://", 1)


@asynccontextmanager
async def transaction(app: duebox.Duebox, kind: str, *, commit: bool = True) -> AsyncIterator[Any]:
    """Open a transaction on one kind of handle; commit or roll back at the end."""
    if kind == "session":
        with Session(app.engine) as s:
            s.begin()
            yield s
            s.commit() if commit else s.rollback()
    elif kind == "connection":
        with app.engine.connect() as c:
            c.begin()
            yield c
            c.commit() if commit else c.rollback()
    elif kind == "async_session":
        async with AsyncSession(app.async_engine) as s:
            await s.begin()
            yield s
            await (s.commit() if commit else s.rollback())
    elif kind == "async_connection":
        async with app.async_engine.connect() as c:
            await c.begin()
            yield c
            await (c.commit() if commit else c.rollback())
    elif kind == "own_async_engine":
        # The application's own async engine, made without duebox's help.
        eng = create_async_engine(async_url(app.settings.database_url))
        try:
            async with AsyncSession(eng) as s:
                await s.begin()
                yield s
                await (s.commit() if commit else s.rollback())
        finally:
            await eng.dispose()
    else:  # pragma: no cover
        raise AssertionError(kind)


def visible_jobs(watcher: sa.Engine) -> int:
    with watcher.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(job)).scalar_one())


# --- schedule -----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_schedule_becomes_visible_only_when_the_caller_commits(
    app: duebox.Duebox, kind: str, watcher: sa.Engine
) -> None:
    async with transaction(app, kind) as tx:
        job_id = await resolve(app.schedule(tx, "effect", {"n": 1}, delay=30))
        assert isinstance(job_id, uuid.UUID)
        # The row is in the caller's transaction only: nobody else sees it yet.
        assert await asyncio.to_thread(visible_jobs, watcher) == 0
    row = job_row(watcher, job_id)
    assert row.state == JobState.SCHEDULED
    assert row.task == "effect"
    assert row.payload == {"n": 1}
    assert row.due_at == START + timedelta(seconds=30)
    assert (row.version, row.attempt, row.max_attempts) == (1, 0, 10)  # the default


@pytest.mark.parametrize("kind", KINDS)
async def test_rollback_leaves_no_trace(app: duebox.Duebox, kind: str) -> None:
    async with transaction(app, kind, commit=False) as tx:
        await resolve(app.schedule(tx, "effect", {"n": 1}))
        await resolve(app.schedule(tx, "effect", {"n": 2}, key="k-1"))
        await resolve(app.schedule_many(tx, [app.new_job("effect", i) for i in range(3)]))
    assert set(duebox_row_counts(app.engine).values()) == {0}


@pytest.mark.parametrize("kind", ["session", "async_session"])
async def test_schedule_never_commits_even_with_the_callers_business_write(
    app: duebox.Duebox, kind: str
) -> None:
    """The job and the caller's own write share one fate."""
    with app.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (id INTEGER PRIMARY KEY)"))
    try:
        async with transaction(app, kind, commit=False) as tx:
            await resolve(tx.execute(sa.text("INSERT INTO orders (id) VALUES (1)")))
            await resolve(app.schedule(tx, "effect", {"order": 1}))
        assert count(app.engine, "orders") == 0
        assert count(app.engine, job) == 0
        async with transaction(app, kind) as tx:
            await resolve(tx.execute(sa.text("INSERT INTO orders (id) VALUES (2)")))
            await resolve(app.schedule(tx, "effect", {"order": 2}))
        assert count(app.engine, "orders") == 1
        assert count(app.engine, job) == 1
    finally:
        with app.engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE orders"))


async def test_schedule_stores_every_option(app: duebox.Duebox) -> None:
    berlin = datetime(2030, 3, 1, 9, 0, tzinfo=ZoneInfo("Europe/Berlin"))
    expires = berlin + timedelta(hours=1)
    with Session(app.engine) as s, s.begin():
        job_id = app.schedule(
            s, "noop", {"a": [1, 2.5, None, "x"], "b": {"c": True}}, at=berlin, key="biz-1",
            priority=-7, tenant="acme", expires_at=expires, headers={"trace": "t-1"},
        )
    row = job_row(app.engine, job_id)
    assert row.due_at == datetime(2030, 3, 1, 8, 0, tzinfo=UTC)  # the same instant, in UTC
    assert row.due_at.tzinfo is not None
    assert row.expires_at == expires
    assert row.queue == "other"  # from the task
    assert row.payload == {"a": [1, 2.5, None, "x"], "b": {"c": True}}
    assert row.headers == {"trace": "t-1"}
    assert (row.key, row.priority, row.tenant) == ("biz-1", -7, "acme")
    assert row.lease_owner is None
    assert row.lease_generation == 0


@pytest.mark.parametrize("delay", [0, 2.5, timedelta(minutes=3)])
async def test_delay_is_measured_from_the_apps_clock(app: duebox.Duebox, delay: Any) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect", delay=delay)
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
    assert job_row(app.engine, job_id).due_at == START + timedelta(seconds=seconds)


async def test_no_due_time_means_now(app: duebox.Duebox) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect")
    assert job_row(app.engine, job_id).due_at == START


# --- idempotency keys -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["session", "async_connection"])
async def test_key_returns_the_first_id_within_one_transaction(
    app: duebox.Duebox, kind: str
) -> None:
    async with transaction(app, kind) as tx:
        first = await resolve(app.schedule(tx, "effect", {"v": 1}, key="order-42"))
        again = await resolve(app.schedule(tx, "effect", {"v": 2}, key="order-42", delay=60))
    assert again == first
    assert count(app.engine, job) == 1
    row = job_row(app.engine, first)
    assert row.payload == {"v": 1}
    assert row.due_at == START


@pytest.mark.parametrize("kind", ["connection", "async_session"])
async def test_key_returns_the_first_id_across_transactions(app: duebox.Duebox, kind: str) -> None:
    with Session(app.engine) as s, s.begin():
        first = app.schedule(s, "effect", {"v": 1}, key="order-42")
    async with transaction(app, kind) as tx:
        again = await resolve(app.schedule(tx, "effect", {"v": 2}, key="order-42"))
        other = await resolve(app.schedule(tx, "effect", {"v": 3}, key="order-43"))
    assert again == first
    assert other != first
    assert count(app.engine, job) == 2
    assert job_row(app.engine, first).payload == {"v": 1}


@pytest.mark.postgres
async def test_concurrent_key_waits_for_the_first_writer(pg_server_url: str) -> None:
    """Two transactions racing on one key: the second blocks on the unique
    index until the first commits, then returns the first one's id."""
    from conftest import reset_tables

    reset_tables(pg_server_url)
    app = make_app(pg_server_url)
    try:
        results: list[Any] = []
        with Session(app.engine) as first:
            first.begin()
            first_id = app.schedule(first, "effect", key="race")
            pid = first.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()

            def second() -> None:
                try:
                    with Session(app.engine) as s, s.begin():
                        results.append(app.schedule(s, "effect", key="race"))
                except Exception as exc:  # pragma: no cover - reported below
                    results.append(exc)

            t = threading.Thread(target=second)
            t.start()

            def blocked_on_first() -> bool:
                with app.engine.connect() as c:
                    return bool(c.execute(
                        sa.text("SELECT count(*) FROM pg_stat_activity "
                                "WHERE :pid = ANY(pg_blocking_pids(pid))"),
                        {"pid": pid},
                    ).scalar_one())

            from helpers import wait_for

            await wait_for(blocked_on_first, timeout=10, what="the second insert to block")
            first.commit()
        await asyncio.to_thread(t.join, 10)
        assert results == [first_id]
        assert count(app.engine, job) == 1
    finally:
        app.dispose()


# --- schedule_many --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["session", "connection", "async_session"])
async def test_schedule_many_inserts_every_job_in_order(app: duebox.Duebox, kind: str) -> None:
    new = [app.new_job("effect", {"i": i}, delay=i, priority=i) for i in range(5)]
    new.append(app.new_job("noop", "x", at=START + timedelta(days=1), tenant="t"))
    async with transaction(app, kind) as tx:
        ids = await resolve(app.schedule_many(tx, new))
        assert await resolve(app.schedule_many(tx, [])) == []
    assert len(ids) == len(set(ids)) == 6
    for i in range(5):
        row = job_row(app.engine, ids[i])
        assert row.payload == {"i": i}
        assert row.priority == i
        assert row.due_at == START + timedelta(seconds=i)
        assert row.state == JobState.SCHEDULED
    last = job_row(app.engine, ids[5])
    assert (last.task, last.queue, last.tenant, last.payload) == ("noop", "other", "t", "x")
    assert count(app.engine, job) == 6


# --- cancel ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["connection", "async_session"])
async def test_cancel_bumps_the_version_once(app: duebox.Duebox, kind: str) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect", delay=60)
    async with transaction(app, kind) as tx:
        assert await resolve(app.cancel(tx, job_id)) is True
    row = job_row(app.engine, job_id)
    assert (row.state, row.version) == (JobState.CANCELLED, 2)
    assert row.finished_at == START
    async with transaction(app, kind) as tx:
        assert await resolve(app.cancel(tx, str(job_id))) is False  # already final
    assert job_row(app.engine, job_id).version == 2


@pytest.mark.parametrize("kind", ["session", "async_session"])
async def test_cancel_rolled_back_changes_nothing(app: duebox.Duebox, kind: str) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect", delay=60)
    before = job_row(app.engine, job_id)
    async with transaction(app, kind, commit=False) as tx:
        assert await resolve(app.cancel(tx, job_id, operator="ops", reason="r")) is True
    assert job_row(app.engine, job_id) == before
    assert count(app.engine, audit) == 0


async def test_cancel_with_operator_is_audited(app: duebox.Duebox) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect", delay=60)
    with app.engine.begin() as conn:
        assert app.cancel(conn, job_id, operator="alice", reason="customer asked") is True
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(audit)).all()
    assert [(r.operator, r.action, r.job_id, r.reason) for r in rows] == [
        ("alice", "cancel", job_id, "customer asked")
    ]


@pytest.mark.parametrize("kind", ["session", "async_connection"])
async def test_cancel_of_an_unknown_id_raises_and_writes_nothing(
    app: duebox.Duebox, kind: str
) -> None:
    missing = uuid.uuid4()
    with pytest.raises(JobNotFoundError) as info:
        async with transaction(app, kind) as tx:
            await resolve(app.cancel(tx, missing, operator="alice", reason="test"))
    assert str(missing) in str(info.value)
    assert set(duebox_row_counts(app.engine).values()) == {0}


async def test_cancel_of_a_running_job_fences_out_its_worker(app: duebox.Duebox) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect")
    with app.engine.begin() as conn:
        [rec] = claims.claim_for_run(
            conn, owner="w#1", now=START, limit=10, lease_until=START + timedelta(seconds=30),
            queues=None, worker="w",
        )
    with app.engine.begin() as conn:
        assert app.cancel(conn, job_id) is True
    with app.engine.begin() as conn:
        assert conn.execute(*jobstore.complete_bound(rec, START)).rowcount == 0
    row = job_row(app.engine, job_id)
    assert (row.state, row.version, row.lease_owner) == (JobState.CANCELLED, 2, None)


# --- reschedule -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["connection", "async_session"])
async def test_reschedule_moves_the_due_time_and_bumps_the_version(
    app: duebox.Duebox, kind: str
) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect", delay=60)
    async with transaction(app, kind) as tx:
        assert await resolve(app.reschedule(tx, job_id, delay=120)) is None
    row = job_row(app.engine, job_id)
    assert (row.state, row.version) == (JobState.SCHEDULED, 2)
    assert row.due_at == START + timedelta(seconds=120)
    new_at = datetime(2031, 1, 1, tzinfo=UTC)
    async with transaction(app, kind) as tx:
        await resolve(app.reschedule(tx, str(job_id), at=new_at))
    row = job_row(app.engine, job_id)
    assert (row.due_at, row.version) == (new_at, 3)


async def test_reschedule_rolled_back_changes_nothing(app: duebox.Duebox) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect", delay=60)
    before = job_row(app.engine, job_id)
    with Session(app.engine) as s:
        s.begin()
        app.reschedule(s, job_id, delay=5)
        s.rollback()
    assert job_row(app.engine, job_id) == before


@pytest.mark.parametrize("leased", ["DISPATCHING", "ENQUEUED"])
async def test_reschedule_takes_a_job_back_from_the_relay(
    app: duebox.Duebox, leased: str
) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect", delay=10)
    with app.engine.begin() as conn:
        [rec] = claims.claim_for_dispatch(
            conn, owner="relay#1", horizon=START + timedelta(days=1), limit=10, now=START,
            lease_until=START + timedelta(seconds=30),
        )
        if leased == "ENQUEUED":
            assert dispatch_marks.mark_enqueued(conn, owner="relay#1", ids=[job_id], now=START) == 1
    assert job_row(app.engine, job_id).state == leased
    with app.engine.begin() as conn:
        app.reschedule(conn, job_id, delay=20)
    row = job_row(app.engine, job_id)
    assert (row.state, row.version, row.lease_owner, row.lease_until) == (
        JobState.SCHEDULED, 2, None, None)
    assert row.due_at == START + timedelta(seconds=20)
    # The relay's late mark for its claim is fenced out.
    with app.engine.begin() as conn:
        assert dispatch_marks.mark_enqueued(conn, owner="relay#1", ids=[job_id], now=START) == 0
    # And the message it published is stale.
    with app.engine.begin() as conn:
        started = jobstore.start(
            conn, message=rec.to_message(), owner="w#1", now=START + timedelta(minutes=1),
            lease_until=START + timedelta(minutes=2), worker="w",
        )
        assert started is None
        why = jobstore.why_not_started(conn, rec.to_message(), START + timedelta(minutes=1))
    assert why == "stale_version"


@pytest.mark.parametrize("kind", ["session", "async_connection"])
async def test_reschedule_of_a_running_job_raises_and_changes_nothing(
    app: duebox.Duebox, kind: str
) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect")
    with app.engine.begin() as conn:
        claims.claim_for_run(
            conn, owner="w#1", now=START, limit=10, lease_until=START + timedelta(seconds=30),
            queues=None, worker="w",
        )
    before = job_row(app.engine, job_id)
    assert before.state == JobState.RUNNING
    with pytest.raises(JobStateError) as info:
        async with transaction(app, kind) as tx:
            await resolve(app.reschedule(tx, job_id, delay=60))
    assert not isinstance(info.value, JobNotFoundError)
    assert "RUNNING" in str(info.value)
    assert job_row(app.engine, job_id) == before


@pytest.mark.parametrize("final", ["SUCCEEDED", "CANCELLED"])
async def test_reschedule_of_a_finished_job_raises(app: duebox.Duebox, final: str) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect")
    with app.engine.begin() as conn:
        conn.execute(sa.update(job).where(job.c.id == job_id).values(state=final))
    before = job_row(app.engine, job_id)
    with pytest.raises(JobStateError, match=final), app.engine.begin() as conn:
        app.reschedule(conn, job_id, delay=60)
    assert job_row(app.engine, job_id) == before


@pytest.mark.parametrize("kind", ["session", "async_session"])
async def test_reschedule_of_an_unknown_id_raises(app: duebox.Duebox, kind: str) -> None:
    missing = uuid.uuid4()
    with pytest.raises(JobNotFoundError, match=str(missing)):
        async with transaction(app, kind) as tx:
            await resolve(app.reschedule(tx, missing, delay=1))
    assert count(app.engine, job) == 0


async def test_reschedule_needs_a_time(app: duebox.Duebox) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect", delay=60)
    before = job_row(app.engine, job_id)
    with pytest.raises(ValidationError, match="at/delay"), app.engine.begin() as conn:
        app.reschedule(conn, job_id)
    assert job_row(app.engine, job_id) == before
