"""A started job's life, each step one conditional statement: a worker's
version-checked start, its lease renewed, its progress checkpointed, and
its end — completed, retried, dead — plus a ``sql://`` worker's claim given
back and the checks that explain why a message cannot start.

Each write is ``UPDATE ... WHERE state = ? [AND version = ?] [AND lease_owner
= ? AND lease_generation = ?]``: a write that lost a race matches no row,
changes nothing and says so through its row count.  The other transitions
live beside this one: the claim (core/leases/claims.py), how a relay's claim ends
(core/leases/dispatch_marks.py) and recovery of leases that ran out (core/leases/recovery.py).

Lease owners are unique per claim (``process token`` + sequence), which makes
the owner a fencing token on its own; ``lease_generation`` is bumped on every
claim and start as well, and completion checks both.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    case,
    delete,
    func,
    literal,
    select,
    tuple_,
    update,
)
from sqlalchemy.sql import Select, Update

from ..db import NOTIFY_CHANNEL
from ..errors import LeaseLostError
from ..failures import SystemFailure
from ..message import JobMessage
from ..states import LEASED_STATES, STARTABLE_STATES, Discard, JobState, LeaseVerdict
from ..tables import attempt, job
from .claims import lease, start_checks, startable
from .records import ROW_COLUMNS, JobRecord, by_primary_key, open_attempts
from .records import records as read_records


def unclaim_run(conn: Connection, *, records: Sequence[JobRecord], now: datetime,
                message_back: bool = False) -> int:
    """Give back jobs a worker claimed or started and never ran (it is
    stopping, or every thread of it runs a long handler), fenced by the
    lease; their unopened attempts are removed.  RUNNING → SCHEDULED as if
    never claimed, and on PostgreSQL a NOTIFY wakes the relays and
    ``sql://`` workers to take them at once.  ``message_back``: each job's
    message goes back to its broker too (Broker.hand_back), so RUNNING →
    ENQUEUED, published now — a relay publishing it again as well would
    only make a second message for a job one message already carries
    (:func:`requeue_handed_back` if the broker refuses it after all)."""
    if message_back:
        back: dict[str, Any] = {"state": JobState.ENQUEUED, "published_at": now}
    else:
        back = {"state": JobState.SCHEDULED}
    total = 0
    for rec in records:
        moved = conn.execute(
            update(job).where(_fenced(rec)).values(
                attempt=job.c.attempt - 1, lease_owner=None, lease_until=None,
                started_at=None, updated_at=now, **back)
        ).rowcount
        if moved and rec.attempt_id is not None:
            conn.execute(delete(attempt).where(attempt.c.id == rec.attempt_id))
        total += moved
    if total and not message_back and conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_notify(NOTIFY_CHANNEL, "")))
    return total


def requeue_handed_back(conn: Connection, *, rec: JobRecord, now: datetime) -> int:
    """A job given back with ``message_back`` whose broker would not take
    the message after all: ENQUEUED → SCHEDULED, for a relay to publish
    again (fenced by state and version: a job that moved on is left)."""
    moved = conn.execute(
        update(job).where(job.c.id == rec.id, job.c.version == rec.version,
                          job.c.state == JobState.ENQUEUED, job.c.lease_owner.is_(None))
        .values(state=JobState.SCHEDULED, updated_at=now)
    ).rowcount
    if moved and conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_notify(NOTIFY_CHANNEL, "")))
    return int(moved)


def start(
    conn: Connection, *, message: JobMessage, owner: str, now: datetime, lease_until: datetime,
    worker: str, ahead: float = 0.0,
) -> JobRecord | None:
    """Version-checked start of a delivered message: None means discard it.
    ``ahead``: seconds before its due time the job may be started (the
    caller holds the handler until then; ``started_at`` is the due time)."""
    started = start_many(conn, messages=[message], owner=owner, now=now,
                         lease_until=lease_until, worker=worker, ahead=ahead)
    return started.get(message.job_id)


def start_many(
    conn: Connection, *, messages: Sequence[JobMessage], owner: str, now: datetime,
    lease_until: datetime, worker: str, ahead: float = 0.0,
) -> dict[uuid.UUID, JobRecord]:
    """:func:`start` for several messages in one statement: the records of
    the jobs started, by id (a message that matches no row is absent)."""
    params = {"s_pairs": [(m.job_id, m.version) for m in messages], "s_now": now,
              "s_due_by": now + timedelta(seconds=ahead), "s_owner": owner,
              "s_until": lease_until}
    if conn.dialect.update_returning:
        records = read_records(conn.execute(_START, params).all())
        records.sort(key=lambda r: (r.due_at, r.id))
    else:
        records = lease(conn, _START_CANDIDATES, owner, _START_VALUES, params=params)
    return {rec.id: rec for rec in open_attempts(conn, records, now, worker)}


# start_many's statement, built once with bound parameters (as the
# completion's, below: building it per start cost more CPU than running it).
# Not SKIP LOCKED: a row locked by the relay's mark must be waited for, or a
# message that overtook its own mark would be dropped.  Id order: two workers
# starting overlapping batches lock in the same order.
_S_NOW = bindparam("s_now", type_=job.c.updated_at.type)
_START_CANDIDATES = (
    select(job.c.id)
    .where(tuple_(job.c.id, job.c.version).in_(bindparam("s_pairs", expanding=True)),
           startable(_S_NOW, bindparam("s_due_by", type_=job.c.due_at.type)))
    .order_by(job.c.id).with_for_update()
)
_START_VALUES: dict[str, Any] = {
    "state": JobState.RUNNING,
    "lease_until": bindparam("s_until", type_=job.c.lease_until.type),
    "attempt": job.c.attempt + 1,
    "started_at": case((job.c.due_at > _S_NOW, job.c.due_at), else_=_S_NOW),
    "updated_at": _S_NOW,
    # Delivered before the relay's mark landed (a held job is published a
    # moment before its due time): the hand-over was just now.
    "published_at": case((job.c.state == JobState.DISPATCHING, _S_NOW),
                         else_=job.c.published_at),
}
_START = (
    update(job)
    .where(job.c.id.in_(_START_CANDIDATES))
    .values(lease_owner=bindparam("s_owner", type_=job.c.lease_owner.type),
            lease_generation=job.c.lease_generation + 1, **_START_VALUES)
    .returning(*ROW_COLUMNS)
)


def why_not_started(conn: Connection, message: JobMessage, now: datetime,
                    due_by: datetime | None = None) -> Discard:
    """Name the reason a start at ``now`` (due by ``due_by``, as
    :func:`start_many` was asked) matched no row, for logs and metrics: the
    part of :func:`duebox.leases.claims.startable` the row fails, read in the same
    terms as the start's statement, or ``locked`` if it fails none."""
    checks = start_checks(now, due_by)
    row = conn.execute(
        select(job.c.state, job.c.version, checks.due.label("due"),
               checks.unexpired.label("unexpired"))
        .where(job.c.id == message.job_id)
    ).first()
    if row is None:
        return Discard.UNKNOWN_JOB
    refused = _not_runnable(message, row.state, row.version)
    if refused is not None:
        return refused
    if not row.due:
        return Discard.NOT_DUE
    if not row.unexpired:
        return Discard.EXPIRED
    return Discard.LOCKED


