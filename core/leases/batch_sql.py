"""Jobs run straight from their deliveries, with no start transaction of
their own: the statements of the worker's batch lane (consumers/batch.py).

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

On ``sql://`` (:func:`lock_due`) the lane's lock is the claim itself: the
due rows are locked in due order, ``SKIP LOCKED``, exactly as a claim scans
them (core/leases/claims.py), and the ones it runs go ``SCHEDULED → SUCCEEDED``
with no claim written at all; the rest are leased in the same transaction
(:func:`duebox.leases.claims.claim_for_run`) and run the usual way.

On PostgreSQL every statement here takes its rows as arrays (``unnest``,
``= ANY``): one statement text whatever the batch's size, so the server
plans it once per connection and the client sends one statement, not one
per row; the completion writes the attempt rows in the same statement
(``UPDATE ... RETURNING`` feeding an ``INSERT``).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    String,
    and_,
    bindparam,
    case,
    func,
    insert,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import Select

from ..errors import LeaseLostError
from ..ids import uuid7, uuid7_many
from ..message import JobMessage
from ..states import JobState
from ..tables import UTCDateTime, attempt, job
from . import claims
from .records import ROW_COLUMNS, JobRecord, by_primary_key, open_attempts
from .records import records as read_records

_NOW = bindparam("u_now", type_=job.c.updated_at.type)
# The latest due time a lock is for (lock_startable's ``due_by``).
_DUE_BY = bindparam("u_due", type_=job.c.due_at.type)
# Rows the lane locked are still in a startable state at completion.
_STARTABLE = claims.in_states()
# Startable rows of these (id, version) pairs (claims.startable): locked in
# id order (one order for every transaction), skipping rows another holds.
_LOCK = (
    select(*ROW_COLUMNS, job.c.state)
    .where(tuple_(job.c.id, job.c.version).in_(bindparam("u_pairs", expanding=True)),
           claims.startable(_NOW, _DUE_BY))
    .order_by(job.c.id)
    .with_for_update(skip_locked=True)
)
# The same on PostgreSQL, its pairs as two arrays: one statement text for
# every batch size (an expanding list renders one per size, each planned
# anew).
_PG_PAIRS = func.unnest(
    bindparam("u_ids", type_=postgresql.ARRAY(job.c.id.type)),
    bindparam("u_versions", type_=postgresql.ARRAY(Integer())),
).table_valued("id", "version").render_derived(name="pairs")
_PG_LOCK = (
    select(*ROW_COLUMNS, job.c.state)
    .select_from(job.join(_PG_PAIRS, and_(job.c.id == _PG_PAIRS.c.id,
                                          job.c.version == _PG_PAIRS.c.version)))
    .where(claims.startable(_NOW, _DUE_BY))
    .order_by(job.c.id)
    .with_for_update(of=job, skip_locked=True)
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
# PostgreSQL: the completion and its attempt rows in one statement.  The
# rows are this transaction's, locked: the UPDATE changes each one it is
# given, or the count says otherwise and the caller rolls back.
_PG_DONE = func.unnest(
    bindparam("u_ids", type_=postgresql.ARRAY(job.c.id.type)),
    bindparam("u_started", type_=postgresql.ARRAY(UTCDateTime())),
    bindparam("u_attempts", type_=postgresql.ARRAY(attempt.c.id.type)),
    bindparam("u_outcomes", type_=postgresql.ARRAY(String())),
).table_valued("id", "started", "attempt_id", "outcome").render_derived(name="done_jobs")
_PG_FINISHED = (
    update(job)
    .where(job.c.id == _PG_DONE.c.id, _STARTABLE)
    .values(state=JobState.SUCCEEDED, attempt=job.c.attempt + 1,
            lease_generation=job.c.lease_generation + 1, started_at=_PG_DONE.c.started,
            finished_at=_NOW, updated_at=_NOW, lease_owner=None, lease_until=None,
            published_at=case((job.c.state == JobState.DISPATCHING, _NOW),
                              else_=job.c.published_at))
    .returning(job.c.id, job.c.attempt, job.c.lease_generation, _PG_DONE.c.started,
               _PG_DONE.c.attempt_id, _PG_DONE.c.outcome)
    .cte("finished")
)
_PG_FINISH = insert(attempt).from_select(
    ["id", "job_id", "number", "worker", "lease_generation", "outcome", "started_at",
     "finished_at"],
    select(_PG_FINISHED.c.attempt_id, _PG_FINISHED.c.id, _PG_FINISHED.c.attempt,
           bindparam("u_worker", type_=attempt.c.worker.type), _PG_FINISHED.c.lease_generation,
           _PG_FINISHED.c.outcome, _PG_FINISHED.c.started, _NOW),
).add_cte(_PG_FINISHED).execution_options(preserve_rowcount=True)
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
                   owner: str, due_by: datetime | None = None) -> dict[uuid.UUID, JobRecord]:
    """Lock the rows of the messages' jobs that may start by ``due_by``
    (default ``now``; this version, :func:`duebox.leases.claims.startable` at
    ``now`` and due by then, not locked by anyone else) and return each as the
    start would have: attempt and lease generation one up, leased to
    ``owner``.  The caller holds each handler to its job's due time.  A
    message absent from the result takes the usual path, which says why (or
    waits for the lock)."""
    by = now if due_by is None else max(now, due_by)
    if conn.dialect.name == "postgresql":
        rows = conn.execute(_PG_LOCK, {"u_ids": [m.job_id for m in messages],
                                       "u_versions": [m.version for m in messages],
                                       "u_now": now, "u_due": by}).all()
    else:
        rows = conn.execute(_LOCK, {"u_pairs": [(m.job_id, m.version) for m in messages],
                                    "u_now": now, "u_due": by}).all()
    return {rec.id: rec for rec in _as_started(read_records([row[:-1] for row in rows]), owner)}


def _due_lock(queues: Sequence[str] | None, limit: int) -> Select[Any]:
    return claims.locked(claims.due(_NOW), limit, queues, columns=ROW_COLUMNS)


def lock_due(conn: Connection, *, now: datetime, limit: int, queues: Sequence[str] | None,
             owner: str) -> list[JobRecord]:
    """``sql://``: the next ``limit`` due jobs, locked as a claim scans them
    (due order, rows another transaction holds skipped), each returned as
    :func:`lock_startable` returns it.  Nothing is written: the caller runs
    them in this transaction, or leases the ones it will not run here
    (:func:`duebox.leases.claims.claim_for_run` with their ids)."""
    rows = conn.execute(_due_lock(queues, limit), {"u_now": now}).all()
    return _as_started(read_records(rows), owner)


def _as_started(records: Sequence[JobRecord], owner: str) -> list[JobRecord]:
    """Each record as a start would have left it: attempt and lease
    generation one up, leased to ``owner`` (what the completion writes)."""
    return [dataclasses.replace(rec, attempt=rec.attempt + 1,
                                lease_generation=rec.lease_generation + 1, lease_owner=owner)
            for rec in records]


def finish(conn: Connection, done: Sequence[tuple[JobRecord, datetime, str]], now: datetime,
           worker: str) -> None:
    """Jobs locked by :func:`lock_startable` whose handlers ran (or whose
    dedupe row said they had): ``(record, handler start, outcome)``, with
    outcome ``succeeded`` or ``duplicate``.  Raises if a row was not there
    to finish: the whole transaction must roll back."""
    if not done:
        return
    if conn.dialect.name == "postgresql":
        moved = conn.execute(_PG_FINISH, {
            "u_ids": [rec.id for rec, _, _ in done],
            "u_started": [started for _, started, _ in done],
            "u_attempts": uuid7_many(len(done)),
            "u_outcomes": [outcome for _, _, outcome in done],
            "u_now": now, "u_worker": worker}).rowcount
    else:
        moved = conn.execute(_FINISH, [{"u_id": rec.id, "u_started": started, "u_now": now}
                                       for rec, started, _ in done]).rowcount
    if moved != len(done):
        raise LeaseLostError(f"{len(done) - moved} of {len(done)} locked jobs were "
                             "no longer startable at completion")
    if conn.dialect.name != "postgresql":
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


__all__ = ["finish", "lock_due", "lock_startable", "start_one"]
