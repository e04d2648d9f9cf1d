"""Occurrence generation: due schedules become jobs, safely with many relays.

One short transaction per batch (:func:`generate_due`):

1. claim up to ``limit`` schedules whose ``next_fire_at`` is due, ``FOR
   UPDATE SKIP LOCKED`` (SQLite: the engine's ``BEGIN IMMEDIATE`` serialises
   the whole transaction instead);
2. plan each one (:func:`plan`: misfire and overlap policies, pure);
3. insert its occurrences with insert-if-absent on ``(schedule_id,
   nominal_fire_at)``, each with the id ``uuid5(schedule_id, nominal ISO)``;
4. advance ``next_fire_at`` (and ``last_fire_at``) — nothing else — in the
   same transaction.

A relay that dies anywhere in between commits nothing; one that generates the
same fire time as another inserts nothing twice.  ``next_fire_at`` is always
the earliest fire time not yet generated, so a schedule never silently stops:
it stays due until a relay advances it.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, bindparam, false, func, not_, or_, select, update

from ..db import NOTIFY_CHANNEL, insert_if_absent
from ..producer import NewJob
from ..states import ACTIVE_STATES, JobState
from ..tables import job, schedule
from .api import ScheduleInfo
from .cron import Fire

log = logging.getLogger("duebox.schedules")

OCCURRENCE_NAMESPACE = uuid.UUID("0b7d4f0e-5c1e-5a38-9f51-3d2f0c6a9e71")
_JITTER_NAMESPACE = uuid.UUID("8e0c2d61-47a4-5f0b-b1a6-6c3f5d9e2a14")


def _nominal_key(schedule_id: uuid.UUID, nominal: datetime) -> str:
    return f"{schedule_id}/{nominal.astimezone(UTC).isoformat()}"


def occurrence_id(schedule_id: uuid.UUID, nominal: datetime) -> uuid.UUID:
    """The job id of a schedule's occurrence: the same on every relay, forever."""
    return uuid.uuid5(OCCURRENCE_NAMESPACE, _nominal_key(schedule_id, nominal))


def jitter_for(schedule_id: uuid.UUID, nominal: datetime, jitter_seconds: int) -> timedelta:
    """A fixed pseudo-random delay in ``[0, jitter_seconds]`` (millisecond steps),
    derived like the id so every relay computes the same due time."""
    if jitter_seconds <= 0:
        return timedelta(0)
    h = uuid.uuid5(_JITTER_NAMESPACE, _nominal_key(schedule_id, nominal)).int
    return timedelta(milliseconds=h % (jitter_seconds * 1000 + 1))


@dataclass(frozen=True)
class Plan:
    """What one pass does to one schedule."""

    fires: list[Fire]
    next_fire_at: datetime | None
    misfired: bool = False  # fire times older than the grace were coalesced or dropped
    overlapped: int = 0  # fire times dropped because the previous run was active
    blocked: bool = False  # overlap=queue and the previous run is active: wait
    full: bool = False  # stopped at the budget; more is due now


def plan(
    info: ScheduleInfo, now: datetime, *, grace: float, lookahead: float, budget: int,
    previous_active: bool,
) -> Plan:
    """Decide which fire times become occurrences now and where the cursor goes.

    * A fire time before ``now - grace`` was **missed**.  ``fire_all`` creates
      every missed one (``budget`` per pass); ``fire_once`` only the latest;
      ``skip`` none.  Fire times within the grace are on time.
    * Fire times up to ``now + lookahead`` are created ahead of time (their
      jobs' ``due_at`` still holds them back) when ``overlap`` is ``allow``;
      ``skip`` and ``queue`` decide at the fire time itself.
    * ``overlap``: ``skip`` drops a fire time while the previous occurrence is
      active; ``queue`` waits for it (the cursor stays, the misfire policy
      applies to what the wait made late); ``allow`` ignores it.
    """
    cursor = info.next_fire_at
    if cursor is None or info.paused:
        return Plan([], cursor)
    allow = info.overlap == "allow"
    horizon = now + timedelta(seconds=lookahead if allow else 0.0)
    if cursor > horizon:
        return Plan([], cursor)
    if info.overlap == "queue" and previous_active:
        return Plan([], cursor, blocked=True)
    rule = info.rule
    cutoff = now - timedelta(seconds=grace)
    candidates: list[Fire] = []
    start = cursor
    misfired = False
    if cursor < cutoff and info.misfire != "fire_all":
        misfired = True
        if info.misfire == "fire_once":
            latest = rule.last_before(cutoff, not_before=cursor)
            if latest is not None:
                candidates.append(latest)
        start = cutoff
    limit = 1 if info.overlap == "queue" else max(1, budget)
    following: Fire | None = None
    full = False
    for fire in rule.fires_from(start):
        if fire.at > horizon:
            following = fire
            break
        if len(candidates) >= limit:
            following, full = fire, info.overlap != "queue"
            break
        candidates.append(fire)
    next_at = following.at if following is not None else None
    if allow:
        return Plan(candidates, next_at, misfired=misfired, full=full)
    if info.overlap == "skip":
        take = [] if previous_active else candidates[:1]
        return Plan(take, next_at, misfired=misfired, overlapped=len(candidates) - len(take),
                    full=full)
    return Plan(candidates[:1], next_at, misfired=misfired)


