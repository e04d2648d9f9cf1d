"""The read side of one job: typed read models for ``duebox jobs``, ``duebox
dlq show``, the dashboard's job page and :meth:`Duebox.get_job`.

Nothing here writes.  A job is found by its id, its business key, or an id
prefix as ``duebox jobs list`` and the dashboard print it; each is one
index-backed read (primary key, the unique key index, a primary-key range).
The health report (``duebox status``, the dashboard's overview) is in
:mod:`duebox.reads.status`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from sqlalchemy import Connection, Engine, select

from ..db import db_errors
from ..errors import AmbiguousJobError, DueboxError, JobNotFoundError, ValidationError
from ..leases.recovery import EnqueuedRef
from ..states import FINAL_STATES, JobState
from ..tables import attempt, audit, job
from .results import loaded, read_stmt

R = TypeVar("R")


def _from_row(cls: type[R], row: Any) -> R:
    """A read model from a result row with (at least) its fields' columns."""
    m = row._mapping
    return cls(**{f.name: m[f.name] for f in fields(cls)  # type: ignore[arg-type]
                  if f.name in m})


@dataclass(frozen=True)
class JobInfo:
    """A job as code shows it to its own users (:meth:`Duebox.get_job`).

    ``attempts`` counts the executions started so far; ``last_error`` is the
    latest failure's ``Class: message`` (unmasked: this is the app's own
    code reading its own data).  ``result``: what the handler returned, for
    a task with ``store_result=True`` until its ``result_ttl`` has passed
    (unmasked, as ``last_error``); ``has_result`` tells a kept ``None``
    from none kept."""

    id: uuid.UUID
    task: str
    queue: str
    state: JobState
    due_at: datetime
    attempts: int
    max_attempts: int
    version: int
    key: str | None
    tenant: str | None
    created_at: datetime
    finished_at: datetime | None
    last_error: str | None
    error_class: str | None
    result: Any = None
    has_result: bool = False

    @property
    def finished(self) -> bool:
        """Whether the job has ended (SUCCEEDED, DEAD, CANCELLED, EXPIRED, or
        DELIVERED to a consumer of your own): what :meth:`Duebox.wait_for`
        waits for."""
        return self.state in FINAL_STATES


@dataclass(frozen=True)
class JobView:
    """Every column of a job that a person reading about it wants."""

    id: uuid.UUID
    task: str
    queue: str
    state: str
    key: str | None
    tenant: str | None
    priority: int
    attempt: int
    max_attempts: int
    version: int
    payload: Any
    due_at: datetime
    created_at: datetime
    claimed_at: datetime | None
    published_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    lease_owner: str | None
    lease_until: datetime | None
    broker_message_id: str | None
    last_error: str | None
    error_class: str | None

    def record(self, result_text: str | None = None) -> JobInfo:
        """As :class:`JobInfo`, with the result's JSON text if one is kept."""
        return JobInfo(
            id=self.id, task=self.task, queue=self.queue, state=JobState(self.state),
            due_at=self.due_at, attempts=self.attempt, max_attempts=self.max_attempts,
            version=self.version, key=self.key, tenant=self.tenant,
            created_at=self.created_at, finished_at=self.finished_at,
            last_error=self.last_error, error_class=self.error_class,
            result=loaded(result_text), has_result=result_text is not None)


@dataclass(frozen=True)
class AttemptView:
    number: int
    worker: str | None
    outcome: str | None
    error_class: str | None
    error: str | None
    started_at: datetime
    finished_at: datetime | None
    traceback: str | None = None


@dataclass(frozen=True)
class AuditView:
    at: datetime
    operator: str
    action: str
    reason: str
    details: Any


@dataclass(frozen=True)
class TimelineEvent:
    name: str  # created, due, claimed, enqueued, started, finished
    at: datetime
    late_s: float | None  # seconds after the due time; None for created and due


@dataclass(frozen=True)
class JobDetail:
    job: JobView
    attempts: list[AttemptView]  # oldest first
    audits: list[AuditView]  # oldest first
    # The result's JSON text, for a task that keeps it (duebox.reads.results);
    # None: none kept.  Shown masked (duebox.masking).
    result_text: str | None = None

    def timeline(self) -> list[TimelineEvent]:
        return timeline(self.job)


_VIEW_COLUMNS = [job.c[f.name] for f in fields(JobView)]


def timeline(row: JobView) -> list[TimelineEvent]:
    """The job's lifecycle instants that have happened, in lifecycle order."""
    events = [("created", row.created_at), ("due", row.due_at), ("claimed", row.claimed_at),
              ("enqueued", row.published_at), ("started", row.started_at),
              ("finished", row.finished_at)]
    return [TimelineEvent(name, at, None if name in ("created", "due")
                          else (at - row.due_at).total_seconds())
            for name, at in events if at is not None]


