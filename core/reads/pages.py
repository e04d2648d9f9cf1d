"""The dashboard's reads that ``duebox status`` / ``jobs`` / ``dlq`` do not
already have (those are reused as they are).

Every query is bounded (a LIMIT, or a count over a capped subquery) and runs
on an index: job search walks the ``(state, due_at)`` index once per state
(keyset pages, merged), so it never sorts the whole table; a key or an id is
a unique-index lookup.
"""

from __future__ import annotations

import heapq
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, func, or_, select

from ..errors import ValidationError
from ..metrics import IN_FLIGHT_STATES
from ..processes.heartbeat import ROLES
from ..schedules.api import ScheduleInfo
from ..schedules.occurrences import jitter_for
from ..states import JobState
from ..tables import audit, job, lease, schedule
from .jobs import id_prefix, prefix_range
from .status import lateness_sample, percentile

SEARCH_COLUMNS = (job.c.id, job.c.task, job.c.queue, job.c.tenant, job.c.state, job.c.due_at,
                  job.c.attempt, job.c.version, job.c.key, job.c.error_class)
PAGE_MAX = 200


@dataclass(frozen=True)
class JobFilter:
    """What the job search page asks for; :func:`parse_filter` builds it."""

    text: str = ""  # a job id or a business key
    queue: str | None = None
    state: JobState | None = None
    due_from: datetime | None = None
    due_to: datetime | None = None


@dataclass(frozen=True)
class Cursor:
    """Where the next page starts (exclusive): jobs are listed by due time,
    newest first, then id."""

    due_at: datetime
    id: uuid.UUID

    def encode(self) -> str:
        return f"{self.due_at.isoformat()}_{self.id}"

    @classmethod
    def decode(cls, text: str) -> Cursor:
        due, _, ident = text.partition("_")
        try:
            return cls(_instant("after", due), uuid.UUID(ident))
        except ValueError:
            raise ValidationError("after", "must be a page cursor from this page", text) from None


