"""A user's code, type-checked with ``mypy --strict`` by CI (scripts/typecheck-user).

It uses the public API the way the README and docs show it, in both sync
and async forms, and pins what each call returns with ``assert_type``: a
wrong overload, or a return type that reverts to ``UUID | Awaitable[UUID]``,
fails the check.  Nothing here runs; it only has to type-check.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from datetime import datetime, timedelta
from typing import Any, TypedDict, assert_type

from sqlalchemy import Connection, Row, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

import duebox
from duebox.schedules.api import DeleteResult, ScheduleInfo
from duebox.schedules.put import PutResult

app = duebox.Duebox(database_url="postgresql+psycopg://localhost/shop", broker_url="sql://")


@app.task("send-reminder", max_attempts=5)
def send_reminder(payload: dict[str, int], ctx: duebox.JobContext) -> None:
    ctx.session.execute(text("UPDATE orders SET reminded = true WHERE id = :id"),
                        {"id": payload["order_id"]})


@app.task("send-report")
async def send_report(payload: None, ctx: duebox.JobContext) -> None:
    await ctx.session.execute(text("SELECT 1"))


class Reminder(TypedDict):
    order_id: int


@app.task("send-typed-reminder")
def send_typed_reminder(payload: Reminder, ctx: duebox.JobContext) -> str:
    return str(payload["order_id"])


@app.task("untyped")
def untyped(payload, ctx):  # type: ignore[no-untyped-def]
    return None


def task_handles(session: Session, conn: Connection, ctx: duebox.JobContext) -> None:
    """The README's first way: the handle @app.task returns, its payload's
    type taken from the handler."""
    handle: duebox.TaskHandle[Any] = send_reminder
    assert_type(handle.fn, Any)
    job_id = send_typed_reminder.schedule(session, {"order_id": 42},
                                          delay=timedelta(hours=24), key="reminder:order-42")
    assert_type(job_id, uuid.UUID)
    assert_type(send_reminder.schedule(conn, {"order_id": 1}, at=datetime.now()), uuid.UUID)
    assert_type(send_report.schedule(session, None, priority=3), uuid.UUID)
    assert_type(untyped.schedule(session, object()), uuid.UUID)  # no annotation: any payload
    assert_type(send_typed_reminder.enqueue({"order_id": 1}, delay=60), uuid.UUID)
    assert_type(app.enqueue("send-reminder", {"order_id": 1}, key="k"), uuid.UUID)
    # Still the function: called as it was, with its own result.
    assert_type(send_typed_reminder({"order_id": 1}, ctx), str)
    assert_type(send_typed_reminder(payload={"order_id": 1}, ctx=ctx), str)
    assert_type(send_typed_reminder.name, str)


async def task_handles_async(session: AsyncSession, ctx: duebox.JobContext) -> None:
    pending = assert_type(send_typed_reminder.schedule(session, {"order_id": 7}, delay=30),
                          Coroutine[Any, Any, uuid.UUID])
    assert_type(await pending, uuid.UUID)
    assert_type(await send_report.aenqueue(None), uuid.UUID)
    assert_type(await app.aenqueue("send-report", None, tenant="acme"), uuid.UUID)
    assert_type(await send_report(None, ctx), None)


def readme_snippet() -> None:
    """The README's "Scheduling inside your transaction", then cancel and reschedule."""
    with Session(app.engine) as session, session.begin():
        session.execute(text("INSERT INTO orders (id) VALUES (42)"))
        job_id = app.schedule(session, "send-reminder", {"order_id": 42},
                              delay=timedelta(hours=24), key="reminder:order-42")
        assert_type(job_id, uuid.UUID)
        assert_type(app.cancel(session, job_id), bool)
        assert_type(app.reschedule(session, job_id, delay=60), None)
        info = app.get_job(session, "reminder:order-42")
        assert_type(info, duebox.JobInfo)
        assert_type(info.state, duebox.JobState)
        assert_type(info.attempts, int)
        assert_type(info.last_error, str | None)
        jobs = [app.new_job("send-reminder", {"order_id": n}, delay=n) for n in range(3)]
        assert_type(app.schedule_many(session, jobs), list[uuid.UUID])


