"""Writing jobs into the caller's own transaction (the transactional outbox).

``schedule``, ``cancel`` and ``reschedule`` accept a sync ``Session``, a Core
``Connection``, an ``AsyncSession`` or an ``AsyncConnection``.  They never
commit: the job becomes visible exactly when the caller's business write does.
The logic is written once as a generator of statements and driven either
synchronously or with ``await``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypedDict, TypeVar

from sqlalchemy import Connection, Engine, func, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement, Executable

from .clock import as_utc, server_now_sql, server_time_after
from .db import NOTIFY_CHANNEL, insert_if_absent, tables_present
from .errors import JobNotFoundError, JobStateError, TablesMissingError, ValidationError
from .ids import parse_job_id, uuid7, uuid7_many
from .states import CANCELLABLE_STATES, RESCHEDULABLE_STATES, JobState
from .tables import audit, job, shard_of
from .validation import LATEST, aware, check_json, encode_json, seconds_of

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Copy:
    """``COPY table (columns) FROM STDIN`` of ``rows`` on the driver connection
    under the caller's transaction (psycopg 3 only)."""

    sql: str
    rows: list[tuple[Any, ...]]


@dataclass(frozen=True, slots=True)
class HasTables:
    """Whether duebox's tables are in the target's database: True or False,
    never an error (db.tables_present), so the caller's transaction stays
    usable when they are not."""


# A step is a statement, a statement and its parameters (a list of sets: an
# executemany), a COPY, or the question HasTables.
Step = Executable | tuple[Executable, list[dict[str, Any]] | dict[str, Any]] | Copy | HasTables
Steps = Generator[Step, CursorResult[Any], T]

_INT32 = 2**31 - 1
_RESCHEDULABLE = [s.value for s in JobState if s in RESCHEDULABLE_STATES]


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
    # The JSON text new_job() already encoded to check the size, kept so a
    # COPY does not encode it again.  None: encode when needed.
    payload_json: str | None = field(default=None, compare=False, repr=False)
    headers_json: str | None = field(default=None, compare=False, repr=False)
    # How long after it is written the job is due (delay=; zero without at=
    # or delay=), or None for at=.  ``due_at`` is then an estimate on the
    # app's clock; with the default DatabaseClock the database counts the
    # delay from its own time when it writes the row (insert_steps).
    delay: timedelta | None = None

    def due_from(self, base: datetime | None) -> datetime:
        """The due time counted from ``base``, the database's time at the
        write; without one (or for at=), ``due_at``."""
        return self.due_at if base is None or self.delay is None else base + self.delay

    def row(self, job_id: uuid.UUID, now: datetime, base: datetime | None = None
            ) -> dict[str, Any]:
        return {
            "id": job_id, "task": self.task, "queue": self.queue, "payload": self.payload,
            "headers": self.headers, "due_at": self.due_from(base), "state": JobState.SCHEDULED,
            "version": 1, "attempt": 0, "max_attempts": self.max_attempts,
            "priority": self.priority, "tenant": self.tenant, "key": self.key,
            "schedule_id": self.schedule_id, "nominal_fire_at": self.nominal_fire_at,
            "expires_at": self.expires_at, "lease_generation": 0, "created_at": now,
            "updated_at": now,
            # Given, not left to the column's Python default, which SQLAlchemy
            # would call once per row of an executemany.
            "shard": shard_of(job_id),
        }

    def copy_row(self, job_id: uuid.UUID, now: datetime, base: datetime | None = None
                 ) -> tuple[Any, ...]:
        """The row in COPY_COLUMNS order.  JSON goes as text: a Python None
        is the JSON ``null`` there, as SQLAlchemy's JSON type stores it."""
        payload = self.payload_json
        if payload is None:
            payload = encode_json(self.payload, "payload")
        headers = self.headers_json
        if headers is None:
            headers = encode_json(self.headers, "headers")
        return (job_id, self.task, self.queue, payload, headers, self.due_from(base),
                _SCHEDULED, 1, 0,
                self.max_attempts, self.priority, self.tenant, self.key, self.schedule_id,
                self.nominal_fire_at, self.expires_at, 0, now, now, shard_of(job_id))