def _instant(field: str, text: str) -> datetime:
    """An ISO 8601 time (UTC unless it has an offset) as a UTC instant."""
    try:
        at = datetime.fromisoformat(text)
        # An offset can carry a time at the calendar's ends past them in UTC.
        return at.astimezone(UTC) if at.tzinfo else at.replace(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise ValidationError(field, "must be an ISO 8601 time within years 1-9999 UTC, e.g. "
                                     "2026-03-29T02:30", text) from None


def parse_filter(args: dict[str, str]) -> JobFilter:
    """The search form's fields, checked; a bad one raises ValidationError
    naming it."""
    state = (args.get("state") or "").strip().upper() or None
    if state is not None and state not in JobState.__members__:
        raise ValidationError("state", f"must be one of {', '.join(JobState)}", state)
    due_from = (args.get("from") or "").strip()
    due_to = (args.get("to") or "").strip()
    return JobFilter(
        text=(args.get("q") or "").strip()[:400],
        queue=(args.get("queue") or "").strip() or None,
        state=JobState(state) if state else None,
        due_from=_instant("from", due_from) if due_from else None,
        due_to=_instant("to", due_to) if due_to else None,
    )


@dataclass
class JobPage:
    rows: list[Any]
    next: Cursor | None


def _conditions(f: JobFilter) -> list[Any]:
    conds = []
    if f.queue:
        conds.append(job.c.queue == f.queue)
    if f.due_from:
        conds.append(job.c.due_at >= f.due_from)
    if f.due_to:
        conds.append(job.c.due_at < f.due_to)
    return conds


def search_jobs(conn: Connection, f: JobFilter, *, limit: int = 50,
                after: Cursor | None = None) -> JobPage:
    """One page of jobs matching ``f``, newest due first."""
    limit = max(1, min(limit, PAGE_MAX))
    conds = _conditions(f)
    if f.state:
        conds.append(job.c.state == f.state)
    if f.text:
        # A business key (unique index), or an id or the start of one as the
        # list shows it, cut with "…" (a primary-key range): one page at most.
        by = [job.c.key == f.text]
        digits = id_prefix(f.text)
        if digits is not None:
            lo, hi = prefix_range(digits)
            by.append(and_(job.c.id >= lo, job.c.id <= hi))
        rows = conn.execute(select(*SEARCH_COLUMNS).where(or_(*by), *conds)
                            .order_by(job.c.id).limit(limit)).all()
        return JobPage(list(rows), None)
    if after is not None:
        conds.append(or_(job.c.due_at < after.due_at,
                         and_(job.c.due_at == after.due_at, job.c.id < after.id)))
    states = [f.state] if f.state else list(JobState)
    runs = []
    for state in states:
        stmt = (select(*SEARCH_COLUMNS).where(job.c.state == state, *conds)
                .order_by(job.c.due_at.desc(), job.c.id.desc()).limit(limit + 1))
        runs.append(conn.execute(stmt).all())
    merged = list(heapq.merge(*runs, key=lambda r: (r.due_at, r.id), reverse=True))
    rows = merged[:limit]
    more = len(merged) > limit
    return JobPage(rows, Cursor(rows[-1].due_at, rows[-1].id) if more and rows else None)


# --- charts ---------------------------------------------------------------------------


@dataclass
class LatenessBucket:
    start: datetime
    count: int
    p50: float | None
    p99: float | None


def lateness_buckets(conn: Connection, now: datetime, *, span: float = 3600.0,
                     buckets: int = 12) -> list[LatenessBucket]:
    """Start lateness (start - due) of jobs started in the last ``span``
    seconds, in ``buckets`` equal slices by start time: the same capped
    sample ``duebox status`` takes."""
    width = span / buckets
    first = now - timedelta(seconds=span)
    slices: list[list[float]] = [[] for _ in range(buckets)]
    for s in lateness_sample(conn, now, span):
        i = int((s.started_at - first).total_seconds() // width)
        if 0 <= i < buckets:
            slices[i].append(s.lateness)
    out = []
    for i, values in enumerate(slices):
        values.sort()
        out.append(LatenessBucket(first + timedelta(seconds=i * width), len(values),
                                  percentile(values, 0.50), percentile(values, 0.99)))
    return out


@dataclass
class DueBucket:
    start: datetime
    count: int
    capped: bool


def due_ahead(conn: Connection, now: datetime, *, horizon: float = 6 * 3600.0,
              buckets: int = 24, cap: int = 10_000) -> list[DueBucket]:
    """SCHEDULED jobs due in each slice of the next ``horizon`` seconds: one
    capped range count on the ``(state, due_at)`` index per slice."""
    width = horizon / buckets
    out = []
    for i in range(buckets):
        lo = now + timedelta(seconds=i * width)
        hi = lo + timedelta(seconds=width)
        ids = (select(job.c.id).where(job.c.state == JobState.SCHEDULED, job.c.due_at >= lo,
                                      job.c.due_at < hi).limit(cap).subquery())
        n = int(conn.execute(select(func.count()).select_from(ids)).scalar_one())
        out.append(DueBucket(lo, n, n >= cap))
    return out


def fires_ahead(conn: Connection, now: datetime, *, horizon: float = 6 * 3600.0,
                buckets: int = 24, cap: int = 10_000, schedules_max: int = 500) -> list[int]:
    """Schedule fire times due in each slice of the next ``horizon`` seconds
    that are not jobs yet: those at or after each active schedule's cursor
    (``next_fire_at``; earlier ones were generated and are counted by
    :func:`due_ahead`), jitter included.  At most ``schedules_max`` schedules
    (the soonest) and ``cap`` fire times in all, so a rule firing every
    second costs a bounded walk; a schedule whose stored rule no longer
    loads is left out (generation reports it)."""
    width = horizon / buckets
    budget = cap
    end = now + timedelta(seconds=horizon)
    counts = [0] * buckets
    rows = conn.execute(
        select(schedule).where(schedule.c.paused.is_(False), schedule.c.next_fire_at < end)
        .order_by(schedule.c.next_fire_at).limit(schedules_max)).all()
    for row in rows:
        info = ScheduleInfo.from_row(row)
        if info.next_fire_at is None:
            continue
        try:
            fires = info.rule.fires_from(info.next_fire_at)
        except ValidationError:
            continue
        for fire in fires:
            if fire.at >= end or budget <= 0:
                break
            budget -= 1
            due = fire.at + jitter_for(info.id, fire.at, info.jitter)
            i = int((due - now).total_seconds() // width)
            if 0 <= i < buckets:
                counts[i] += 1
    return counts


# --- processes and leases -------------------------------------------------------------


@dataclass(frozen=True)
class NamedLease:
    """A lease that is not a process's heartbeat: schedule generation, a
    relay's shard, ..."""

    name: str
    owner: str | None
    epoch: int
    expires_at: datetime | None
    info: dict[str, Any]


def named_leases(conn: Connection, limit: int = 200) -> list[NamedLease]:
    """Leases other than the process registry (schedule generation, shard
    ownership ...), by name: a primary-key range."""
    ours = [lease.c.name.like(f"{role}:%") for role in ROLES]
    return [NamedLease(r.name, r.owner, int(r.epoch), r.expires_at, dict(r.info or {}))
            for r in conn.execute(
                select(lease.c.name, lease.c.owner, lease.c.epoch, lease.c.expires_at,
                       lease.c.info)
                .where(~or_(*ours)).order_by(lease.c.name).limit(limit)).all()]


def in_flight_by_owner(conn: Connection, cap: int = 10_000) -> dict[str, dict[str, int]]:
    """Leased jobs per lease owner (relay or worker) and state, capped."""
    flying = (select(job.c.lease_owner, job.c.state)
              .where(job.c.state.in_(list(IN_FLIGHT_STATES))).limit(cap).subquery())
    out: dict[str, dict[str, int]] = {}
    for owner, state, n in conn.execute(
            select(flying.c.lease_owner, flying.c.state, func.count())
            .group_by(flying.c.lease_owner, flying.c.state)).all():
        # A worker leases each job as "<worker>#<job id>": count per process.
        name = (owner or "").split("#", 1)[0]
        held = out.setdefault(name, {})
        held[str(state)] = held.get(str(state), 0) + int(n)
    return out


# --- schedules ------------------------------------------------------------------------


def schedules_page(conn: Connection, *, after: str | None = None,
                   limit: int = 50) -> tuple[list[ScheduleInfo], str | None]:
    """A page of schedules by name (the unique name index), and the name the
    next page starts after."""
    stmt = select(schedule).order_by(schedule.c.name).limit(limit + 1)
    if after:
        stmt = stmt.where(schedule.c.name > after)
    rows = [ScheduleInfo.from_row(r) for r in conn.execute(stmt).all()]
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, rows[-1].name if more and rows else None


@dataclass(frozen=True)
class ScheduleAction:
    """An operator's pause or resume of a schedule, as audited."""

    at: datetime
    action: str
    operator: str | None
    reason: str | None
    details: dict[str, Any]


def schedule_audit(conn: Connection, schedule_id: uuid.UUID,
                   limit: int = 20) -> list[ScheduleAction]:
    """The latest pause/resume audit rows of one schedule.  Schedule rows
    carry no job id: this reads the newest ``limit * 10`` job-less rows (the
    ``job_id`` index) and keeps this schedule's."""
    rows = conn.execute(
        select(audit.c.at, audit.c.action, audit.c.operator, audit.c.reason, audit.c.details)
        .where(audit.c.job_id.is_(None), audit.c.action.like("schedule_%"))
        .order_by(audit.c.at.desc()).limit(limit * 10)).all()
    sid = str(schedule_id)
    return [ScheduleAction(r.at, r.action, r.operator, r.reason, dict(r.details or {}))
            for r in rows if (r.details or {}).get("schedule_id") == sid][:limit]
