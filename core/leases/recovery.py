"""Jobs that went astray, put back on track: leases that ran out (a relay
or worker crashed, paused or was cut off), leases of a process found dead,
messages a broker lost (reconciliation) and due jobs too late to run.

Each is a bounded batch over :func:`duebox.leases.claims.locked`, which skips rows
another transaction holds, so recovery never waits for a live claim.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, not_, or_, select, update

from ..failures import SystemFailure
from ..states import JobState
from ..tables import attempt, job
from .claims import due, locked, update_locked
from .records import by_primary_key


def _too_late(now: datetime, lateness: Mapping[str, float]) -> list[Any]:
    conditions = [job.c.expires_at <= now]
    conditions += [and_(job.c.task == task, job.c.due_at < now - timedelta(seconds=late))
                   for task, late in sorted(lateness.items())]
    return conditions


def any_too_late(conn: Connection, *, now: datetime, lateness: Mapping[str, float]) -> bool:
    """Whether :func:`expire_overdue` would find anything (a read, no locks)."""
    return conn.execute(
        select(job.c.id).where(due(now), or_(*_too_late(now, lateness))).limit(1)
    ).first() is not None


def expire_overdue(
    conn: Connection, *, now: datetime, lateness: Mapping[str, float], limit: int
) -> int:
    """SCHEDULED jobs past ``expires_at``, or due longer ago than their task's
    max lateness (``lateness``: task name → seconds), become EXPIRED: a
    bounded batch per condition, never run."""
    total = 0
    for condition in _too_late(now, lateness):
        candidates = locked(and_(due(now), condition), limit)
        total += update_locked(
            conn,
            update(job).where(job.c.state == JobState.SCHEDULED)
            .values(state=JobState.EXPIRED, lease_owner=None, lease_until=None,
                    finished_at=now, updated_at=now, error_class=SystemFailure.EXPIRED,
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
    conn: Connection, *, now: datetime, margin: float, redeliver_after: float, limit: int,
    spare: ColumnElement[bool] | None = None,
) -> Recovered:
    """Return jobs whose lease expired (plus ``margin`` for clock skew) to SCHEDULED,
    except those ``spare`` matches (:func:`claimed_since`).

    A RUNNING job whose worker vanished counts as a failed attempt: once its
    attempts are used up it goes to DEAD instead of cycling forever.
    """
    cutoff = now - timedelta(seconds=margin)
    expired = job.c.lease_until < cutoff
    dispatching, running, dead = _return_leases(
        conn, expired if spare is None else and_(expired, not_(spare)), now=now, limit=limit,
        lost_error="lease expired: the worker stopped heartbeating (crash, kill or pause)")
    free = {"lease_owner": None, "lease_until": None, "updated_at": now}
    stale = now - timedelta(seconds=redeliver_after)
    # Measured from the due time *and* from the last publish: a job already
    # republished waits redeliver_after again.  From the due time alone, every
    # recovery pass of every relay republished every overdue job once a backlog
    # passed redeliver_after, and the duplicates deepened the backlog (the soak
    # saw 23,706 messages queued for 2,400 jobs).
    enqueued = update_locked(
        conn, update(job).values(state=JobState.SCHEDULED, **free),
        locked(
            and_(job.c.state == JobState.ENQUEUED, job.c.due_at < stale,
                 or_(job.c.published_at.is_(None), job.c.published_at < stale)), limit),
    )
    return Recovered(dispatching, running, dead, enqueued)


def claimed_since(process: str, since: datetime) -> ColumnElement[bool]:
    """The claims ``process`` took at or after ``since``: a relay still
    publishing them (a broker slower than the lease) spares them in its own
    recovery, and marks or releases them itself; another relay's recovery
    does not, so a process paused past its lease is still recovered."""
    return and_(job.c.lease_owner.startswith(process + "#", autoescape=True),
                job.c.claimed_at.is_not(None), job.c.claimed_at >= since)


def recover_owned(conn: Connection, *, process: str, now: datetime, limit: int) -> Recovered:
    """Return the jobs leased by a process found dead (core/processes/liveness.py) to
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
    dispatching = update_locked(
        conn, update(job).where(job.c.state == JobState.DISPATCHING, which)
        .values(state=JobState.SCHEDULED, **free),
        locked(and_(job.c.state == JobState.DISPATCHING, which), limit),
    )
    lost_ids = list(conn.execute(locked(
        and_(job.c.state == JobState.RUNNING, which), limit)).scalars())
    running = dead = 0
    if lost_ids:
        dead = conn.execute(by_primary_key(
            update(job)
            .where(job.c.id.in_(lost_ids), job.c.state == JobState.RUNNING,
                   job.c.attempt >= job.c.max_attempts)
            .values(state=JobState.DEAD, error_class=SystemFailure.LOST, last_error=lost_error,
                    finished_at=now, **free)
        )).rowcount
        running = conn.execute(by_primary_key(
            update(job)
            .where(job.c.id.in_(lost_ids), job.c.state == JobState.RUNNING)
            .values(state=JobState.SCHEDULED, error_class=SystemFailure.LOST,
                    last_error=lost_error, **free)
        )).rowcount
        conn.execute(
            update(attempt)
            .where(attempt.c.job_id.in_(lost_ids), attempt.c.outcome.is_(None))
            .values(outcome="lost", error_class=SystemFailure.LOST, finished_at=now)
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


__all__ = ["EnqueuedRef", "Recovered", "any_too_late", "claimed_since", "enqueued_page",
           "expire_overdue", "recover", "recover_owned", "requeue_lost"]