def _not_runnable(message: JobMessage, state: str, version: int) -> Discard | None:
    """Why a message cannot run the job in this state and version (None: it can)."""
    if state == JobState.CANCELLED:
        return Discard.CANCELLED
    if version != message.version:
        return Discard.STALE_VERSION
    if state not in STARTABLE_STATES:
        return Discard.already(state)
    return None


def check_early(conn: Connection, messages: Sequence[JobMessage]
                ) -> list[tuple[Discard | None, datetime | None]]:
    """For messages that came before their due time, before any of them is
    held or deferred: per message, why to discard it (``unknown_job``,
    ``stale_version``, ``cancelled``, ``already_<state>``, ``forged``: the
    right id naming another task or queue) or None and the job's own due
    time, which the message's may only claim.  Anyone who can write to a
    queue can send a well-formed message due in an hour for a job that does
    not exist; deferred blindly, 40 of them filled RabbitMQ's prefetch window
    and no real job ran.  One query for the batch."""
    rows = {row.id: row for row in conn.execute(
        select(job.c.id, job.c.state, job.c.version, job.c.due_at, job.c.task, job.c.queue)
        .where(job.c.id.in_(list({m.job_id for m in messages}))))}
    out: list[tuple[Discard | None, datetime | None]] = []
    for message in messages:
        row = rows.get(message.job_id)
        if row is None:
            out.append((Discard.UNKNOWN_JOB, None))
            continue
        refused = _not_runnable(message, row.state, row.version)
        if refused is None and (row.task, row.queue) != (message.task, message.queue):
            refused = Discard.FORGED  # deferred, it would go where the forger says
        out.append((refused, None) if refused is not None else (None, row.due_at))
    return out