def sync_connection(conn: Connection) -> None:
    job_id = app.schedule(conn, "send-reminder", {"order_id": 1}, at=datetime.now())
    assert_type(job_id, uuid.UUID)
    assert_type(app.cancel(conn, job_id, operator="ops", reason="customer asked"), bool)


async def async_session(session: AsyncSession) -> None:
    pending = assert_type(app.schedule(session, "send-reminder", {"order_id": 7}, delay=30),
                          Coroutine[Any, Any, uuid.UUID])
    job_id = await pending
    found = assert_type(app.get_job(session, job_id), Coroutine[Any, Any, duebox.JobInfo])
    assert_type((await found).due_at, datetime)
    assert_type(job_id, uuid.UUID)
    assert_type(await app.cancel(session, job_id), bool)
    assert_type(await app.reschedule(session, job_id, delay=timedelta(minutes=5)), None)
    ids = await app.schedule_many(session, [app.new_job("send-report")])
    assert_type(ids, list[uuid.UUID])
    # A coroutine, so it can be a task of its own.
    task = asyncio.create_task(app.schedule(session, "send-report"))
    assert_type(await task, uuid.UUID)


async def async_connection(conn: AsyncConnection) -> None:
    assert_type(await app.schedule(conn, "send-report"), uuid.UUID)


def schedules_sync(session: Session) -> None:
    schedule_id = app.schedules.add(session, "daily-report", "send-report", "0 9 * * *",
                                    timezone="Europe/Berlin", misfire="fire_once")
    assert_type(schedule_id, uuid.UUID)
    assert_type(app.schedules.get(session, "daily-report"), ScheduleInfo)
    assert_type(app.schedules.list(session), list[ScheduleInfo])
    assert_type(app.schedules.pause(session, schedule_id), bool)
    assert_type(app.schedules.resume(session, "daily-report"), datetime | None)
    assert_type(app.schedules.history(session, "daily-report"), list[Row[Any]])
    assert_type(app.schedules.delete(session, "daily-report"), DeleteResult)
    done = app.schedules.put(session, "daily-report", "send-report", "0 8 * * *",
                             timezone="Europe/Berlin", operator="deploy", reason="release")
    assert_type(done, PutResult)
    assert_type(done.changed, tuple[str, ...])


async def schedules_async(session: AsyncSession) -> None:
    schedule_id = await app.schedules.add(session, "nightly", "send-report", "30 2 * * *")
    assert_type(schedule_id, uuid.UUID)
    assert_type(await app.schedules.get(session, schedule_id), ScheduleInfo)
    assert_type(await app.schedules.list(session, include_paused=False), list[ScheduleInfo])
    assert_type(await app.schedules.pause(session, "nightly"), bool)
    assert_type(await app.schedules.resume(session, "nightly"), datetime | None)
    assert_type(await app.schedules.history(session, "nightly", 5), list[Row[Any]])
    assert_type(await app.schedules.delete(session, "nightly", cancel_pending=False),
                DeleteResult)
    assert_type(await app.schedules.put(session, "nightly", "send-report", "30 3 * * *"),
                PutResult)


@app.task("morning-digest", schedule="0 9 * * *", timezone="Europe/Berlin")
def morning_digest(payload: None, ctx: duebox.JobContext) -> None:
    return None


@app.task("sync-prices", schedule=[duebox.Periodic("*/15 * * * *", name="prices-eu",
                                                   payload={"region": "eu"})])
async def sync_prices(payload: dict[str, str], ctx: duebox.JobContext) -> None:
    return None


async def run_in_process() -> None:
    """The worker and the relay, in this program's event loop."""
    stop = asyncio.Event()
    worker = duebox.Worker(app, concurrency=4)
    relay = duebox.Relay(app)
    await asyncio.gather(worker.run(stop), relay.run(stop))
    async with duebox.Background(app, worker=duebox.Worker(app, queues=["default"])) as bg:
        assert_type(bg.worker, duebox.Worker | None)


def consumer_side() -> None:
    store = duebox.SQLDedupeStore()
    assert_type(store, duebox.SQLDedupeStore)