# --- finding a job ----------------------------------------------------------------------

# A prefix shorter than this is too likely a word or a key to read as an id.
MIN_PREFIX = 4
# How many jobs an ambiguous prefix names.
CANDIDATES = 5
_HEX = frozenset("0123456789abcdef")

Reads = Generator[Any, Any, R]


def id_prefix(text: str) -> str | None:
    """The hex digits of ``text`` when it reads as the start of a job id as
    printed (``0190c2d4-7e1a``, with or without dashes, or cut with "…");
    None otherwise."""
    digits = text.strip().rstrip("…").replace("-", "").lower()
    if MIN_PREFIX <= len(digits) <= 32 and set(digits) <= _HEX:
        return digits
    return None


def prefix_range(digits: str) -> tuple[uuid.UUID, uuid.UUID]:
    """The ids that start with ``digits``: a primary-key range, so the
    look-up needs no LIKE (and no wildcard in the text can widen it)."""
    return (uuid.UUID(hex=digits.ljust(32, "0")), uuid.UUID(hex=digits.ljust(32, "f")))


def check_reference(value: object, field: str = "job") -> str | uuid.UUID:
    """A job reference as a user gives it: a UUID, or text the database can
    compare (a key or an id prefix)."""
    if isinstance(value, uuid.UUID):
        return value
    if not isinstance(value, str):
        raise ValidationError(field, "must be a job id, an id prefix or a key", value)
    text = value.strip()
    if not text:
        raise ValidationError(field, "must not be empty", value)
    if len(text) > 400:
        raise ValidationError(field, "must be at most 400 characters (a key's limit)", value)
    if any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise ValidationError(field, "must not contain control characters", value)
    try:
        return uuid.UUID(text) if len(text) >= 32 else text
    except ValueError:
        return text


def find_steps(ref: object, field: str = "job") -> Reads[uuid.UUID]:
    """The id of the job ``ref`` names: an id, else a business key, else an
    id prefix (which must name exactly one job)."""
    checked = check_reference(ref, field)
    if isinstance(checked, uuid.UUID):
        return checked
    found = (yield select(job.c.id).where(job.c.key == checked)).first()
    if found is not None:
        return uuid.UUID(str(found.id))
    digits = id_prefix(checked)
    if digits is None:
        raise JobNotFoundError(repr(checked))
    lo, hi = prefix_range(digits)
    rows = (yield select(job.c.id).where(job.c.id >= lo, job.c.id <= hi)
            .order_by(job.c.id).limit(CANDIDATES + 1)).all()
    if not rows:
        raise JobNotFoundError(repr(checked))
    if len(rows) > 1:
        raise AmbiguousJobError(field, checked, [str(r.id) for r in rows[:CANDIDATES]],
                                more=len(rows) > CANDIDATES)
    return uuid.UUID(str(rows[0].id))


def record_steps(ref: object) -> Reads[JobInfo]:
    """What :meth:`Duebox.get_job` reads: find the job, then its row."""
    jid = yield from find_steps(ref, "id_or_key")
    row = (yield select(*_VIEW_COLUMNS).where(job.c.id == jid)).first()
    if row is None:  # purged between the two reads
        raise JobNotFoundError(jid)
    view = _from_row(JobView, row)
    kept = (yield read_stmt(jid)).scalar() if view.state == JobState.SUCCEEDED else None
    return view.record(kept)


def run_reads(conn: Connection, steps: Reads[R]) -> R:
    """Run read steps on a sync connection."""
    try:
        stmt = next(steps)
        while True:
            stmt = steps.send(conn.execute(stmt))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def find_job(engine: Engine, ref: object, field: str = "JOB") -> uuid.UUID:
    with db_errors("jobs show"), engine.connect() as conn:
        return run_reads(conn, find_steps(ref, field))


@dataclass(frozen=True)
class JobFilter:
    """What ``duebox jobs list`` asks for."""

    state: str | None = None
    queue: str | None = None
    task: str | None = None
    key_prefix: str | None = None
    limit: int = 50


