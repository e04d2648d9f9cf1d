"""How a relay's dispatch claim ends: each claimed job is marked
``ENQUEUED`` once the broker confirmed its message, released back to
``SCHEDULED`` (the publish failed), refused (the broker will never take it:
a failed attempt) or expired (too late to run).

Every write is one conditional ``UPDATE`` fenced by the claim's owner token
(and a sharded relay's ``fence``): a write that lost a race matches no row,
changes nothing and says so through its row count.  The claim itself is
core/leases/claims.py's; :func:`mark_and_claim` joins the two in one round trip.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Integer,
    and_,
    any_,
    bindparam,
    func,
    literal,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import Select, Update
from sqlalchemy.sql.elements import BindParameter

from ..failures import SystemFailure
from ..ids import uuid7
from ..states import JobState
from ..tables import attempt, job
from . import claims, own_queues
from .records import DISPATCH_COLUMNS, JobRecord, by_primary_key, dispatch_records


def mark_enqueued(
    conn: Connection, *, owner: str, ids: Sequence[uuid.UUID], now: datetime,
    broker_ids: dict[uuid.UUID, str] | None = None, fence: ColumnElement[bool] | None = None,
    delivered: Collection[str] = (), published_to: str | None = None,
) -> int:
    """DISPATCHING → ENQUEUED, fenced by the claim's owner token (and by
    ``fence``: a sharded relay's shard generation, still current); jobs of
    the ``delivered`` queues (your own consumer's: core/leases/own_queues.py) →
    DELIVERED instead.  ``published_to``: the route the broker that
    confirmed is (core/reroute.py)."""
    if not ids:
        return 0
    in_order = conn.dialect.name == "postgresql"
    if broker_ids:
        total = 0
        for job_id in ids:
            total += conn.execute(
                _mark_stmt(owner, now, job.c.id == job_id, fence, published_to,
                           delivered=delivered).values(
                    broker_message_id=broker_ids.get(job_id)
                )
            ).rowcount
        return total
    if fence is None and not delivered:
        return conn.execute(_plain_mark(postgres=in_order), {
            "m_owner": owner, "m_now": now, "m_route": published_to,
            "mark_ids": list(ids)}).rowcount
    return conn.execute(_mark_stmt(owner, now, job.c.id.in_(list(ids)), fence, published_to,
                                   in_id_order=in_order, delivered=delivered)).rowcount


@functools.cache
def _plain_mark(postgres: bool) -> Update:
    """The usual mark (no shard fence, no own-consumer queues), built once,
    its ids one array parameter on PostgreSQL: building the UPDATE and its
    cache key for every call cost the relay more Python than the round trip
    (a held job released at a trickle is a mark of its own)."""
    ids: ColumnElement[bool] = (
        job.c.id == any_(bindparam("mark_ids", type_=postgresql.ARRAY(job.c.id.type)))
        if postgres else job.c.id.in_(bindparam("mark_ids", expanding=True)))
    return _mark_stmt(bindparam("m_owner", type_=job.c.lease_owner.type),
                      bindparam("m_now", type_=job.c.updated_at.type), ids, None,
                      bindparam("m_route", type_=job.c.published_to.type),
                      in_id_order=postgres)


def _mark_stmt(owner: str | BindParameter[str], now: datetime | BindParameter[datetime],
               chosen: ColumnElement[bool], fence: ColumnElement[bool] | None = None,
               published_to: str | BindParameter[str] | None = None, *,
               in_id_order: bool = False, delivered: Collection[str] = ()) -> Update:
    """The mark of the ``chosen`` rows still DISPATCHING under ``owner``.

    ``in_id_order`` (PostgreSQL): the rows are locked in id order first.  A
    worker's version-checked start locks its batch's rows in id order and
    waits for a mark holding one of them; a mark locking in scan order could
    meanwhile wait for a row that start holds: a deadlock, which PostgreSQL
    detects only after ``deadlock_timeout`` (a second).  (MariaDB refuses a
    subquery on the table an UPDATE changes.)"""
    condition = and_(chosen, job.c.state == JobState.DISPATCHING, job.c.lease_owner == owner)
    if fence is not None:
        condition = and_(condition, fence)
    if in_id_order:
        condition = job.c.id.in_(
            select(job.c.id).where(condition).order_by(job.c.id).with_for_update())
    ended = own_queues.finished_at(delivered, now)
    return by_primary_key(update(job).where(condition).values(
        state=own_queues.mark_state(delivered), published_at=now, published_to=published_to,
        lease_owner=None, lease_until=None, updated_at=now,
        **({} if ended is None else {"finished_at": ended})))


def release(conn: Connection, *, owner: str, ids: Sequence[uuid.UUID], now: datetime,
            error: str | None = None) -> int:
    """Hand claimed jobs back (a publish failed): DISPATCHING → SCHEDULED;
    ``error``, the broker's reason, goes to ``last_error``."""
    if not ids:
        return 0
    values: dict[str, Any] = {"last_error": error} if error is not None else {}
    return conn.execute(by_primary_key(
        update(job)
        .where(job.c.id.in_(list(ids)), job.c.state == JobState.DISPATCHING,
               job.c.lease_owner == owner)
        .values(state=JobState.SCHEDULED, lease_owner=None, lease_until=None, updated_at=now,
                **values)
    )).rowcount


@dataclass(frozen=True, slots=True)
class Refusal:
    """A claimed job whose message the broker refuses for good, why, and
    when to try it again if it has attempts left."""

    record: JobRecord
    error: str
    retry_at: datetime


def refuse(conn: Connection, *, owner: str, refusals: Sequence[Refusal], worker: str,
           now: datetime) -> tuple[int, int]:
    """Jobs whose message the broker refuses every time (a queue name it
    cannot use, a message over its size limit): the refusal is a failed
    attempt, with the broker's reason in ``last_error`` and an attempt row.
    The job is tried again at ``retry_at`` with a new version, or goes DEAD
    once its attempts are used up — never claimed and released forever.
    Fenced by the claim's owner.  Returns (retried, dead)."""
    retried = dead = 0
    for r in refusals:
        rec = r.record
        claimed = (update(job).where(job.c.id == rec.id, job.c.state == JobState.DISPATCHING,
                                     job.c.lease_owner == owner))
        failed = {"attempt": job.c.attempt + 1, "error_class": SystemFailure.REFUSED,
                  "last_error": r.error, "lease_owner": None, "lease_until": None,
                  "updated_at": now}
        moved = conn.execute(by_primary_key(
            claimed.where(job.c.attempt + 1 >= job.c.max_attempts).values(
                state=JobState.DEAD, finished_at=now, **failed))).rowcount
        dead += moved
        if not moved:
            moved = conn.execute(by_primary_key(claimed.values(
                state=JobState.SCHEDULED, due_at=r.retry_at, version=job.c.version + 1,
                **failed))).rowcount
            retried += moved
        if moved:
            conn.execute(attempt.insert().values(
                id=uuid7(), job_id=rec.id, number=rec.attempt + 1, worker=worker,
                lease_generation=rec.lease_generation, outcome="refused",
                error_class=SystemFailure.REFUSED, error=r.error, started_at=now, finished_at=now))
    return retried, dead


def expire(conn: Connection, *, owner: str, ids: Sequence[uuid.UUID], now: datetime) -> int:
    """Leased jobs past their ``expires_at`` become EXPIRED and never run."""
    if not ids:
        return 0
    return conn.execute(by_primary_key(
        update(job)
        .where(job.c.id.in_(list(ids)), job.c.lease_owner == owner,
               job.c.state.in_([JobState.DISPATCHING, JobState.RUNNING]))
        .values(state=JobState.EXPIRED, lease_owner=None, lease_until=None,
                finished_at=now, updated_at=now, error_class=SystemFailure.EXPIRED)
    )).rowcount



def mark_and_claim(
    conn: Connection, *, marks: Sequence[tuple[str, Sequence[uuid.UUID]]], owner: str,
    horizon: datetime, limit: int, now: datetime, lease_until: datetime,
    after: datetime | None = None, priority_first: bool = False,
    fence: ColumnElement[bool] | None = None, delivered: Collection[str] = (),
    published_to: str | None = None,
) -> tuple[list[int], list[JobRecord]]:
    """:func:`mark_enqueued` for each ``(owner, ids)`` of ``marks`` (batches
    the broker confirmed), then :func:`claim_for_dispatch`, on the caller's
    connection; returns the rows each mark changed and the claimed records.

    The pipelined relay's one round trip per batch.  On PostgreSQL the first
    mark and the claim are one statement (data-modifying CTEs); the mark is
    fenced exactly as :func:`mark_enqueued`'s (state, the claim's owner,
    ``fence``), and the two touch disjoint rows (DISPATCHING and ours vs.
    SCHEDULED), so they cannot interfere.  Other dialects: the plain
    statements, one after another."""
    counts = [0] * len(marks)
    todo = [i for i, (_, ids) in enumerate(marks) if ids]
    if conn.dialect.name != "postgresql" or not todo:
        for i in todo:
            counts[i] = mark_enqueued(conn, owner=marks[i][0], ids=marks[i][1], now=now,
                                      fence=fence, delivered=delivered,
                                      published_to=published_to)
        return counts, claims.claim_for_dispatch(
            conn, owner=owner, horizon=horizon, limit=limit, now=now, lease_until=lease_until,
            after=after, priority_first=priority_first, fence=fence)
    first, rest = todo[0], todo[1:]
    for i in rest:
        counts[i] = mark_enqueued(conn, owner=marks[i][0], ids=marks[i][1], now=now,
                                  fence=fence, delivered=delivered, published_to=published_to)
    mark_owner, mark_ids = marks[first]
    # One array parameter, not an IN list of 500: the statement text stays
    # the same, so neither SQLAlchemy nor psycopg re-renders or re-parses it.
    params: dict[str, Any] = {
        "m_owner": mark_owner, "mark_ids": list(mark_ids), "m_route": published_to,
        "c_owner": owner, "c_horizon": horizon, "c_limit": limit, "c_now": now,
        "c_until": lease_until}
    if after is not None:
        params["c_after"] = after
    if fence is None and not delivered:
        stmt = _fused(after is not None, priority_first)
    else:  # a shard's fence, or own-consumer queues: built for this batch
        stmt = _fused_statement(after is not None, priority_first, fence, delivered, params)
        params = {}
    rows = conn.execute(stmt, params).all()
    counts[first] = int(rows[0][0]) if rows else 0
    claimed_records = dispatch_records([row[1:] for row in rows if row[1] is not None],
                                       "postgresql")
    # As UUIDs compare, without their __lt__.
    claimed_records.sort(key=lambda r: (r.due_at, r.id.int))
    return counts, claimed_records


def _fused_statement(after: bool, priority_first: bool, fence: ColumnElement[bool] | None,
                     delivered: Collection[str], values: dict[str, Any] | None) -> Select[Any]:
    """The mark (of ``mark_ids``, by ``m_owner``) and the claim (for
    ``c_owner``) as one statement of data-modifying CTEs: with ``values``, a
    statement for one batch that carries them; without, one with parameters
    of those names to execute it with (:func:`_fused`)."""
    def p(name: str, type_: Any) -> Any:
        return bindparam(name, type_=type_) if values is None else values[name]

    now = p("c_now", job.c.updated_at.type)
    ids = bindparam("mark_ids", None if values is None else values["mark_ids"],
                    type_=postgresql.ARRAY(job.c.id.type))
    marked = (_mark_stmt(p("m_owner", job.c.lease_owner.type), now, job.c.id == any_(ids), fence,
                         p("m_route", job.c.published_to.type), in_id_order=True,
                         delivered=delivered)
              .returning(job.c.id).cte("marked"))
    claim = claims.dispatch_claim(
        owner=p("c_owner", job.c.lease_owner.type), horizon=p("c_horizon", job.c.due_at.type),
        limit=p("c_limit", Integer()), now=now, lease_until=p("c_until", job.c.lease_until.type),
        after=p("c_after", job.c.due_at.type) if after else None,
        priority_first=priority_first, fence=fence)
    claimed = claim.returning(*DISPATCH_COLUMNS).cte("claimed")
    # Outer-joined to one row, so the mark's count comes back when nothing
    # was claimed; PostgreSQL runs every data-modifying CTE to completion
    # whether or not the outer query reads it.
    one = select(literal(1).label("one")).subquery("one")
    n_marked = select(func.count()).select_from(marked).scalar_subquery()
    return (select(n_marked.label("n_marked"), *(claimed.c[c.name] for c in DISPATCH_COLUMNS))
            .select_from(one.outerjoin(claimed, true())))


@functools.cache
def _fused(after: bool, priority_first: bool) -> Select[Any]:
    """The usual fused statement (no shard fence, no own-consumer queues),
    built once per shape: building it and computing its cache key for every
    batch cost more Python than a claimed job's record."""
    return _fused_statement(after, priority_first, None, (), None)


__all__ = ["Refusal", "expire", "mark_and_claim", "mark_enqueued", "refuse", "release"]
