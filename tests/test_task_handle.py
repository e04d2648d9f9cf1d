"""What ``@app.task`` returns (issue #33 item 3): the handler, callable as
before, with ``.schedule(session, payload, ...)`` in the caller's
transaction and ``.enqueue`` / ``.aenqueue`` (and ``app.enqueue`` /
``app.aenqueue``) in a transaction of duebox's own, through to a worker
running the job on the real databases.  Its types: tests/test_typing.py."""

from __future__ import annotations

import inspect
import uuid
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import Running, job_row, job_rows, make_app, observer
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import duebox


def shop(url: str) -> tuple[duebox.Duebox, list[Any]]:
    """An app with a sync and an async task that record what they ran."""
    app = make_app(url)
    ran: list[Any] = []

    @app.task("send-reminder")
    def send_reminder(payload: dict[str, int], ctx: duebox.JobContext) -> str:
        """Remind the customer."""
        ran.append(("send-reminder", payload, ctx.key))
        return f"reminded {payload['order_id']}"

    @app.task("send-report", queue="reports")
    async def send_report(payload: None, ctx: duebox.JobContext) -> int:
        ran.append(("send-report", payload, ctx.key))
        return 7

    app.handles = (send_reminder, send_report)  # type: ignore[attr-defined]
    return app, ran


async def test_the_handle_is_still_the_function(database_url: str) -> None:
    app, ran = shop(database_url)
    send_reminder, send_report = app.handles  # type: ignore[attr-defined]
    try:
        assert isinstance(send_reminder, duebox.TaskHandle)
        ctx: Any = SimpleNamespace(key=None)
        assert send_reminder({"order_id": 1}, ctx) == "reminded 1"
        assert send_reminder(payload={"order_id": 2}, ctx=ctx) == "reminded 2"
        assert await send_report(None, ctx) == 7
        assert (send_reminder.__name__, send_reminder.__doc__) == (
            "send_reminder", "Remind the customer.")
        assert send_reminder.name == "send-reminder"
        assert inspect.iscoroutinefunction(send_report.fn)
        assert inspect.signature(send_reminder) == inspect.signature(send_reminder.fn)
        # What the worker runs is the function itself, async or not.
        assert app.get_task("send-reminder").fn is send_reminder.fn
        assert app.get_task("send-report").is_async
        # A handle registered again under another name runs the same function.
        again = app.task("send-report-again")(send_report)
        assert (again.name, send_report.name) == ("send-report-again", "send-report")
        assert app.get_task("send-report-again").fn is send_report.fn
        assert app.get_task("send-report-again").is_async
        assert await again(None, ctx) == 7
        assert len(ran) == 4
    finally:
        app.dispose()


def test_a_celery_or_dramatiq_habit_gets_the_way_here() -> None:
    app, _ = shop("sqlite://")
    send_reminder, _ = app.handles  # type: ignore[attr-defined]
    for peer in ("delay", "apply_async", "send"):
        with pytest.raises(AttributeError) as caught:
            getattr(send_reminder, peer)({"order_id": 1})
        assert f"task 'send-reminder' has no .{peer}()" in str(caught.value)
        assert "send_reminder.enqueue(payload, delay=...)" in str(caught.value)
        assert "send_reminder.schedule(session, payload, delay=...)" in str(caught.value)
    with pytest.raises(AttributeError, match="'TaskHandle' object has no attribute 'nope'"):
        send_reminder.nope  # noqa: B018
    assert not hasattr(send_reminder, "nope")


