"""Writing jobs into the caller's own transaction (the transactional outbox).

``schedule``, ``cancel`` and ``reschedule`` accept a sync ``Session``, a Core
``Connection``, an ``AsyncSession`` or an ``AsyncConnection``.  They never
commit: the job becomes visible exactly when the caller's business write does.
The logic is written once as a generator of statements and driven either
synchronously or with ``await``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, func, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable

from .db import NOTIFY_CHANNEL, insert_if_absent
from .errors import JobNotFoundError, JobStateError, ValidationError
from .ids import parse_job_id, uuid7
from .states import ACTIVE_STATES, RESCHEDULABLE_STATES, JobState
from .tables import audit, job

T = TypeVar("T")
# A step is a statement, or a statement and its parameter sets (an executemany).
Step = Executable | tuple[Executable, list[dict[str, Any]]]
Steps = Generator[Step, CursorResult[Any], T]

_INT32 = 2**31 - 1


@dataclass(frozen=True, slots=True)
class NewJob:
    """A validated job, ready to insert."""

    task: str
    queue: str
    payload: Any
    due_at: datetime
    max_attempts: int
    key: str | None = None
    priority: int = 0
    tenant: str | None = None
    expires_at: datetime | None = None
    headers: dict[str, Any] | None = None
    schedule_id: uuid.UUID | None = None
    nominal_fire_at: datetime | None = None

    def row(self, job_id: uuid.UUID, now: datetime) -> dict[str, Any]:
        return {
            "id": job_id, "task": self.task, "queue": self.queue, "payload": self.payload,
            "headers": self.headers, "due_at": self.due_at, "state": JobState.SCHEDULED,
            "version": 1, "attempt": 0, "max_attempts": self.max_attempts,
            "priority": self.priority, "tenant": self.tenant, "key": self.key,
            "schedule_id": self.schedule_id, "nominal_fire_at": self.nominal_fire_at,
            "expires_at": self.expires_at, "lease_generation": 0, "created_at": now,
            "updated_at": now,
        }


# --- validation at the boundary --------------------------------------------


def aware(field: str, value: object) -> datetime:
    if not isinstance(value, datetime):
        raise ValidationError(field, "must be a timezone-aware datetime", value)
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValidationError(
            field, "must be timezone-aware (naive datetimes are ambiguous; use tzinfo=UTC)",
            value,
        )
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValidationError(field, "must be within years 1 to 9999 in UTC", value) from None


def resolve_due(now: datetime, at: object, delay: object) -> datetime:
    if at is not None and delay is not None:
        raise ValidationError("at/delay", "give at most one of at= and delay=")
    if at is not None:
        return aware("at", at)
    if delay is None:
        return now
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise ValidationError("delay", "must be a timedelta or a number of seconds", delay)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValidationError("delay", "must be a finite number of seconds >= 0", delay)
    try:
        return now + timedelta(seconds=seconds)
    except OverflowError:
        raise ValidationError("delay", "must end before the year 9999", delay) from None


def check_payload(payload: object, field: str = "payload") -> int:
    """Refuse what JSON cannot carry faithfully; return the encoded size in bytes."""
    try:
        text = json.dumps(payload, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValidationError(field, f"must be JSON-serialisable ({exc})") from None
    return len(text.encode())


def check_size(size: int, limit: int, where: str) -> None:
    """A job whose message the broker would refuse is refused here, at
    schedule(), not by the relay long after the caller committed."""
    if size > limit:
        raise ValidationError(
            "payload", f"payload and headers must encode to at most {limit} bytes of JSON "
            f"({where})", f"{size} bytes")


def check_optional_str(field: str, value: object, limit: int) -> None:
    if value is not None and (not isinstance(value, str) or not value or len(value) > limit):
        raise ValidationError(field, f"must be a non-empty string of at most {limit} characters",
                              value)


def check_priority(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not -_INT32 <= value <= _INT32:
        raise ValidationError("priority", "must be a 32-bit integer", value)
    return value


# --- executing against whatever the caller holds ---------------------------


Target = Session | Connection | AsyncSession | AsyncConnection


def dialect_of(target: object) -> str:
    if isinstance(target, Session | AsyncSession):
        return str(target.get_bind().dialect.name)
    if isinstance(target, Connection | AsyncConnection):
        return str(target.dialect.name)
    raise ValidationError(
        "session",
        "must be a SQLAlchemy Session, AsyncSession, Connection or AsyncConnection "
        "with an open transaction",
        target,
    )


def drive(target: Target, steps: Steps[T]) -> T | Awaitable[T]:
    """Run ``steps`` on ``target``: directly for sync, as a coroutine for async."""
    if isinstance(target, AsyncSession | AsyncConnection):
        return _drive_async(target.execute, steps)
    return _drive_sync(target.execute, steps)


def _drive_sync(execute: Callable[..., Any], steps: Steps[T]) -> T:
    try:
        step = next(steps)
        while True:
            step = steps.send(execute(*_args(step)))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def _drive_async(execute: Callable[..., Awaitable[Any]], steps: Steps[T]) -> T:
    try:
        step = next(steps)
        while True:
            step = steps.send(await execute(*_args(step)))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _args(step: Step) -> tuple[Any, ...]:
    return step if isinstance(step, tuple) else (step,)


# --- the three producer operations -----------------------------------------


def insert_steps(
    new: NewJob, dialect: str, now: datetime, notify: bool
) -> Steps[uuid.UUID]:
    job_id = uuid7()
    if new.key is None:
        yield job.insert().values(new.row(job_id, now))
    else:
        result = yield insert_if_absent(job, new.row(job_id, now), dialect, ["key"])
        if result.rowcount != 1:
            existing = yield select(job.c.id).where(job.c.key == new.key)
            return uuid.UUID(str(existing.scalar_one()))
    if notify and dialect == "postgresql":
        yield select(func.pg_notify(NOTIFY_CHANNEL, ""))
    return job_id


def insert_many_steps(
    new_jobs: list[NewJob], dialect: str, now: datetime, notify: bool
) -> Steps[list[uuid.UUID]]:
    """Insert many keyless jobs with one executemany."""
    ids = [uuid7() for _ in new_jobs]
    if ids:
        # A true executemany: one cached statement.  A multi-VALUES insert
        # would be compiled afresh for every call, with a bind per cell.
        yield job.insert(), [n.row(i, now) for n, i in zip(new_jobs, ids, strict=True)]
        if notify and dialect == "postgresql":
            yield select(func.pg_notify(NOTIFY_CHANNEL, ""))
    return ids


def cancel_steps(
    job_id: object, now: datetime, operator: str | None, reason: str | None
) -> Steps[bool]:
    jid = parse_job_id(job_id)
    result = yield (
        update(job)
        .where(job.c.id == jid, job.c.state.in_(list(ACTIVE_STATES)))
        .values(state=JobState.CANCELLED, version=job.c.version + 1, lease_owner=None,
                lease_until=None, finished_at=now, updated_at=now)
    )
    if result.rowcount == 0:
        found = yield select(job.c.state).where(job.c.id == jid)
        if found.first() is None:
            raise JobNotFoundError(jid)
        return False
    if operator is not None:
        yield audit.insert().values(
            id=uuid7(), at=now, operator=operator, action="cancel", job_id=jid,
            reason=reason or "", details=None,
        )
    return True


def reschedule_steps(job_id: object, due_at: datetime, now: datetime, notify: bool,
                     dialect: str) -> Steps[None]:
    jid = parse_job_id(job_id)
    result = yield (
        update(job)
        .where(job.c.id == jid, job.c.state.in_(list(RESCHEDULABLE_STATES)))
        .values(state=JobState.SCHEDULED, due_at=due_at, version=job.c.version + 1,
                lease_owner=None, lease_until=None, updated_at=now)
    )
    if result.rowcount == 0:
        found = yield select(job.c.state).where(job.c.id == jid)
        row = found.first()
        if row is None:
            raise JobNotFoundError(jid)
        raise JobStateError(
            f"job {jid}: is {row[0]}; only SCHEDULED, DISPATCHING or ENQUEUED jobs can be "
            f"rescheduled"
        )
    if notify and dialect == "postgresql":
        yield select(func.pg_notify(NOTIFY_CHANNEL, ""))
