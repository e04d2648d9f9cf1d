"""Every state transition of a job, as one conditional statement.

Each write is ``UPDATE ... WHERE state = ? [AND version = ?] [AND lease_owner
= ? AND lease_generation = ?]``: a write that lost a race matches no row,
changes nothing and says so through its row count.  The relay, the workers,
the ``sql://`` backend and the CLI all go through this module, so there is
one place where the state machine lives.

Lease owners are unique per claim (``process token`` + sequence), which makes
the owner a fencing token on its own; ``lease_generation`` is bumped on every
claim and start as well, and completion checks both.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    and_,
    any_,
    bindparam,
    case,
    delete,
    func,
    literal,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import Select, Update

from .errors import LeaseLostError
from .ids import uuid7
from .message import JobMessage
from .states import LEASED_STATES, STARTABLE_STATES, JobState
from .tables import attempt, job

_ROW_COLUMNS = (
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
        return self.expires_at is not None and self.expires_at <= now


def _records(rows: Sequence[Any]) -> list[JobRecord]:
    return [JobRecord(*row) for row in rows]


def _by_primary_key(stmt: Update) -> Update:
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


def _claim_candidates(
    state_filter: Any, limit: int, queues: Sequence[str] | None = None,
    priority_first: bool = False,
) -> Select[Any]:
    stmt = select(job.c.id).where(state_filter)
    if queues:
        stmt = stmt.where(job.c.queue.in_(list(queues)))
    # Priority first only for the catch-up claim, whose due_at range is the
    # backlog: the (state, due_at) index still bounds the scan; the top-N sort
    # by priority happens over that range.
    order = (job.c.priority.desc(), job.c.due_at) if priority_first else (job.c.due_at,)
    return stmt.order_by(*order).limit(limit).with_for_update(skip_locked=True)


def _update_candidates(conn: Connection, stmt: Update, candidates: Select[Any]) -> int:
    """Run ``stmt`` on the ``candidates`` rows; the number of rows changed.

    MySQL/MariaDB reject ``IN (SELECT ... LIMIT ...)`` (error 1235), so there
    the candidates are locked and read first and the update names them: the
    same rows, locked by this transaction, so nothing changes them between
    the two statements."""
    if conn.dialect.name not in ("mysql", "mariadb"):
        return conn.execute(stmt.where(job.c.id.in_(candidates))).rowcount
    ids = list(conn.execute(candidates).scalars())
    return conn.execute(_by_primary_key(stmt.where(job.c.id.in_(ids)))).rowcount if ids else 0


def _claim(
    conn: Connection, candidates: Select[Any], owner: str, values: dict[str, Any],
    fence: ColumnElement[bool] | None = None, params: dict[str, Any] | None = None,
) -> list[JobRecord]:
    """Lease the candidate rows to ``owner`` in one statement where the
    dialect allows ``UPDATE ... RETURNING``; MySQL/MariaDB take three.
    ``fence``: an extra condition every leased row must meet (a relay's shard
    ownership, docs/scale.md).  ``params``: values of bound parameters in
    ``candidates`` and ``values``."""
    base = update(job).values(
        lease_owner=owner, lease_generation=job.c.lease_generation + 1, **values
    )
    if fence is not None:
        base = base.where(fence)
    if conn.dialect.update_returning:
        rows = conn.execute(base.where(job.c.id.in_(candidates)).returning(*_ROW_COLUMNS),
                            params).all()
    else:
        ids = list(conn.execute(candidates, params).scalars())
        if not ids:
            return []
        conn.execute(_by_primary_key(base.where(job.c.id.in_(ids))), params)
        rows = conn.execute(
            select(*_ROW_COLUMNS).where(job.c.id.in_(ids), job.c.lease_owner == owner)
        ).all()
    records = _records(rows)
    records.sort(key=lambda r: (r.due_at, r.id))
    return records


# --- relay side -------------------------------------------------------------


def claim_for_dispatch(
    conn: Connection, *, owner: str, horizon: datetime, limit: int, now: datetime,
    lease_until: datetime, after: datetime | None = None, priority_first: bool = False,
    fence: ColumnElement[bool] | None = None,
) -> list[JobRecord]:
    """SCHEDULED → DISPATCHING for the next ``limit`` jobs due by ``horizon``
    (and after ``after``); ``priority_first`` orders by priority, then due time
    (the relay's catch-up claim of overdue jobs).  ``fence`` limits the claim
    to rows it holds for (a sharded relay's owned shards, still owned)."""
    due = job.c.due_at <= horizon
    if after is not None:
        due = and_(due, job.c.due_at > after)
    if fence is not None:
        due = and_(due, fence)
    candidates = _claim_candidates(
        and_(job.c.state == JobState.SCHEDULED, due), limit, priority_first=priority_first
    )
    return _claim(conn, candidates, owner, _dispatching(now, lease_until), fence)


def _dispatching(now: datetime, lease_until: datetime) -> dict[str, Any]:
    return {"state": JobState.DISPATCHING, "lease_until": lease_until, "claimed_at": now,
            "updated_at": now}


def claim_selected(
    conn: Connection, ids: Sequence[uuid.UUID], *, owner: str, now: datetime,
    lease_until: datetime, fence: ColumnElement[bool] | None = None,
) -> list[JobRecord]:
    """SCHEDULED → DISPATCHING for ``ids``, rows this transaction already
    locked (the fair claim picks them class by class, core/fair_claim.py)."""
    if not ids:
        return []
    candidates = select(job.c.id).where(job.c.id.in_(list(ids)),
                                        job.c.state == JobState.SCHEDULED)
    return _claim(conn, candidates, owner, _dispatching(now, lease_until), fence)


def mark_enqueued(
    conn: Connection, *, owner: str, ids: Sequence[uuid.UUID], now: datetime,
    broker_ids: dict[uuid.UUID, str] | None = None, fence: ColumnElement[bool] | None = None,
) -> int:
    """DISPATCHING → ENQUEUED, fenced by the claim's owner token (and by
    ``fence``: a sharded relay's shard generation, still current)."""
    if not ids:
        return 0
    in_order = conn.dialect.name == "postgresql"
    if broker_ids:
        total = 0
        for job_id in ids:
            total += conn.execute(
                _mark_stmt(owner, now, job.c.id == job_id, fence).values(
                    broker_message_id=broker_ids.get(job_id)
                )
            ).rowcount
        return total
    return conn.execute(_mark_stmt(owner, now, job.c.id.in_(list(ids)), fence,
                                   in_id_order=in_order)).rowcount


def _mark_stmt(owner: str, now: datetime, chosen: ColumnElement[bool],
               fence: ColumnElement[bool] | None = None, *, in_id_order: bool = False
               ) -> Update:
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
    return _by_primary_key(update(job).where(condition).values(
        state=JobState.ENQUEUED, published_at=now, lease_owner=None, lease_until=None,
        updated_at=now))


def release(conn: Connection, *, owner: str, ids: Sequence[uuid.UUID], now: datetime,
            error: str | None = None) -> int:
    """Hand claimed jobs back (a publish failed): DISPATCHING → SCHEDULED;
    ``error``, the broker's reason, goes to ``last_error``."""
    if not ids:
        return 0
    values: dict[str, Any] = {"last_error": error} if error is not None else {}
    return conn.execute(_by_primary_key(
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
        failed = {"attempt": job.c.attempt + 1, "error_class": "refused", "last_error": r.error,
                  "lease_owner": None, "lease_until": None, "updated_at": now}
        moved = conn.execute(_by_primary_key(
            claimed.where(job.c.attempt + 1 >= job.c.max_attempts).values(
                state=JobState.DEAD, finished_at=now, **failed))).rowcount
        dead += moved
        if not moved:
            moved = conn.execute(_by_primary_key(claimed.values(
                state=JobState.SCHEDULED, due_at=r.retry_at, version=job.c.version + 1,
                **failed))).rowcount
            retried += moved
        if moved:
            conn.execute(attempt.insert().values(
                id=uuid7(), job_id=rec.id, number=rec.attempt + 1, worker=worker,
                lease_generation=rec.lease_generation, outcome="refused",
                error_class="refused", error=r.error, started_at=now, finished_at=now))
    return retried, dead


def expire(conn: Connection, *, owner: str, ids: Sequence[uuid.UUID], now: datetime) -> int:
    """Leased jobs past their ``expires_at`` become EXPIRED and never run."""
    if not ids:
        return 0
    return conn.execute(_by_primary_key(
        update(job)
        .where(job.c.id.in_(list(ids)), job.c.lease_owner == owner,
               job.c.state.in_([JobState.DISPATCHING, JobState.RUNNING]))
        .values(state=JobState.EXPIRED, lease_owner=None, lease_until=None,
                finished_at=now, updated_at=now, error_class="expired")
    )).rowcount


def _too_late(now: datetime, lateness: Mapping[str, float]) -> list[Any]:
    conditions = [job.c.expires_at <= now]
    conditions += [and_(job.c.task == task, job.c.due_at < now - timedelta(seconds=late))
                   for task, late in sorted(lateness.items())]
    return conditions


def any_too_late(conn: Connection, *, now: datetime, lateness: Mapping[str, float]) -> bool:
    """Whether :func:`expire_overdue` would find anything (a read, no locks)."""
    return conn.execute(
        select(job.c.id).where(job.c.state == JobState.SCHEDULED, job.c.due_at <= now,
                               or_(*_too_late(now, lateness))).limit(1)
    ).first() is not None


def expire_overdue(
    conn: Connection, *, now: datetime, lateness: Mapping[str, float], limit: int
) -> int:
    """SCHEDULED jobs past ``expires_at``, or due longer ago than their task's
    max lateness (``lateness``: task name → seconds), become EXPIRED: a
    bounded batch per condition, never run."""
    total = 0
    for condition in _too_late(now, lateness):
        candidates = _claim_candidates(
            and_(job.c.state == JobState.SCHEDULED, job.c.due_at <= now, condition), limit)
        total += _update_candidates(
            conn,
            update(job).where(job.c.state == JobState.SCHEDULED)
            .values(state=JobState.EXPIRED, lease_owner=None, lease_until=None,
                    finished_at=now, updated_at=now, error_class="expired",
                    last_error="too late: past expires_at or the task's max_lateness"),
            candidates,
        )
    return total


@dataclass(frozen=True, slots=True)
class Recovered:
    dispatching: int = 0
    running: int = 0
    dead: int = 0
    enqueued: int = 0

    @property
    def total(self) -> int:
        return self.dispatching + self.running + self.dead + self.enqueued


def recover(
    conn: Connection, *, now: datetime, margin: float, redeliver_after: float, limit: int
) -> Recovered:
    """Return jobs whose lease expired (plus ``margin`` for clock skew) to SCHEDULED.

    A RUNNING job whose worker vanished counts as a failed attempt: once its
    attempts are used up it goes to DEAD instead of cycling forever.
    """
    cutoff = now - timedelta(seconds=margin)
    dispatching, running, dead = _return_leases(
        conn, job.c.lease_until < cutoff, now=now, limit=limit,
        lost_error="lease expired: the worker stopped heartbeating (crash, kill or pause)")
    free = {"lease_owner": None, "lease_until": None, "updated_at": now}
    stale = now - timedelta(seconds=redeliver_after)
    # Measured from the due time *and* from the last publish: a job already
    # republished waits redeliver_after again.  From the due time alone, every
    # recovery pass of every relay republished every overdue job once a backlog
    # passed redeliver_after, and the duplicates deepened the backlog (the soak
    # saw 23,706 messages queued for 2,400 jobs).
    enqueued = _update_candidates(
        conn, update(job).values(state=JobState.SCHEDULED, **free),
        _claim_candidates(
            and_(job.c.state == JobState.ENQUEUED, job.c.due_at < stale,
                 or_(job.c.published_at.is_(None), job.c.published_at < stale)), limit),
    )
    return Recovered(dispatching, running, dead, enqueued)


def recover_owned(conn: Connection, *, process: str, now: datetime, limit: int) -> Recovered:
    """Return the jobs leased by a process found dead (core/liveness.py) to
    SCHEDULED at once, as lease expiry would: every lease it took is owned
    by ``<process>#<n>``, a string no other process writes, so the owner
    fences this update as the generation fences a completion; a RUNNING job
    counts as a lost attempt.  At most ``limit`` of each kind per call."""
    dispatching, running, dead = _return_leases(
        conn, job.c.lease_owner.startswith(process + "#", autoescape=True), now=now,
        limit=limit, lost_error="the worker's process died (its database session ended)")
    return Recovered(dispatching, running, dead)


def _return_leases(conn: Connection, which: ColumnElement[bool], *, now: datetime, limit: int,
                   lost_error: str) -> tuple[int, int, int]:
    """DISPATCHING and RUNNING jobs matching ``which`` back to SCHEDULED (a
    RUNNING one whose attempts are used up to DEAD, its attempt closed as
    ``lost``): the counts moved (dispatching, running, dead)."""
    free = {"lease_owner": None, "lease_until": None, "updated_at": now}
    dispatching = _update_candidates(
        conn, update(job).where(job.c.state == JobState.DISPATCHING, which)
        .values(state=JobState.SCHEDULED, **free),
        _claim_candidates(and_(job.c.state == JobState.DISPATCHING, which), limit),
    )
    lost_ids = list(conn.execute(_claim_candidates(
        and_(job.c.state == JobState.RUNNING, which), limit)).scalars())
    running = dead = 0
    if lost_ids:
        dead = conn.execute(_by_primary_key(
            update(job)
            .where(job.c.id.in_(lost_ids), job.c.state == JobState.RUNNING,
                   job.c.attempt >= job.c.max_attempts)
            .values(state=JobState.DEAD, error_class="lost", last_error=lost_error,
                    finished_at=now, **free)
        )).rowcount
        running = conn.execute(_by_primary_key(
            update(job)
            .where(job.c.id.in_(lost_ids), job.c.state == JobState.RUNNING)
            .values(state=JobState.SCHEDULED, error_class="lost", last_error=lost_error, **free)
        )).rowcount
        conn.execute(
            update(attempt)
            .where(attempt.c.job_id.in_(lost_ids), attempt.c.outcome.is_(None))
            .values(outcome="lost", error_class="lost", finished_at=now)
        )
    return dispatching, running, dead


@dataclass(frozen=True, slots=True)
class EnqueuedRef:
    """An ``ENQUEUED`` job as reconciliation sees it."""

    id: uuid.UUID
    version: int
    queue: str
    due_at: datetime
    published_at: datetime | None = None


def enqueued_page(
    conn: Connection, *, after: tuple[datetime, uuid.UUID] | None, limit: int
) -> list[EnqueuedRef]:
    """The next ``limit`` ENQUEUED jobs in ``(due_at, id)`` order after ``after``
    (keyset pagination on the ``(state, due_at)`` index)."""
    stmt = select(job.c.id, job.c.version, job.c.queue, job.c.due_at, job.c.published_at).where(
        job.c.state == JobState.ENQUEUED
    )
    if after is not None:
        due, last = after
        stmt = stmt.where(or_(job.c.due_at > due, and_(job.c.due_at == due, job.c.id > last)))
    rows = conn.execute(stmt.order_by(job.c.due_at, job.c.id).limit(limit)).all()
    return [EnqueuedRef(*row) for row in rows]


def requeue_lost(conn: Connection, *, refs: Sequence[EnqueuedRef], now: datetime) -> int:
    """ENQUEUED → SCHEDULED for jobs whose message the broker lost, fenced by
    state, version and publish time: a job that moved on meanwhile, or that
    another relay already published again, is left alone."""
    total = 0
    for ref in refs:
        published = (job.c.published_at.is_(None) if ref.published_at is None
                     else job.c.published_at == ref.published_at)
        total += conn.execute(
            update(job)
            .where(job.c.id == ref.id, job.c.version == ref.version,
                   job.c.state == JobState.ENQUEUED, published)
            .values(state=JobState.SCHEDULED, lease_owner=None, lease_until=None,
                    updated_at=now)
        ).rowcount
    return total


def next_due(conn: Connection) -> datetime | None:
    """The earliest ``due_at`` among SCHEDULED jobs (an index seek)."""
    return conn.execute(
        select(job.c.due_at).where(job.c.state == JobState.SCHEDULED)
        .order_by(job.c.due_at).limit(1)
    ).scalar()


def mark_and_claim(
    conn: Connection, *, marks: Sequence[tuple[str, Sequence[uuid.UUID]]], owner: str,
    horizon: datetime, limit: int, now: datetime, lease_until: datetime,
    after: datetime | None = None, priority_first: bool = False,
    fence: ColumnElement[bool] | None = None,
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
                                      fence=fence)
        return counts, claim_for_dispatch(
            conn, owner=owner, horizon=horizon, limit=limit, now=now, lease_until=lease_until,
            after=after, priority_first=priority_first, fence=fence)
    first, rest = todo[0], todo[1:]
    for i in rest:
        counts[i] = mark_enqueued(conn, owner=marks[i][0], ids=marks[i][1], now=now,
                                  fence=fence)
    mark_owner, mark_ids = marks[first]
    # One array parameter, not an IN list of 500: the statement text stays
    # the same, so neither SQLAlchemy nor psycopg re-renders or re-parses it.
    ids = bindparam("mark_ids", list(mark_ids), type_=postgresql.ARRAY(job.c.id.type))
    marked = (_mark_stmt(mark_owner, now, job.c.id == any_(ids), fence, in_id_order=True)
              .returning(job.c.id).cte("marked"))
    due = job.c.due_at <= horizon
    if after is not None:
        due = and_(due, job.c.due_at > after)
    if fence is not None:
        due = and_(due, fence)
    candidates = _claim_candidates(and_(job.c.state == JobState.SCHEDULED, due), limit,
                                   priority_first=priority_first)
    claim = update(job).where(job.c.id.in_(candidates)).values(
        lease_owner=owner, lease_generation=job.c.lease_generation + 1,
        **_dispatching(now, lease_until))
    if fence is not None:
        claim = claim.where(fence)
    claimed = claim.returning(*_ROW_COLUMNS).cte("claimed")
    # Outer-joined to one row, so the mark's count comes back when nothing
    # was claimed; PostgreSQL runs every data-modifying CTE to completion
    # whether or not the outer query reads it.
    one = select(literal(1).label("one")).subquery("one")
    n_marked = select(func.count()).select_from(marked).scalar_subquery()
    stmt = (select(n_marked.label("n_marked"), *(claimed.c[c.name] for c in _ROW_COLUMNS))
            .select_from(one.outerjoin(claimed, true())))
    rows = conn.execute(stmt).all()
    counts[first] = int(rows[0][0]) if rows else 0
    records = _records([row[1:] for row in rows if row[1] is not None])
    records.sort(key=lambda r: (r.due_at, r.id.int))  # as UUIDs compare, without their __lt__
    return counts, records


# --- worker side ------------------------------------------------------------


def claim_for_run(
    conn: Connection, *, owner: str, now: datetime, limit: int, lease_until: datetime,
    queues: Sequence[str] | None, worker: str, horizon: datetime | None = None,
    ids: Sequence[uuid.UUID] | None = None,
) -> list[JobRecord]:
    """``sql://``: SCHEDULED and due → RUNNING, in one short transaction.
    ``horizon`` (later than ``now``): also jobs due by then, which the caller
    holds until their due time; their ``started_at`` is that due time.
    ``ids``: exactly these rows, which this transaction already picked and
    locked (the fair claim, core/fair_claim.py), instead of the earliest due."""
    due = job.c.due_at <= (horizon or now)
    if ids is not None:
        if not ids:
            return []
        candidates = select(job.c.id).where(job.c.id.in_(list(ids)),
                                            job.c.state == JobState.SCHEDULED, due)
    else:
        candidates = _claim_candidates(and_(job.c.state == JobState.SCHEDULED, due), limit,
                                       queues)
    started: Any = now
    if horizon is not None and horizon > now:
        started = case((job.c.due_at > now, job.c.due_at), else_=now)
    records = _claim(
        conn, candidates, owner,
        {"state": JobState.RUNNING, "lease_until": lease_until, "attempt": job.c.attempt + 1,
         "claimed_at": now, "started_at": started, "updated_at": now},
    )
    return _open_attempts(conn, records, now, worker)


def unclaim_run(conn: Connection, *, records: Sequence[JobRecord], now: datetime) -> int:
    """Give back jobs a ``sql://`` worker claimed ahead and never handed over
    (it is stopping): RUNNING → SCHEDULED as if never claimed, fenced by the
    lease; their unopened attempts are removed."""
    total = 0
    for rec in records:
        moved = conn.execute(
            update(job).where(_fenced(rec)).values(
                state=JobState.SCHEDULED, attempt=job.c.attempt - 1, lease_owner=None,
                lease_until=None, started_at=None, updated_at=now)
        ).rowcount
        if moved and rec.attempt_id is not None:
            conn.execute(delete(attempt).where(attempt.c.id == rec.attempt_id))
        total += moved
    return total


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
        records = _records(conn.execute(_START, params).all())
        records.sort(key=lambda r: (r.due_at, r.id))
    else:
        records = _claim(conn, _START_CANDIDATES, owner, _START_VALUES, params=params)
    return {rec.id: rec for rec in _open_attempts(conn, records, now, worker)}


# start_many's statement, built once with bound parameters (as the
# completion's, below: building it per start cost more CPU than running it).
# Not SKIP LOCKED: a row locked by the relay's mark must be waited for, or a
# message that overtook its own mark would be dropped.  Id order: two workers
# starting overlapping batches lock in the same order.
_S_NOW = bindparam("s_now", type_=job.c.updated_at.type)
_START_CANDIDATES = (
    select(job.c.id)
    .where(tuple_(job.c.id, job.c.version).in_(bindparam("s_pairs", expanding=True)),
           job.c.state.in_(list(STARTABLE_STATES)),
           job.c.due_at <= bindparam("s_due_by", type_=job.c.due_at.type),
           or_(job.c.expires_at.is_(None), job.c.expires_at > _S_NOW))
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
    .returning(*_ROW_COLUMNS)
)
_INSERT_ATTEMPT = attempt.insert()


def _open_attempts(
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


def why_not_started(conn: Connection, message: JobMessage, now: datetime) -> str:
    """Name the reason a start matched no row, for logs and metrics."""
    row = conn.execute(
        select(job.c.state, job.c.version, job.c.due_at, job.c.expires_at)
        .where(job.c.id == message.job_id)
    ).first()
    if row is None:
        return "unknown_job"
    state, version, due_at, expires_at = row
    refused = _not_runnable(message, state, version)
    if refused is not None:
        return refused
    if due_at > now:
        return "not_due"
    if expires_at is not None and expires_at <= now:
        return "expired"
    return "locked"


def _not_runnable(message: JobMessage, state: str, version: int) -> str | None:
    """Why a message cannot run the job in this state and version (None: it can)."""
    if state == JobState.CANCELLED:
        return "cancelled"
    if version != message.version:
        return "stale_version"
    if state not in STARTABLE_STATES:
        return "already_" + str(state).lower()
    return None


def check_early(conn: Connection, messages: Sequence[JobMessage]
                ) -> list[tuple[str | None, datetime | None]]:
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
    out: list[tuple[str | None, datetime | None]] = []
    for message in messages:
        row = rows.get(message.job_id)
        if row is None:
            out.append(("unknown_job", None))
            continue
        refused = _not_runnable(message, row.state, row.version)
        if refused is None and (row.task, row.queue) != (message.task, message.queue):
            refused = "forged"  # deferred, it would go where the forger says
        out.append((refused, None) if refused is not None else (None, row.due_at))
    return out


def give_back(conn: Connection, *, job_id: uuid.UUID, version: int, now: datetime) -> int:
    """An ENQUEUED job whose message a worker could not put back in the
    broker (a deferral the broker refused) returns to SCHEDULED, fenced by
    version, and the relay publishes it again when due."""
    return conn.execute(_by_primary_key(
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


# Group commit (consumers/group_commit.py): several jobs' completions in one
# transaction.  Their rows are locked first, and the lease checked under the
# lock, so the multi-row statements below need no per-row fence: nobody can
# move a locked job on (claims and recovery SKIP LOCKED rows; a cancel waits).
_LEASES = (
    select(job.c.id, job.c.state, job.c.lease_owner, job.c.lease_generation, job.c.version)
    .where(job.c.id.in_(bindparam("ids", expanding=True)))
)
# One lock order for every transaction: no deadlock among them.
_LOCK_LEASED = _LEASES.order_by(job.c.id).with_for_update()
_COMPLETE_MANY = _by_primary_key(update(job).where(
    job.c.id.in_(bindparam("ids", expanding=True)), job.c.state == JobState.RUNNING,
).values(state=JobState.SUCCEEDED, finished_at=_p("f_now", job.c.finished_at),
         lease_owner=None, lease_until=None, updated_at=_p("f_now", job.c.updated_at)))
_FINISH_ATTEMPTS = (
    update(attempt)
    .where(attempt.c.id.in_(bindparam("ids", expanding=True)), attempt.c.outcome.is_(None))
    .values(outcome=_p("a_outcome", attempt.c.outcome),
            finished_at=_p("a_now", attempt.c.finished_at))
)


def lock_leased(conn: Connection, records: Sequence[JobRecord]) -> dict[uuid.UUID, str]:
    """Lock the jobs' rows until the transaction ends and say, per job id,
    whether its lease still holds: ``held``, ``cancelled`` or ``lost``
    (taken over, finished, rescheduled).  On SQLite the transaction's write
    lock does what FOR UPDATE does elsewhere."""
    return lease_states(conn, records, lock=True)


def lease_states(conn: Connection, records: Sequence[JobRecord], *, lock: bool = False
                 ) -> dict[uuid.UUID, str]:
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
            verdict[rec.id] = "held"
        elif row is not None and row.state == JobState.CANCELLED:
            verdict[rec.id] = "cancelled"
        else:
            verdict[rec.id] = "lost"
    return verdict


def renew_leases(conn: Connection, records: Sequence[JobRecord], *, now: datetime,
                 until: datetime) -> set[uuid.UUID]:
    """Extend the leases of jobs still RUNNING under these very leases (owner
    and generation): the ids renewed.  Jobs waiting in a worker for a free
    executor keep their leases this way."""
    keys = [(r.id, r.lease_owner, r.lease_generation) for r in records]
    stmt = _by_primary_key(
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
    "EnqueuedRef",
    "JobRecord",
    "Recovered",
    "Refusal",
    "any_too_late",
    "check_early",
    "checkpoint_stmt",
    "claim_for_dispatch",
    "claim_for_run",
    "claim_selected",
    "dead_stmt",
    "enqueued_page",
    "expire",
    "expire_overdue",
    "finish_attempt_stmt",
    "give_back",
    "heartbeat_stmt",
    "mark_and_claim",
    "mark_enqueued",
    "next_due",
    "recover",
    "recover_owned",
    "refuse",
    "release",
    "requeue_lost",
    "retry_stmt",
    "start",
    "why_not_started",
]