# A plain str: psycopg would dump an Enum member by its name.
_SCHEDULED = str(JobState.SCHEDULED.value)
COPY_COLUMNS = ("id", "task", "queue", "payload", "headers", "due_at", "state", "version",
                "attempt", "max_attempts", "priority", "tenant", "key", "schedule_id",
                "nominal_fire_at", "expires_at", "lease_generation", "created_at",
                "updated_at", "shard")
_COPY_JOBS = f"COPY {job.name} ({', '.join(COPY_COLUMNS)}) FROM STDIN"


class JobOptions(TypedDict, total=False):
    """The options every way of scheduling one job takes after the task's
    name and payload (``app.schedule``, ``app.enqueue``, a task handle's
    ``schedule``/``enqueue``); ``app.new_job`` says what each one means."""

    at: datetime | None
    delay: timedelta | float | None
    key: str | None
    priority: int
    tenant: str | None
    expires_at: datetime | None
    headers: dict[str, Any] | None


# --- validation at the boundary --------------------------------------------


_NO_DELAY = timedelta(0)


def resolve_due(now: datetime, at: object, delay: object) -> tuple[datetime, timedelta | None]:
    """The due time (``now`` plus ``delay``, or ``at``) and the delay it was
    counted with: None for ``at=``, whose instant is absolute.  With a
    delay, ``now`` is only an estimate for checks; the database's own clock
    may count the delay when the row is written (:func:`insert_steps`)."""
    if at is not None and delay is not None:
        raise ValidationError("at/delay", "give at most one of at= and delay=")
    if at is not None:
        return aware("at", at), None
    if delay is None:
        return now, _NO_DELAY
    seconds = seconds_of("delay", delay)
    if seconds >= (LATEST - now).total_seconds():
        raise ValidationError("delay", f"must end before {LATEST:%Y-%m-%d} UTC", delay)
    span = delay if isinstance(delay, timedelta) else timedelta(seconds=seconds)
    return now + span, span


def json_size(text: str) -> int:
    """Bytes of UTF-8: the same as characters for ASCII, which the encoder's
    ``ensure_ascii`` makes every text it writes."""
    return len(text) if text.isascii() else len(text.encode())


def check_payload(payload: object, limit: tuple[int, str], field: str = "payload") -> str:
    """The JSON text of ``payload`` once it is known to fit ``limit`` and to
    come back equal (duebox.validation); the caller stores that text."""
    text = encode_json(payload, field)
    check_size(json_size(text), *limit)
    check_json(payload, field)
    return text


def check_size(size: int, limit: int, where: str) -> None:
    """A job whose message the broker would refuse is refused here, at
    schedule(), not by the relay long after the caller committed."""
    if size > limit:
        raise ValidationError(
            "payload", f"payload and headers must encode to at most {limit} bytes of JSON "
            f"({where})", f"{size} bytes")


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
        return _drive_async(target, steps)
    return drive_sync(target, steps)


def drive_sync(target: Session | Connection, steps: Steps[T]) -> T:
    """:func:`drive` for a caller that holds a sync target (typed as such)."""
    try:
        step = next(steps)
        while True:
            result: Any = None  # a COPY has no result to read
            if isinstance(step, Copy | HasTables):
                conn = target.connection() if isinstance(target, Session) else target
                if isinstance(step, HasTables):
                    result = tables_present(conn)
                else:
                    _copy_sync(conn, step)
            else:
                result = target.execute(*_args(step))
            step = steps.send(result)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def _drive_async(target: AsyncSession | AsyncConnection, steps: Steps[T]) -> T:
    try:
        step = next(steps)
        while True:
            result: Any = None  # a COPY has no result to read
            if isinstance(step, Copy | HasTables):
                conn = (await target.connection() if isinstance(target, AsyncSession)
                        else target)
                if isinstance(step, HasTables):
                    result = await conn.run_sync(tables_present)
                else:
                    await _copy_async(conn.sync_connection, step)  # type: ignore[arg-type]
            else:
                result = await target.execute(*_args(step))
            step = steps.send(result)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _args(step: Step) -> tuple[Any, ...]:
    return step if isinstance(step, tuple) else (step,)


