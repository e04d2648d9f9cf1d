"""Jobs run straight from their deliveries, with no start transaction of
their own: the statements of the worker's batch lane (consumers/lane.py).

A job started the usual way costs two transactions: the version-checked
start (ENQUEUED → RUNNING, leased, committed) and the handler's (RUNNING →
SUCCEEDED).  In the lane both are one.  Its rows are locked, in id order,
by a version-checked ``SELECT ... FOR UPDATE SKIP LOCKED``, and stay
locked until the commit that completes them: the lock is the lease (the
design's invariant 4 holds under it — nobody can cancel, reschedule, claim
or start a locked row; a cancel waits and then finds the job finished).  A
row another transaction holds is skipped, not waited for: its delivery
takes the usual path.  If the worker dies, its transaction dies with its
connection: the rows were never changed, and the broker redelivers the
unacknowledged messages (the lane runs only on brokers that do).

Per job, one row version (ENQUEUED → SUCCEEDED) instead of three, and one
attempt row written once, finished, instead of inserted and updated.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, bindparam, case, or_, select, tuple_, update

from .errors import LeaseLostError
from .ids import uuid7
from .message import JobMessage
from .records import ROW_COLUMNS, JobRecord, by_primary_key, open_attempts
from .records import records as read_records
from .states import STARTABLE_STATES, JobState
from .tables import attempt, job

_NOW = bindparam("u_now", type_=job.c.updated_at.type)
# Spelled out, not ``IN (...)``: an expanding list cannot go with executemany.
_STARTABLE = or_(*(job.c.state == state for state in sorted(STARTABLE_STATES)))
# Startable rows of these (id, version) pairs, due, not expired: locked in
# id order (one order for every transaction), skipping rows another holds.
_LOCK = (
    select(*ROW_COLUMNS, job.c.state)
    .where(tuple_(job.c.id, job.c.version).in_(bindparam("u_pairs", expanding=True)),
           job.c.state.in_(list(STARTABLE_STATES)),
           job.c.due_at <= _NOW,
           or_(job.c.expires_at.is_(None), job.c.expires_at > _NOW))
    .order_by(job.c.id)
    .with_for_update(skip_locked=True)
)
# ENQUEUED (or still DISPATCHING: the message overtook the relay's mark) →
# SUCCEEDED in one step, with what the start would have written.  One row
# per job (executemany): each has its own start time.
_FINISH = by_primary_key(
    update(job)
    .where(job.c.id == bindparam("u_id", type_=job.c.id.type), _STARTABLE)
    .values(state=JobState.SUCCEEDED, attempt=job.c.attempt + 1,
            lease_generation=job.c.lease_generation + 1,
            started_at=bindparam("u_started", type_=job.c.started_at.type),
            finished_at=_NOW, updated_at=_NOW, lease_owner=None, lease_until=None,
            published_at=case((job.c.state == JobState.DISPATCHING, _NOW),
                              else_=job.c.published_at)))
_INSERT_ATTEMPT = attempt.insert()
# A job whose handler failed is started for real, in the same transaction,
# so the failure is recorded as every other failure is (fenced on its lease).
_START_ONE = by_primary_key(
    update(job)
    .where(job.c.id == bindparam("u_id", type_=job.c.id.type), _STARTABLE)
    .values(state=JobState.RUNNING, attempt=job.c.attempt + 1,
            lease_generation=job.c.lease_generation + 1,
            lease_owner=bindparam("u_owner", type_=job.c.lease_owner.type),
            lease_until=bindparam("u_until", type_=job.c.lease_until.type),
            started_at=bindparam("u_started", type_=job.c.started_at.type),
            updated_at=_NOW,
            published_at=case((job.c.state == JobState.DISPATCHING, _NOW),
                              else_=job.c.published_at)))


def lock_startable(conn: Connection, messages: Sequence[JobMessage], now: datetime,
                   owner: str) -> dict[uuid.UUID, JobRecord]:
    """Lock the rows of the messages' jobs that may start now (this version,
    a startable state, due, not expired, not locked by anyone else) and
    return each as the start would have: attempt and lease generation one
    up, leased to ``owner``.  A message absent from the result takes the
    usual path, which says why (or waits for the lock)."""
    rows = conn.execute(_LOCK, {"u_pairs": [(m.job_id, m.version) for m in messages],
                                "u_now": now}).all()
    out = {}
    for rec in read_records([row[:-1] for row in rows]):
        out[rec.id] = dataclasses.replace(rec, attempt=rec.attempt + 1,
                                          lease_generation=rec.lease_generation + 1,
                                          lease_owner=owner)
    return out


def finish(conn: Connection, done: Sequence[tuple[JobRecord, datetime, str]], now: datetime,
           worker: str) -> None:
    """Jobs locked by :func:`lock_startable` whose handlers ran (or whose
    dedupe row said they had): ``(record, handler start, outcome)``, with
    outcome ``succeeded`` or ``duplicate``.  Raises if a row was not there
    to finish: the whole transaction must roll back."""
    if not done:
        return
    moved = conn.execute(_FINISH, [{"u_id": rec.id, "u_started": started, "u_now": now}
                                   for rec, started, _ in done])
    if moved.rowcount != len(done):
        raise LeaseLostError(f"{len(done) - moved.rowcount} of {len(done)} locked jobs were "
                             "no longer startable at completion")
    conn.execute(_INSERT_ATTEMPT, [
        {"id": uuid7(), "job_id": rec.id, "number": rec.attempt, "worker": worker,
         "lease_generation": rec.lease_generation, "outcome": outcome,
         "started_at": started, "finished_at": now}
        for rec, started, outcome in done])


def start_one(conn: Connection, rec: JobRecord, started: datetime, now: datetime,
              lease_seconds: float, worker: str) -> JobRecord:
    """Start a locked job for real (RUNNING, leased as ``rec`` says, its
    attempt row open): a failed handler's job, so the failure is recorded
    the usual way.  Returns the record with its attempt id."""
    params: dict[str, Any] = {"u_id": rec.id, "u_owner": rec.lease_owner, "u_started": started,
                              "u_now": now, "u_until": now + timedelta(seconds=lease_seconds)}
    if conn.execute(_START_ONE, params).rowcount != 1:
        raise LeaseLostError(f"job {rec.id} was no longer startable under its lock")
    return open_attempts(conn, [rec], started, worker)[0]


__all__ = ["finish", "lock_startable", "start_one"]