def occurrence_row(info: ScheduleInfo, fire: Fire, now: datetime) -> dict[str, Any]:
    due = fire.at + jitter_for(info.id, fire.at, info.jitter)
    expires = due + timedelta(seconds=info.expire_after) if info.expire_after else None
    new = NewJob(
        task=info.task, queue=info.queue, payload=info.payload, due_at=due,
        max_attempts=info.max_attempts, priority=info.priority, expires_at=expires,
        schedule_id=info.id, nominal_fire_at=fire.at,
    )
    return new.row(occurrence_id(info.id, fire.at), now)


@dataclass
class GenerateResult:
    claimed: int = 0
    advanced: int = 0
    occurrences: int = 0
    misfired: int = 0
    overlapped: int = 0
    errors: int = 0
    more: bool = False
    errored: list[uuid.UUID] = field(default_factory=list)


def _active_previous(conn: Connection, infos: list[ScheduleInfo]) -> set[uuid.UUID]:
    """Which of these schedules' last generated occurrence is still active
    (one query on the occurrence unique index, for overlap skip/queue)."""
    wanted = {(i.id, i.last_fire_at) for i in infos
              if i.overlap != "allow" and i.last_fire_at is not None}
    if not wanted:
        return set()
    found = conn.execute(
        select(job.c.schedule_id, job.c.nominal_fire_at).where(
            job.c.schedule_id.in_([sid for sid, _ in wanted]),
            job.c.nominal_fire_at.in_([at for _, at in wanted]),
            job.c.state.in_(list(ACTIVE_STATES)),
        )
    ).all()
    return {sid for sid, at in found if (sid, at) in wanted}


# The cursor update, one cached statement run as an executemany.
_ADVANCE = (
    update(schedule)
    .where(schedule.c.id == bindparam("b_id"), schedule.c.version == bindparam("b_version"))
    .values(next_fire_at=bindparam("b_next"), last_fire_at=bindparam("b_last"))
)


_UNIQUE = ["schedule_id", "nominal_fire_at"]


def _insert(conn: Connection, rows: list[dict[str, Any]]) -> int:
    """Insert-if-absent on ``(schedule_id, nominal_fire_at)``; returns how many
    were new.  One cached statement run as an executemany where the dialect
    can (a multi-VALUES insert would be compiled afresh every time)."""
    name = conn.dialect.name
    stmt: Any = None
    if name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        stmt = pg_insert(job).on_conflict_do_nothing(index_elements=_UNIQUE)
    elif name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        stmt = sqlite_insert(job).on_conflict_do_nothing(index_elements=_UNIQUE)
    if stmt is not None and conn.dialect.insert_executemany_returning:
        return len(conn.execute(stmt.returning(job.c.id), rows).all())
    inserted = conn.execute(insert_if_absent(job, rows, name, _UNIQUE)).rowcount
    return max(0, int(inserted))


