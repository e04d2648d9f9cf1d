"""Misuse that ``mypy --strict`` must reject: each line marked ``# E`` is an
error, and no other line is (tests/test_typing.py checks both)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import TypedDict

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, scoped_session

import duebox

app = duebox.Duebox()


async def forgot_await(session: AsyncSession) -> None:
    job_id = app.schedule(session, "send-reminder")
    app.cancel(session, job_id)  # E: a coroutine is not a job id


def awaited_a_sync_result(session: Session) -> Awaitable[uuid.UUID]:
    return app.schedule(session, "send-reminder")  # E: a UUID, not an awaitable


def not_a_session(registry: scoped_session[Session]) -> None:
    app.schedule(registry, "send-reminder")  # E: call the registry: registry()


def not_a_worker() -> None:
    duebox.Worker("app")  # E: a Worker takes the app


class Reminder(TypedDict):
    order_id: int


@app.task("send-reminder")
def send_reminder(payload: Reminder, ctx: duebox.JobContext) -> None:
    return None


def wrong_payload(session: Session) -> None:
    send_reminder.schedule(session, {"order_id": "42"})  # E: order_id is an int
    send_reminder.enqueue([42])  # E: a list is not a Reminder
    send_reminder.schedule(session, {"order_id": 42}, dealy=60)  # E: no such option


async def forgot_await_on_the_handle(session: AsyncSession) -> uuid.UUID:
    return send_reminder.schedule(session, {"order_id": 42})  # E: a coroutine, not a job id