def give_back(conn: Connection, *, job_id: uuid.UUID, version: int, now: datetime) -> int:
    """An ENQUEUED job whose message a worker could not put back in the
    broker (a deferral the broker refused) returns to SCHEDULED, fenced by
    version, and the relay publishes it again when due."""
    return conn.execute(by_primary_key(
        update(job)
        .where(job.c.id == job_id, job.c.version == version, job.c.state == JobState.ENQUEUED)
        .values(state=JobState.SCHEDULED, lease_owner=None, lease_until=None, updated_at=now)
    )).rowcount


def _fenced(rec: JobRecord) -> Any:
    return and_(
        job.c.id == rec.id,
        job.c.state == JobState.RUNNING,
        job.c.lease_owner == rec.lease_owner,
        job.c.lease_generation == rec.lease_generation,
    )


# The worker's per-job statements, built once with bound parameters: building
# an UPDATE and its cache key per job cost more CPU than running it.  Each
# ``*_bound`` returns the statement and its parameters.
def _p(name: str, column: Any) -> Any:
    return bindparam(name, type_=column.type)


_FENCED_BOUND = and_(
    job.c.id == _p("f_id", job.c.id),
    job.c.state == JobState.RUNNING,
    job.c.lease_owner == _p("f_owner", job.c.lease_owner),
    job.c.lease_generation == _p("f_gen", job.c.lease_generation),
)
_COMPLETE = update(job).where(_FENCED_BOUND).values(
    state=JobState.SUCCEEDED, finished_at=_p("f_now", job.c.finished_at), lease_owner=None,
    lease_until=None, updated_at=_p("f_now", job.c.updated_at),
)
_FINISH_ATTEMPT = (
    update(attempt)
    .where(attempt.c.id == _p("a_id", attempt.c.id), attempt.c.outcome.is_(None))
    .values(outcome=_p("a_outcome", attempt.c.outcome),
            finished_at=_p("a_now", attempt.c.finished_at))
)


def _fence_params(rec: JobRecord) -> dict[str, Any]:
    return {"f_id": rec.id, "f_owner": rec.lease_owner, "f_gen": rec.lease_generation}


def complete_after_claim(claim: Any) -> Select[Any]:
    """PostgreSQL: the dedupe row's insert-if-absent ``claim`` (bound as
    ``d_message_id`` / ``d_now``), then :func:`complete_bound` and
    :func:`finish_attempt_bound`, as one statement: one round trip instead of
    three after every handler.  Each step runs only if the one before changed
    a row; the single result row says how far it got: ``claimed`` (0: seen
    before, a duplicate) and ``completed`` (0: the lease was lost)."""
    claimed = claim.returning(literal(1).label("one")).cte("claimed")
    completed = (_COMPLETE.where(select(claimed.c.one).exists())
                 .returning(job.c.id).cte("completed"))
    closed = (_FINISH_ATTEMPT.where(select(completed.c.id).exists())
              .returning(attempt.c.id).cte("closed"))
    return select(
        select(func.count()).select_from(claimed).scalar_subquery().label("claimed"),
        select(func.count()).select_from(completed).scalar_subquery().label("completed"),
        select(func.count()).select_from(closed).scalar_subquery().label("closed"),
    )


def complete_bound(rec: JobRecord, now: datetime) -> tuple[Update, dict[str, Any]]:
    """RUNNING → SUCCEEDED, fenced (a late completion from a lost lease
    matches nothing): the statement and its parameters."""
    return _COMPLETE, {**_fence_params(rec), "f_now": now}