def _like_prefix(text: str) -> str:
    """``text`` as a LIKE prefix pattern: its own % and _ match only themselves."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def list_jobs(engine: Engine, f: JobFilter) -> list[JobView]:
    """The latest jobs by due time matching ``f`` (at most ``f.limit``)."""
    stmt = select(*_VIEW_COLUMNS)
    if f.state:
        stmt = stmt.where(job.c.state == f.state.upper())
    if f.queue:
        stmt = stmt.where(job.c.queue == f.queue)
    if f.task:
        stmt = stmt.where(job.c.task == f.task)
    if f.key_prefix:
        stmt = stmt.where(job.c.key.like(_like_prefix(f.key_prefix), escape="\\"))
    stmt = stmt.order_by(job.c.due_at.desc(), job.c.id.desc()).limit(f.limit)
    with db_errors("jobs list"), engine.connect() as conn:
        return [_from_row(JobView, r) for r in conn.execute(stmt).all()]


def payloads(conn: Connection, ids: list[uuid.UUID]) -> dict[uuid.UUID, Any]:
    """The payloads of a page of jobs (primary-key lookups): what masking a
    page's error text needs."""
    if not ids:
        return {}
    rows = conn.execute(select(job.c.id, job.c.payload).where(job.c.id.in_(ids))).all()
    return {r.id: r.payload for r in rows}


# A job's attempts and audit rows are few; these caps keep a pathological
# one (replayed thousands of times) from turning a page into a huge read.
DETAIL_CAP = 500


def load_job(engine: Engine, job_id: uuid.UUID, cap: int = DETAIL_CAP) -> JobDetail:
    """The job, its attempts and its audit rows (primary key and the
    ``job_id`` indexes; at most ``cap`` of each, the latest)."""
    with db_errors("jobs show"), engine.connect() as conn:
        row = conn.execute(select(*_VIEW_COLUMNS).where(job.c.id == job_id)).first()
        if row is None:
            raise JobNotFoundError(job_id)
        attempts = conn.execute(
            select(attempt).where(attempt.c.job_id == job_id)
            .order_by(attempt.c.number.desc()).limit(cap)
        ).all()
        audits = conn.execute(
            select(audit).where(audit.c.job_id == job_id).order_by(audit.c.at.desc()).limit(cap)
        ).all()
        kept = conn.execute(read_stmt(job_id)).scalar()
    return JobDetail(_from_row(JobView, row),
                     sorted((_from_row(AttemptView, a) for a in attempts),
                            key=lambda a: a.started_at),
                     sorted((_from_row(AuditView, a) for a in audits), key=lambda a: a.at),
                     kept)


# --- where the job is now ---------------------------------------------------------------


def _fmt(ts: datetime | None) -> str:
    return ts.isoformat(timespec="milliseconds") if ts else "-"


# Where a backend says an ENQUEUED job's message is (Broker.locate).
Locate = Callable[[EnqueuedRef, datetime], str]


class _WithBroker(Protocol):
    """What :func:`locator` needs of a :class:`~duebox.Duebox` (the read side
    sits below the app)."""

    settings: Any

    @property
    def routes(self) -> Any: ...

    def broker(self, worker_name: str = ..., *, queue: str | None = ...) -> Any: ...


def locator(app: _WithBroker) -> Locate:
    """The app's broker's :meth:`~duebox.brokers.base.Broker.locate` (building
    a broker object connects to nothing), or plain words where that broker
    cannot be built here (its client library is not installed)."""
    try:
        locate: Locate = app.broker("inspect").locate
        # A queue routed to another broker (docs/brokers.md, "Routing"): its.
        routed: dict[str, Locate] = {q: app.broker("inspect", queue=q).locate
                                     for q in app.routes.routed}
    except (DueboxError, ImportError):
        scheme = urlsplit(app.settings.broker_url).scheme or "configured"
        return lambda job, now: f"in the {scheme} broker"
    if not routed:
        return locate
    return lambda job, now: routed.get(job.queue, locate)(job, now)


def where_now(row: JobView, locate: Locate, now: datetime) -> str:
    """Where the job is now, in words: the database's part from its state,
    the broker's part from the backend (``locate``)."""
    state = row.state
    if state == JobState.SCHEDULED:
        wait = (row.due_at - now).total_seconds()
        if wait > 0:
            return f"parked in the database, due in {wait:.1f} s"
        return f"in the database, due {-wait:.1f} s ago, waiting to be claimed"
    if state == JobState.DISPATCHING:
        return f"claimed by relay {row.lease_owner}, lease until {_fmt(row.lease_until)}"
    if state == JobState.ENQUEUED:
        wait = (row.due_at - now).total_seconds()
        due = f"due in {wait:.1f} s" if wait > 0 else "due, waiting for a worker"
        where = locate(EnqueuedRef(row.id, row.version, row.queue, row.due_at,
                                   row.published_at), now)
        mid = f" as message {row.broker_message_id}" if row.broker_message_id else ""
        return f"{where}, {due}{mid}, handed over {_fmt(row.published_at)}"
    if state == JobState.RUNNING:
        return f"running on {row.lease_owner}, lease until {_fmt(row.lease_until)}"
    if state == JobState.DELIVERED:
        return (f"delivered: handed over {_fmt(row.published_at)} to queue {row.queue}, "
                "which your own consumer reads; duebox's part is done")
    return f"finished: {state}"
