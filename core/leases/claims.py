"""The claim: which jobs are due, and every statement that leases them.

One predicate, :func:`due` — ``SCHEDULED`` and due by ``T`` (after
``after``, within a relay's ``fence``) — and one scan over it,
:func:`locked`, which skips rows another claim holds (``FOR UPDATE SKIP
LOCKED``), so any number of relays and ``sql://`` workers partition the due
rows between them without waiting.  Every claim is built from those two:

* :func:`claim_for_dispatch` — a relay's batch: ``SCHEDULED → DISPATCHING``;
  :func:`dispatch_claim` is the same claim as one statement, which
  core/leases/dispatch_marks.py's ``mark_and_claim`` fuses with a mark on PostgreSQL;
* :func:`claim_for_run` — a ``sql://`` worker's: ``SCHEDULED → RUNNING``;
* :func:`class_candidates` then :func:`claim_selected` / ``claim_for_run(ids=)``
  — the fair claim (core/fairness/claim.py) picks rows class by class, then
  leases exactly those.

Beside it the other predicate a job's row is matched with, :func:`startable`:
whether a delivered message may start its job (the worker's start, the batch
lane's lock, your own consumer's completion).

Lease owners are unique per claim (``process token`` + sequence), which makes
the owner a fencing token on its own; ``lease_generation`` is bumped on every
claim, and completion checks both (core/leases/jobstore.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Connection, and_, case, literal, or_, select, update
from sqlalchemy.sql import Select, Update

from ..states import STARTABLE_STATES, JobState
from ..tables import job
from .records import (
    ROW_COLUMNS,
    JobRecord,
    by_primary_key,
    dispatch_columns,
    dispatch_records,
    open_attempts,
    records,
)


def due(horizon: datetime | ColumnElement[Any], *, after: datetime | None = None,
        fence: ColumnElement[bool] | None = None) -> ColumnElement[bool]:
    """The due predicate: ``SCHEDULED`` and due by ``horizon`` (and after
    ``after``; ``fence``: a sharded relay's owned shards, still owned).
    ``horizon`` may be a bound parameter, for a statement built once."""
    where = and_(job.c.state == JobState.SCHEDULED, job.c.due_at <= horizon)
    if after is not None:
        where = and_(where, job.c.due_at > after)
    if fence is not None:
        where = and_(where, fence)
    return where


def locked(
    where: ColumnElement[bool], limit: int, queues: Sequence[str] | None = None,
    priority_first: bool = False, columns: Sequence[Any] = (job.c.id,),
) -> Select[Any]:
    """The first ``limit`` rows matching ``where``, earliest due first, locked
    for this transaction; rows other transactions hold are skipped, never
    waited for.  Claims scan :func:`due` with it; recovery scans expired
    leases (core/leases/recovery.py)."""
    stmt = select(*columns).where(where)
    if queues:
        stmt = stmt.where(job.c.queue.in_(list(queues)))
    # Priority first only for the catch-up claim, whose due_at range is the
    # backlog: the (state, due_at) index still bounds the scan; the top-N sort
    # by priority happens over that range.
    order = (job.c.priority.desc(), job.c.due_at) if priority_first else (job.c.due_at,)
    return stmt.order_by(*order).limit(limit).with_for_update(skip_locked=True)


def update_locked(conn: Connection, stmt: Update, candidates: Select[Any]) -> int:
    """Run ``stmt`` on the ``candidates`` rows (:func:`locked`); the number of
    rows changed.

    MySQL/MariaDB reject ``IN (SELECT ... LIMIT ...)`` (error 1235), so there
    the candidates are locked and read first and the update names them: the
    same rows, locked by this transaction, so nothing changes them between
    the two statements."""
    if conn.dialect.name not in ("mysql", "mariadb"):
        return conn.execute(stmt.where(job.c.id.in_(candidates))).rowcount
    ids = list(conn.execute(candidates).scalars())
    return conn.execute(by_primary_key(stmt.where(job.c.id.in_(ids)))).rowcount if ids else 0


def _lease_update(owner: str, values: dict[str, Any],
                  fence: ColumnElement[bool] | None) -> Update:
    base = update(job).values(
        lease_owner=owner, lease_generation=job.c.lease_generation + 1, **values
    )
    return base.where(fence) if fence is not None else base


def lease(
    conn: Connection, candidates: Select[Any], owner: str, values: dict[str, Any],
    fence: ColumnElement[bool] | None = None, params: dict[str, Any] | None = None,
    dispatch: bool = False,
) -> list[JobRecord]:
    """Lease the candidate rows to ``owner`` in one statement where the
    dialect allows ``UPDATE ... RETURNING``; MySQL/MariaDB take three.
    ``fence``: an extra condition every leased row must meet (a relay's shard
    ownership, docs/scale.md).  ``params``: values of bound parameters in
    ``candidates`` and ``values``.  ``dispatch``: a relay's claim, whose
    records carry the payload to hand on (records.dispatch_columns)."""
    base = _lease_update(owner, values, fence)
    if conn.dialect.update_returning:
        dialect = conn.dialect.name if dispatch else ""
        leased = dispatch_records(conn.execute(
            base.where(job.c.id.in_(candidates)).returning(*dispatch_columns(dialect)),
            params).all(), dialect)
    else:
        ids = list(conn.execute(candidates, params).scalars())
        if not ids:
            return []
        conn.execute(by_primary_key(base.where(job.c.id.in_(ids))), params)
        leased = records(conn.execute(
            select(*ROW_COLUMNS).where(job.c.id.in_(ids), job.c.lease_owner == owner)
        ).all())
    leased.sort(key=lambda r: (r.due_at, r.id))
    return leased


def next_due(conn: Connection, after: datetime | None = None) -> datetime | None:
    """The earliest ``due_at`` among SCHEDULED jobs (an index seek): when
    :func:`due` next matches a row; ``after``: the earliest later than it."""
    where = job.c.state == JobState.SCHEDULED
    if after is not None:
        where = and_(where, job.c.due_at > after)
    return conn.execute(select(job.c.due_at).where(where).order_by(job.c.due_at).limit(1)
                        ).scalar()


# --- the start: which rows a delivered message may start ----------------------------


def in_states(states: Collection[JobState] = STARTABLE_STATES) -> ColumnElement[bool]:
    """``state IN (...)`` with one bound parameter per state, not one
    expanding list: the statement may then go with executemany too (the
    batch lane's completion), and reads the same on every path."""
    return job.c.state.in_([literal(s.value, job.c.state.type) for s in sorted(states)])


class StartChecks(NamedTuple):
    """The parts of :func:`startable`, each a condition on the job's row,
    so a caller can also say which one a row failed (``select`` them)."""

    in_state: ColumnElement[bool]  # a state a message may start the job from
    due: ColumnElement[bool]  # due by the instant asked about
    unexpired: ColumnElement[bool]  # not past ``expires_at`` when it starts


Instant = datetime | ColumnElement[Any]


def start_checks(now: Instant, due_by: Instant | None = None, *,
                 states: Collection[JobState] = STARTABLE_STATES) -> StartChecks:
    """:func:`startable`'s parts (see there)."""
    unexpired = or_(job.c.expires_at.is_(None),
                    and_(job.c.expires_at > now, job.c.expires_at > job.c.due_at))
    return StartChecks(in_states(states), job.c.due_at <= (now if due_by is None else due_by),
                       unexpired)


def startable(now: Instant, due_by: Instant | None = None, *,
              states: Collection[JobState] = STARTABLE_STATES) -> ColumnElement[bool]:
    """The start predicate, beside :func:`due` (the claim's): the job a
    delivered message names (the caller matches its id and version) may
    start now — in one of ``states`` (:data:`~duebox.states.STARTABLE_STATES`:
    the relay's mark may not have landed, a recovered job may be redelivered;
    your own consumer's completion adds ``DELIVERED``), due by ``due_by``
    (default ``now``; later: started ahead, its handler held to its due
    time), and not expired when it starts.

    **Expiry is checked at the instant the job starts**: the later of
    ``now`` and its ``due_at`` — what ``started_at`` records and the first
    moment its handler may run.  Not ``now`` alone: a job started ahead
    whose ``expires_at`` falls between now and its due time (a retry or a
    reschedule can move ``due_at`` past ``expires_at``) would run expired.  Not ``due_by``:
    that is the latest due time a batch allows, and would refuse a job that
    starts before it and before its expiry.  A job past its expiry is
    refused on every path the same way.

    ``now`` and ``due_by`` may be bound parameters or SQL (the database
    server's clock), for statements built once."""
    return and_(*start_checks(now, due_by, states=states))


# --- the relay's claim --------------------------------------------------------


def _dispatching(now: datetime, lease_until: datetime) -> dict[str, Any]:
    return {"state": JobState.DISPATCHING, "lease_until": lease_until, "claimed_at": now,
            "updated_at": now}


def _dispatch_candidates(horizon: datetime, limit: int, after: datetime | None,
                         priority_first: bool, fence: ColumnElement[bool] | None
                         ) -> Select[Any]:
    return locked(due(horizon, after=after, fence=fence), limit, priority_first=priority_first)


def claim_for_dispatch(
    conn: Connection, *, owner: str, horizon: datetime, limit: int, now: datetime,
    lease_until: datetime, after: datetime | None = None, priority_first: bool = False,
    fence: ColumnElement[bool] | None = None,
) -> list[JobRecord]:
    """SCHEDULED → DISPATCHING for the next ``limit`` jobs due by ``horizon``
    (and after ``after``); ``priority_first`` orders by priority, then due time
    (the relay's catch-up claim of overdue jobs).  ``fence`` limits the claim
    to rows it holds for (a sharded relay's owned shards, still owned)."""
    candidates = _dispatch_candidates(horizon, limit, after, priority_first, fence)
    return lease(conn, candidates, owner, _dispatching(now, lease_until), fence, dispatch=True)


def dispatch_claim(
    *, owner: str, horizon: datetime, limit: int, now: datetime, lease_until: datetime,
    after: datetime | None = None, priority_first: bool = False,
    fence: ColumnElement[bool] | None = None,
) -> Update:
    """:func:`claim_for_dispatch` as one ``UPDATE`` (no RETURNING yet), for
    dialects that update from a limited subquery (PostgreSQL): the pipelined
    relay adds it to its mark as a data-modifying CTE."""
    candidates = _dispatch_candidates(horizon, limit, after, priority_first, fence)
    return _lease_update(owner, _dispatching(now, lease_until), fence).where(
        job.c.id.in_(candidates))


def claim_selected(
    conn: Connection, ids: Sequence[uuid.UUID], *, owner: str, now: datetime,
    lease_until: datetime, fence: ColumnElement[bool] | None = None,
) -> list[JobRecord]:
    """SCHEDULED → DISPATCHING for ``ids``, rows this transaction already
    locked (picked class by class by :func:`class_candidates`)."""
    if not ids:
        return []
    candidates = select(job.c.id).where(job.c.id.in_(list(ids)),
                                        job.c.state == JobState.SCHEDULED)
    return lease(conn, candidates, owner, _dispatching(now, lease_until), fence, dispatch=True)


# --- a sql:// worker's claim ----------------------------------------------------


def claim_for_run(
    conn: Connection, *, owner: str, now: datetime, limit: int, lease_until: datetime,
    queues: Sequence[str] | None, worker: str, horizon: datetime | None = None,
    ids: Sequence[uuid.UUID] | None = None, after: datetime | None = None,
) -> list[JobRecord]:
    """``sql://``: SCHEDULED and due → RUNNING, in one short transaction.
    ``horizon`` (later than ``now``): also jobs due by then, which the caller
    holds until their due time; their ``started_at`` is that due time.
    ``after``: only jobs due later than it (the worker's batch lane claims
    the others itself, core/leases/batch_sql.py).  ``ids``: exactly these rows,
    which this transaction already picked and locked (the fair claim,
    :func:`class_candidates`; the lane's rows it does not run), instead of
    the earliest due."""
    if ids is not None:
        if not ids:
            return []
        candidates = select(job.c.id).where(job.c.id.in_(list(ids)), due(horizon or now))
    else:
        candidates = locked(due(horizon or now, after=after), limit, queues)
    started: Any = now
    if horizon is not None and horizon > now:
        started = case((job.c.due_at > now, job.c.due_at), else_=now)
    leased = lease(
        conn, candidates, owner,
        {"state": JobState.RUNNING, "lease_until": lease_until, "attempt": job.c.attempt + 1,
         "claimed_at": now, "started_at": started, "updated_at": now},
    )
    return open_attempts(conn, leased, now, worker)


# --- the fair claim's reads (core/fairness/claim.py composes the batch) --------------


@dataclass(frozen=True, slots=True)
class ClassKey:
    """A dispatch class: jobs of one queue and tenant at one priority."""

    queue: str
    tenant: str | None
    priority: int


@dataclass(frozen=True, slots=True)
class Candidate:
    id: uuid.UUID
    due_at: datetime
    priority: int


def tenant_is(tenant: str | None) -> ColumnElement[bool]:
    return job.c.tenant.is_(None) if tenant is None else job.c.tenant == tenant


def class_candidates(
    conn: Connection, key: ClassKey, *, horizon: datetime, after: datetime | None, limit: int,
    fence: ColumnElement[bool] | None = None,
) -> list[Candidate]:
    """The ``limit`` earliest-due jobs of ``key`` due by ``horizon`` (and after
    ``after``), locked for this transaction; rows other claims hold are
    skipped.  One bounded seek on ``ix_duebox_job_class_due``: within a key
    the index is already in due order."""
    where = and_(due(horizon, after=after, fence=fence), job.c.queue == key.queue,
                 tenant_is(key.tenant), job.c.priority == key.priority)
    stmt = locked(where, limit, columns=(job.c.id, job.c.due_at, job.c.priority))
    return [Candidate(*row) for row in conn.execute(stmt)]


__all__ = [
    "Candidate",
    "ClassKey",
    "JobRecord",
    "StartChecks",
    "claim_for_dispatch",
    "claim_for_run",
    "claim_selected",
    "class_candidates",
    "dispatch_claim",
    "due",
    "in_states",
    "lease",
    "locked",
    "next_due",
    "start_checks",
    "startable",
    "tenant_is",
    "update_locked",
]