# Group commit (consumers/batch.py): several jobs' completions in one
# transaction.  Their rows are locked first, and the lease checked under the
# lock, so the multi-row statements below need no per-row fence: nobody can
# move a locked job on (claims and recovery SKIP LOCKED rows; a cancel waits).
_LEASES = (
    select(job.c.id, job.c.state, job.c.lease_owner, job.c.lease_generation, job.c.version)
    .where(job.c.id.in_(bindparam("ids", expanding=True)))
)
# One lock order for every transaction: no deadlock among them.
_LOCK_LEASED = _LEASES.order_by(job.c.id).with_for_update()
_COMPLETE_MANY = by_primary_key(update(job).where(
    job.c.id.in_(bindparam("ids", expanding=True)), job.c.state == JobState.RUNNING,
).values(state=JobState.SUCCEEDED, finished_at=_p("f_now", job.c.finished_at),
         lease_owner=None, lease_until=None, updated_at=_p("f_now", job.c.updated_at)))
_FINISH_ATTEMPTS = (
    update(attempt)
    .where(attempt.c.id.in_(bindparam("ids", expanding=True)), attempt.c.outcome.is_(None))
    .values(outcome=_p("a_outcome", attempt.c.outcome),
            finished_at=_p("a_now", attempt.c.finished_at))
)


def lock_leased(conn: Connection, records: Sequence[JobRecord]
                ) -> dict[uuid.UUID, LeaseVerdict]:
    """Lock the jobs' rows until the transaction ends and say, per job id,
    whether its lease still holds: ``held``, ``cancelled`` or ``lost``
    (taken over, finished, rescheduled).  On SQLite the transaction's write
    lock does what FOR UPDATE does elsewhere."""
    return lease_states(conn, records, lock=True)


def lease_states(conn: Connection, records: Sequence[JobRecord], *, lock: bool = False
                 ) -> dict[uuid.UUID, LeaseVerdict]:
    """:func:`lock_leased`, also as a plain read (``lock=False``): the
    re-read of jobs leased ahead of their due time, many in one statement."""
    stmt = _LOCK_LEASED if lock else _LEASES
    rows = {row.id: row for row in conn.execute(stmt, {"ids": [r.id for r in records]})}
    verdict = {}
    for rec in records:
        row = rows.get(rec.id)
        if row is not None and (row.state == JobState.RUNNING
                                and row.lease_owner == rec.lease_owner
                                and row.lease_generation == rec.lease_generation
                                and row.version == rec.version):
            verdict[rec.id] = LeaseVerdict.HELD
        elif row is not None and row.state == JobState.CANCELLED:
            verdict[rec.id] = LeaseVerdict.CANCELLED
        else:
            verdict[rec.id] = LeaseVerdict.LOST
    return verdict


def renew_leases(conn: Connection, records: Sequence[JobRecord], *, now: datetime,
                 until: datetime) -> set[uuid.UUID]:
    """Extend the leases of jobs still RUNNING under these very leases (owner
    and generation): the ids renewed.  Jobs waiting in a worker for a free
    executor keep their leases this way."""
    keys = [(r.id, r.lease_owner, r.lease_generation) for r in records]
    stmt = by_primary_key(
        update(job)
        .where(job.c.id.in_([r.id for r in records]),
               tuple_(job.c.id, job.c.lease_owner, job.c.lease_generation).in_(keys),
               job.c.state == JobState.RUNNING)
        .values(lease_until=until, updated_at=now))
    if conn.dialect.update_returning:
        return set(conn.execute(stmt.returning(job.c.id)).scalars())
    conn.execute(stmt)
    return set(conn.execute(
        select(job.c.id).where(job.c.id.in_([r.id for r in records]),
                               job.c.lease_until == until)).scalars())


def complete_locked(conn: Connection, records: Sequence[JobRecord], outcome: str,
                    now: datetime) -> None:
    """RUNNING → SUCCEEDED for jobs :func:`lock_leased` found held, and their
    attempts closed with ``outcome``.  A count that does not add up means the
    lock did not hold: raise, so the whole transaction rolls back."""
    if not records:
        return
    moved = conn.execute(_COMPLETE_MANY, {"ids": [r.id for r in records], "f_now": now})
    if moved.rowcount != len(records):
        raise LeaseLostError(f"{len(records) - moved.rowcount} of {len(records)} locked jobs "
                             "were no longer RUNNING at completion")
    conn.execute(_FINISH_ATTEMPTS, {"ids": [r.attempt_id for r in records],
                                    "a_outcome": outcome, "a_now": now})


