"""A leased job as the claims and starts return it, and the helpers every
state transition shares: the row's columns, the primary-key hint MySQL
needs, and the attempt row a run opens.

Below both core/leases/claims.py (SCHEDULED → leased) and core/leases/jobstore.py (a
started job's life), so neither imports the other's internals.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Text, cast
from sqlalchemy.sql import Update

from ..ids import uuid7
from ..message import JobMessage, lenient_json, passed_on
from ..tables import attempt, job

ROW_COLUMNS = (
    job.c.id,
    job.c.task,
    job.c.queue,
    job.c.payload,
    job.c.headers,
    job.c.due_at,
    job.c.version,
    job.c.attempt,
    job.c.max_attempts,
    job.c.priority,
    job.c.tenant,
    job.c.key,
    job.c.expires_at,
    job.c.lease_owner,
    job.c.lease_generation,
    job.c.checkpoint,
    job.c.published_at,
)


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A leased job as the claim or start returned it."""

    id: uuid.UUID
    task: str
    queue: str
    payload: Any
    headers: Any
    due_at: datetime
    version: int
    attempt: int
    max_attempts: int
    priority: int
    tenant: str | None
    key: str | None
    expires_at: datetime | None
    lease_owner: str | None
    lease_generation: int
    checkpoint: Any = None
    published_at: datetime | None = None  # the last hand-over to the broker (metrics)
    attempt_id: uuid.UUID | None = None

    def to_message(self) -> JobMessage:
        return JobMessage(
            job_id=self.id,
            task=self.task,
            queue=self.queue,
            version=self.version,
            attempt=self.attempt,
            due_at=self.due_at,
            payload=self.payload,
            headers=dict(self.headers or {}),
        )

    def expired(self, now: datetime) -> bool:
        """Past ``expires_at`` at the instant the job would start: the later
        of ``now`` and its due time, as duebox.leases.claims.startable checks it."""
        return self.expires_at is not None and self.expires_at <= max(now, self.due_at)


def records(rows: Sequence[Any]) -> list[JobRecord]:
    return [JobRecord(*row) for row in rows]


# The relay's claims on PostgreSQL read the payload and the headers as the
# text jsonb gives: the payload goes into the message body unparsed
# (message.passed_on), the headers are parsed only when there are any.
DISPATCH_COLUMNS = (*ROW_COLUMNS[:3], cast(job.c.payload, Text).label("payload"),
                    cast(job.c.headers, Text).label("headers"), *ROW_COLUMNS[5:])


def dispatch_columns(dialect: str) -> tuple[Any, ...]:
    """The columns a relay's claim returns on ``dialect``, for
    :func:`dispatch_records`: elsewhere JSON columns hold whatever text was
    written (SQLite, MySQL do not check it), so they are parsed as usual."""
    return DISPATCH_COLUMNS if dialect == "postgresql" else ROW_COLUMNS


def dispatch_records(rows: Sequence[Any], dialect: str) -> list[JobRecord]:
    """The records of rows read with :func:`dispatch_columns`."""
    if dialect != "postgresql":
        return records(rows)
    return [JobRecord(row[0], row[1], row[2], passed_on(row[3]),
                      None if row[4] is None or row[4] == "null" else lenient_json(row[4]),
                      *row[5:]) for row in rows]


def by_primary_key(stmt: Update) -> Update:
    """An UPDATE of given job rows (``id IN (...)``), made to find them
    through the primary key on MySQL/MariaDB.

    The lock order of every duebox transaction that waits for job rows: the
    row (primary key) first, then the entries of the secondary indexes its
    update changes.  With a condition on ``state`` beside the ids, InnoDB
    may instead scan the ``(state, due_at)`` index, locking an entry there
    before its row: against a worker's start, which holds the row and waits
    for that entry, a deadlock (a relay's mark and a start, every few runs of
    the invariant tests, issue #24).  Scans of that index that lock happen
    only in claims, with SKIP LOCKED, which never wait."""
    return (stmt.with_hint("FORCE INDEX (PRIMARY)", dialect_name="mysql")
            .with_hint("FORCE INDEX (PRIMARY)", dialect_name="mariadb"))


_INSERT_ATTEMPT = attempt.insert()


def open_attempts(
    conn: Connection, records: list[JobRecord], now: datetime, worker: str
) -> list[JobRecord]:
    if not records:
        return records
    opened = []
    rows = []
    for rec in records:
        attempt_id = uuid7()
        opened.append(_with_attempt(rec, attempt_id))
        rows.append({"id": attempt_id, "job_id": rec.id, "number": rec.attempt, "worker": worker,
                     "lease_generation": rec.lease_generation,
                     "started_at": max(now, rec.due_at)})
    conn.execute(_INSERT_ATTEMPT, rows)
    return opened


def _with_attempt(rec: JobRecord, attempt_id: uuid.UUID) -> JobRecord:
    values = {name: getattr(rec, name) for name in JobRecord.__slots__}
    values["attempt_id"] = attempt_id
    return JobRecord(**values)


__all__ = ["DISPATCH_COLUMNS", "ROW_COLUMNS", "JobRecord", "by_primary_key", "dispatch_columns",
           "dispatch_records", "open_attempts", "records"]