def _bind(target: Target) -> Engine | Connection | AsyncConnection:
    return target.get_bind() if isinstance(target, Session | AsyncSession) else target


def copy_capable(target: Target) -> bool:
    """Whether ``target`` runs on psycopg 3, whose COPY a Copy step uses."""
    return _bind(target).dialect.driver == "psycopg"


def engine_of(target: Target) -> Engine:
    """The (sync) engine ``target`` runs on."""
    bind = _bind(target)
    if isinstance(bind, AsyncConnection):
        return bind.sync_engine
    return bind if isinstance(bind, Engine) else bind.engine


def tables_first(steps: Steps[T], action: str, engine: Engine,
                 found: Callable[[Engine], None]) -> Generator[Step, Any, T]:
    """``steps``, after checking that duebox's tables are there: a
    :class:`TablesMissingError` saying to run ``duebox db upgrade`` before
    anything is written, instead of the database's error (which, on
    PostgreSQL, would also abort the caller's transaction).  ``found`` is
    told the engine once they are, so an app asks once per engine."""
    if not (yield HasTables()):
        raise TablesMissingError(action, engine.url.render_as_string(hide_password=True),
                                 "run `duebox db upgrade` against it first (or, in code, "
                                 "duebox.migrate.upgrade(app.engine))")
    found(engine)
    return (yield from steps)


def _raw(conn: Connection) -> Any:
    """The driver connection, inside the SQLAlchemy transaction: a Connection
    the caller has not begun yet (commit-as-you-go) is begun here as its
    first execute() would, so the caller's commit() commits the COPY."""
    if not conn.in_transaction():
        conn.begin()
    return conn.connection.driver_connection


def _wrapped(conn: Connection, step: Copy, exc: Exception) -> BaseException:
    """The driver's error as SQLAlchemy raises it for execute() (IntegrityError,
    ...), so callers catch one family whichever path wrote their jobs."""
    return sa_exc.DBAPIError.instance(step.sql, None, exc, conn.dialect.loaded_dbapi.Error,
                                      dialect=conn.dialect)


def _copy_sync(conn: Connection, step: Copy) -> None:
    raw = _raw(conn)
    try:
        with raw.cursor() as cur, cur.copy(step.sql) as copy:
            for row in step.rows:
                copy.write_row(row)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise _wrapped(conn, step, exc) from exc


async def _copy_async(conn: Connection, step: Copy) -> None:
    raw = _raw(conn)
    try:
        async with raw.cursor() as cur, cur.copy(step.sql) as copy:
            for row in step.rows:
                await copy.write_row(row)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise _wrapped(conn, step, exc) from exc


# --- the three producer operations -----------------------------------------


def insert_steps(
    new: NewJob, dialect: str, now: datetime, notify: bool, server_clock: bool = False
) -> Steps[uuid.UUID]:
    """Insert one job.  With ``server_clock`` its delay is counted by the
    database, from its own time as it writes the row: no round trip more,
    and a producer whose clock lags cannot make the job early."""
    job_id = uuid7()
    row = new.row(job_id, now)
    params: dict[str, Any] = {}
    later = (server_time_after(dialect, new.delay) if server_clock and new.delay is not None
             else None)
    if later is not None:
        row["due_at"], params = later
    if new.key is None:
        yield job.insert().values(row), params
    else:
        result = yield insert_if_absent(job, row, dialect, ["key"]), params
        if result.rowcount != 1:
            existing = yield select(job.c.id).where(job.c.key == new.key)
            return uuid.UUID(str(existing.scalar_one()))
    if notify and dialect == "postgresql":
        yield select(func.pg_notify(NOTIFY_CHANNEL, ""))
    return job_id