def finish_attempt_bound(rec: JobRecord, now: datetime, outcome: str
                         ) -> tuple[Update, dict[str, Any]]:
    """:func:`finish_attempt_stmt` without an error, prebuilt."""
    return _FINISH_ATTEMPT, {"a_id": rec.attempt_id, "a_outcome": outcome, "a_now": now}


def finish_attempt_stmt(
    rec: JobRecord, now: datetime, outcome: str, error_class: str | None = None,
    error: str | None = None, traceback: str | None = None,
) -> Update:
    return (
        update(attempt)
        .where(attempt.c.id == rec.attempt_id, attempt.c.outcome.is_(None))
        .values(outcome=outcome, finished_at=now, error_class=error_class, error=error,
                traceback=traceback)
    )


def retry_stmt(
    rec: JobRecord, now: datetime, due_at: datetime, error_class: str, error: str
) -> Update:
    """RUNNING → SCHEDULED with a later ``due_at``; the version moves on so any
    message still in flight for this attempt is stale."""
    return update(job).where(_fenced(rec)).values(
        state=JobState.SCHEDULED, due_at=due_at, version=job.c.version + 1,
        lease_owner=None, lease_until=None, error_class=error_class, last_error=error,
        updated_at=now,
    )


def dead_stmt(rec: JobRecord, now: datetime, error_class: str, error: str) -> Update:
    return update(job).where(_fenced(rec)).values(
        state=JobState.DEAD, error_class=error_class, last_error=error, finished_at=now,
        lease_owner=None, lease_until=None, updated_at=now,
    )


def interrupted_stmt(rec: JobRecord, now: datetime, error: str, *, dead: bool) -> Update:
    """A started job whose own transaction was cut (its connection lost:
    nothing of it committed), settled by its worker as recovery settles a
    lease that ran out (core/leases/recovery.py), only sooner: back to SCHEDULED
    as it was — due time and version unchanged, so it runs again at once —
    or DEAD if its attempts are used up (``dead``), error class ``lost``.
    Fenced: a job whose commit went through after all, or that moved on,
    matches nothing."""
    values: dict[str, Any] = ({"state": JobState.DEAD, "finished_at": now} if dead
                              else {"state": JobState.SCHEDULED})
    return update(job).where(_fenced(rec)).values(
        error_class=SystemFailure.LOST, last_error=error, lease_owner=None, lease_until=None,
        updated_at=now, **values)


def attempt_outcome(conn: Connection, rec: JobRecord) -> str | None:
    """How this record's attempt ended, as its row says (None: still open,
    or no such attempt)."""
    return conn.execute(select(attempt.c.outcome).where(attempt.c.id == rec.attempt_id)
                        ).scalar_one_or_none()


def heartbeat_stmt(rec: JobRecord, now: datetime, lease_until: datetime) -> Update:
    return update(job).where(_fenced(rec)).values(lease_until=lease_until, updated_at=now)


def checkpoint_stmt(rec: JobRecord, now: datetime, state: Any) -> Update:
    """Persist a running job's progress, fenced like a completion."""
    return update(job).where(_fenced(rec)).values(checkpoint=state, updated_at=now)


def counts_by_state(conn: Connection) -> dict[str, int]:
    rows = conn.execute(select(job.c.state, func.count()).group_by(job.c.state)).all()
    return {str(state): int(n) for state, n in rows}


__all__ = [
    "LEASED_STATES",
    "JobRecord",
    "attempt_outcome",
    "check_early",
    "checkpoint_stmt",
    "complete_after_claim",
    "complete_bound",
    "complete_locked",
    "counts_by_state",
    "dead_stmt",
    "finish_attempt_bound",
    "finish_attempt_stmt",
    "give_back",
    "heartbeat_stmt",
    "interrupted_stmt",
    "lease_states",
    "lock_leased",
    "renew_leases",
    "requeue_handed_back",
    "retry_stmt",
    "start",
    "start_many",
    "unclaim_run",
    "why_not_started",
]