def due_schedules(now: datetime, lookahead: float, limit: int) -> Any:
    """Schedules to generate for, oldest cursor first, locked with SKIP LOCKED.

    ``overlap='queue'`` schedules whose previous occurrence is still active are
    left out (a point lookup on the occurrence unique index), so waiting
    schedules never crowd out the others."""
    prev = job.alias("prev")
    waiting = (
        select(prev.c.id)
        .where(prev.c.schedule_id == schedule.c.id,
               prev.c.nominal_fire_at == schedule.c.last_fire_at,
               prev.c.state.in_(list(ACTIVE_STATES)))
        .exists()
    )
    return (
        select(schedule)
        .where(
            schedule.c.paused == false(),
            schedule.c.next_fire_at <= now + timedelta(seconds=lookahead),
            or_(schedule.c.overlap_policy == "allow", schedule.c.next_fire_at <= now),
            not_(and_(schedule.c.overlap_policy == "queue", waiting)),
        )
        .order_by(schedule.c.next_fire_at)
        .limit(limit)
        .with_for_update(skip_locked=True, of=schedule)
    )


def generate_due(
    conn: Connection, *, now: datetime, limit: int, lookahead: float, grace: float,
    notify: bool = False, max_occurrences: int | None = None,
) -> GenerateResult:
    """One bounded batch of occurrence generation, in the caller's transaction
    (which should be short: commit right after): at most ``limit`` schedules
    and ``max_occurrences`` (default ``4 * limit``) new jobs."""
    result = GenerateResult()
    infos = [ScheduleInfo.from_row(r) for r in conn.execute(due_schedules(now, lookahead, limit))]
    result.claimed = len(infos)
    active = _active_previous(conn, infos)
    budget = max_occurrences if max_occurrences is not None else 4 * limit
    new_rows: list[dict[str, Any]] = []
    advances: list[dict[str, Any]] = []
    for info in infos:
        if budget <= 0:
            result.more = True
            break
        try:
            p = plan(info, now, grace=grace, lookahead=lookahead, budget=budget,
                     previous_active=info.id in active)
        except ValueError as exc:  # a stored rule that no longer resolves (zone removed...)
            log.error("schedule %s (%s): cannot plan occurrences: %s", info.name, info.id, exc)
            result.errors += 1
            result.errored.append(info.id)
            continue
        if p.blocked:
            continue
        if p.next_fire_at is None:
            log.warning("schedule %s (%s): %r in %s has no fire time left; it is finished",
                        info.name, info.id, info.cron, info.timezone)
        new_rows += [occurrence_row(info, f, now) for f in p.fires]
        advances.append({
            "b_id": info.id, "b_version": info.version, "b_next": p.next_fire_at,
            "b_last": max((f.at for f in p.fires), default=info.last_fire_at),
        })
        result.misfired += int(p.misfired)
        result.overlapped += p.overlapped
        budget -= len(p.fires)
        result.more = result.more or p.full
    if new_rows:
        result.occurrences = _insert(conn, new_rows)
    if advances:
        conn.execute(_ADVANCE, advances)
        result.advanced = len(advances)
    if len(infos) >= limit and result.advanced:
        result.more = True
    if result.occurrences and notify and conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_notify(NOTIFY_CHANNEL, "")))
    return result


def earliest_due(conn: Connection) -> datetime | None:
    """The earliest ``next_fire_at`` of the active schedules (an index seek)."""
    return conn.execute(
        select(schedule.c.next_fire_at)
        .where(schedule.c.paused == false(), schedule.c.next_fire_at.is_not(None))
        .order_by(schedule.c.next_fire_at).limit(1)
    ).scalar()


def backlog(conn: Connection, now: datetime, overdue_after: float, grace: float
            ) -> tuple[int, int]:
    """(jobs overdue by more than ``overdue_after`` s, schedules with fire
    times missed by more than ``grace`` s): what a relay finds on start."""
    jobs = conn.execute(
        select(func.count()).select_from(job).where(
            job.c.state == JobState.SCHEDULED,
            job.c.due_at < now - timedelta(seconds=overdue_after))
    ).scalar_one()
    schedules = conn.execute(
        select(func.count()).select_from(schedule).where(
            schedule.c.paused == false(),
            schedule.c.next_fire_at < now - timedelta(seconds=grace))
    ).scalar_one()
    return int(jobs), int(schedules)