async def test_schedule_writes_in_the_callers_transaction(database_url_all: str) -> None:
    app, _ = shop(database_url_all)
    send_reminder, send_report = app.handles  # type: ignore[attr-defined]
    watcher = observer(database_url_all)
    try:
        with Session(app.engine) as session, session.begin():
            kept = send_reminder.schedule(session, {"order_id": 42}, delay=timedelta(hours=1),
                                          key="reminder:42")
            again = send_reminder.schedule(session, {"order_id": 42}, key="reminder:42")
        with app.engine.connect() as conn:
            rolled_back = send_reminder.schedule(conn, {"order_id": 43})
            conn.rollback()
        async with AsyncSession(app.async_engine) as session, session.begin():
            report = await send_report.schedule(session, None, priority=5)
        rows = job_rows(watcher)
        assert again == kept
        assert set(rows) == {kept, report}
        assert rolled_back not in rows
        assert (rows[kept].task, rows[kept].payload, rows[kept].key) == (
            "send-reminder", {"order_id": 42}, "reminder:42")
        assert (rows[report].task, rows[report].queue, rows[report].priority) == (
            "send-report", "reports", 5)
        # Bad input is refused as app.schedule refuses it, writing nothing.
        with Session(app.engine) as session, session.begin(), \
                pytest.raises(duebox.ValidationError, match="delay"):
            send_reminder.schedule(session, {"order_id": 1}, delay=-1)
        assert set(job_rows(watcher)) == {kept, report}
    finally:
        watcher.dispose()
        await app.adispose()


async def test_enqueue_commits_on_its_own_and_a_worker_runs_it(database_url: str) -> None:
    app, ran = shop(database_url)
    send_reminder, send_report = app.handles  # type: ignore[attr-defined]
    watcher = observer(database_url)
    try:
        first = send_reminder.enqueue({"order_id": 1}, key="reminder:1")
        # Committed before enqueue returned: another connection sees it.
        assert job_row(watcher, first).state == duebox.JobState.SCHEDULED
        assert send_reminder.enqueue({"order_id": 1}, key="reminder:1") == first
        second = await send_report.aenqueue(None, delay=0.2)
        third = app.enqueue("send-reminder", {"order_id": 3})
        fourth = await app.aenqueue("send-report", None, key="report:4")
        with pytest.raises(duebox.UnknownTaskError):
            app.enqueue("send-reminders", {"order_id": 5})
        with pytest.raises(duebox.ValidationError, match="payload"):
            send_reminder.enqueue({"order_id": float("nan")})  # type: ignore[dict-item]
        ids = [first, second, third, fourth]
        assert set(job_rows(watcher)) == set(ids)
        async with Running(app, relays=0) as r:
            await r.wait(lambda: all(job_row(watcher, i).state == "SUCCEEDED" for i in ids),
                         timeout=30, what="the enqueued jobs to run")
        assert sorted(ran, key=repr) == sorted([
            ("send-reminder", {"order_id": 1}, "reminder:1"), ("send-report", None, None),
            ("send-reminder", {"order_id": 3}, None), ("send-report", None, "report:4"),
        ], key=repr)
    finally:
        watcher.dispose()
        await app.adispose()


@pytest.mark.postgres
def test_enqueue_is_not_atomic_with_the_callers_transaction(pg_server_url: str) -> None:
    """What its docs say it does not give: the caller's rollback does not
    take the job back (app.schedule in that transaction would have)."""
    from conftest import reset_tables

    reset_tables(pg_server_url)
    app, _ = shop(pg_server_url)
    send_reminder, _ = app.handles  # type: ignore[attr-defined]
    try:
        with Session(app.engine) as session:
            with session.begin():
                session.execute(sa.text("CREATE TABLE orders_33 (id INTEGER PRIMARY KEY)"))
            session.begin()
            session.execute(sa.text("INSERT INTO orders_33 (id) VALUES (1)"))
            enqueued = send_reminder.enqueue({"order_id": 1})
            scheduled = send_reminder.schedule(session, {"order_id": 1})
            session.rollback()
            orders = session.execute(sa.text("SELECT count(*) FROM orders_33")).scalar_one()
        rows = job_rows(app.engine)
        assert orders == 0
        assert enqueued in rows
        assert scheduled not in rows
        assert isinstance(scheduled, uuid.UUID)
    finally:
        app.dispose()