def insert_many_steps(
    new_jobs: list[NewJob], dialect: str, now: datetime, notify: bool, copy: bool = False,
    server_clock: bool = False,
) -> Steps[list[uuid.UUID]]:
    """Insert many keyless jobs: with ``copy`` (PostgreSQL on psycopg 3) one
    COPY, else one executemany.  With ``server_clock`` the delays count from
    the database's time, read once first (a COPY carries values, not SQL)."""
    ids = uuid7_many(len(new_jobs))
    if ids:
        base = None
        sql = server_now_sql(dialect) if server_clock else None
        if sql is not None and any(n.delay is not None for n in new_jobs):
            base = as_utc((yield sql).scalar_one())
        if copy:
            # COPY skips SQLAlchemy's per-row bind processing and psycopg's
            # per-statement pipeline round: about 3x the rows per CPU second
            # of the executemany (bench/enqueue.py).
            yield Copy(_COPY_JOBS, [n.copy_row(i, now, base)
                                    for n, i in zip(new_jobs, ids, strict=True)])
        else:
            # A true executemany: one cached statement.  A multi-VALUES insert
            # would be compiled afresh for every call, with a bind per cell.
            yield job.insert(), [n.row(i, now, base) for n, i in zip(new_jobs, ids, strict=True)]
        if notify and dialect == "postgresql":
            yield select(func.pg_notify(NOTIFY_CHANNEL, ""))
    return ids


def cancel_steps(
    job_id: object, now: datetime, operator: str | None, reason: str | None,
    states: Iterable[JobState] = CANCELLABLE_STATES, details: dict[str, Any] | None = None,
) -> Steps[bool]:
    """Cancel the job if it is in one of ``states`` (by default any not
    finished, and DELIVERED: not yet handled by your own consumer's
    completion); with an ``operator``, an audit row in the same transaction."""
    jid = parse_job_id(job_id)
    result = yield (
        update(job)
        .where(job.c.id == jid, job.c.state.in_(list(states)))
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
            reason=reason or "", details=details,
        )
    return True


def reschedule_steps(job_id: object, due_at: datetime, delay: timedelta | None, now: datetime,
                     notify: bool, dialect: str, server_clock: bool) -> Steps[None]:
    """Move the job to ``due_at``; with ``delay`` and ``server_clock``, to the
    database's time plus ``delay`` (as insert_steps)."""
    jid = parse_job_id(job_id)
    due: datetime | ColumnElement[datetime] = due_at
    params: dict[str, Any] = {}
    later = server_time_after(dialect, delay) if server_clock and delay is not None else None
    if later is not None:
        due, params = later
    result = yield (
        update(job)
        .where(job.c.id == jid, job.c.state.in_(list(RESCHEDULABLE_STATES)))
        # finished_at: a DELIVERED job had the publish time there.
        .values(state=JobState.SCHEDULED, due_at=due, version=job.c.version + 1,
                lease_owner=None, lease_until=None, finished_at=None, updated_at=now),
        params,
    )
    if result.rowcount == 0:
        found = yield select(job.c.state).where(job.c.id == jid)
        row = found.first()
        if row is None:
            raise JobNotFoundError(jid)
        raise JobStateError(
            f"job {jid}: is {row[0]}; only {', '.join(_RESCHEDULABLE[:-1])} or "
            f"{_RESCHEDULABLE[-1]} jobs can be rescheduled")
    if notify and dialect == "postgresql":
        yield select(func.pg_notify(NOTIFY_CHANNEL, ""))
