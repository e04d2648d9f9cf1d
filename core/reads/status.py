"""The health report behind ``duebox status`` and the dashboard's overview:
one typed read model that answers "is it healthy?".

Everything comes from bounded, index-backed reads: the same snapshot the
relay's metrics collector takes (:func:`duebox.metrics.read_snapshot`), state
counts capped per state, a capped sample of recently started jobs for start
lateness, and the process registry in ``duebox_lease``.

The verdict is one of three (:class:`Verdict`): ``healthy``; ``degraded``
(warnings only: dead-lettered jobs, a shard without an owner, no relay or
worker while there is no work); ``unhealthy`` (problems: no relay or worker
while there is work, an oldest due job older than ``max_due_age``).

Work, for the missing processes, is what needs them soon: a job in flight
(``DISPATCHING``, ``ENQUEUED``, ``RUNNING``), or one ``SCHEDULED`` that is
due within ``due_within`` seconds.  A job due in an hour needs no relay yet:
one started in the meantime takes it in time.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, Engine, func, select

from ..db import SQLITE_DEFERRED, db_errors
from ..metrics import DEFAULT_COUNT_CAP, Group, read_snapshot, seconds
from ..states import JobState
from ..tables import job, lease, rate_bucket

# Jobs due this long before the window may still have started inside it; a
# job started later than this after its due time is outside the sample (its
# lateness shows in the oldest due age while it waits).
_LOOKBACK = timedelta(hours=1)
SAMPLE_CAP = 5000
_STARTED_STATES = (JobState.RUNNING, JobState.SUCCEEDED, JobState.DEAD)
_IN_FLIGHT_STATES = (JobState.DISPATCHING, JobState.ENQUEUED, JobState.RUNNING)
# A relay claims a job about this long before it is due (the hold and the
# broker's delay take it from there), and a probe runs about once a minute:
# a job due within it with no relay to claim it is a problem now.
DUE_WITHIN = 60.0


class Verdict(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"

    @property
    def exit_code(self) -> int:
        """``duebox status``'s exit status: 0 healthy, 3 degraded, 4 unhealthy
        (1 is a command that could not check, 2 a usage error: click's)."""
        return {Verdict.HEALTHY: 0, Verdict.DEGRADED: 3, Verdict.UNHEALTHY: 4}[self]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of a sorted list."""
    if not values:
        return None
    return values[max(0, math.ceil(q * len(values)) - 1)]


@dataclass(frozen=True)
class LatenessSample:
    queue: str
    tenant: str | None
    due_at: datetime
    started_at: datetime

    @property
    def lateness(self) -> float:
        return (self.started_at - self.due_at).total_seconds()


def lateness_sample(conn: Connection, now: datetime, window: float) -> list[LatenessSample]:
    """Up to ``SAMPLE_CAP`` jobs started in the last ``window`` seconds, newest
    due first: a range of the ``(state, due_at)`` index, no index on
    ``started_at`` needed."""
    since = now - timedelta(seconds=window)
    rows = conn.execute(
        select(job.c.queue, job.c.tenant, job.c.due_at, job.c.started_at)
        .where(job.c.state.in_(list(_STARTED_STATES)),
               job.c.due_at >= since - _LOOKBACK, job.c.due_at <= now,
               job.c.started_at >= since)
        .order_by(job.c.due_at.desc()).limit(SAMPLE_CAP)
    ).all()
    return [LatenessSample(*r) for r in rows]


@dataclass(frozen=True)
class GroupView:
    """One queue's or tenant's numbers."""

    due_backlog: int
    oldest_due_age_s: float
    overdue: int
    in_flight: int
    in_flight_by_state: dict[str, int]
    dlq: int
    dlq_oldest_age_s: float
    started_recently: int
    lateness_p50_s: float | None
    lateness_p99_s: float | None


def _group_view(g: Group | None, now: datetime, late: list[float]) -> GroupView:
    g = g or Group()
    late.sort()
    return GroupView(
        due_backlog=g.due_backlog,
        oldest_due_age_s=seconds(now, g.oldest_due_at) if g.oldest_due_at else 0.0,
        overdue=g.overdue,
        in_flight=sum(g.in_flight.values()),
        in_flight_by_state=dict(sorted(g.in_flight.items())),
        dlq=g.dlq,
        dlq_oldest_age_s=seconds(now, g.oldest_dlq_at) if g.oldest_dlq_at else 0.0,
        started_recently=len(late),
        lateness_p50_s=percentile(late, 0.50),
        lateness_p99_s=percentile(late, 0.99),
    )


@dataclass(frozen=True)
class ProcessView:
    name: str
    heartbeat_age_s: float | None
    expires_in_s: float
    info: dict[str, Any]
    shards: list[str] = field(default_factory=list)  # relays only


def _process_view(p: Any, now: datetime, shards: list[str]) -> ProcessView:
    return ProcessView(name=p.name,
                       heartbeat_age_s=seconds(now, p.heartbeat_at) if p.heartbeat_at else None,
                       expires_in_s=(p.expires_at - now).total_seconds(),
                       info=dict(p.info or {}), shards=shards)


@dataclass(frozen=True)
class ShardView:
    shard: str
    owner: str | None  # None: no live owner
    generation: int
    expires_in_s: float | None


def _shards(conn: Connection, now: datetime) -> list[ShardView]:
    """Shard leases (relay/shards.py): a bounded read, one row per shard."""
    rows = conn.execute(
        select(lease.c.name, lease.c.owner, lease.c.epoch, lease.c.expires_at)
        .where(lease.c.name.like("shard:%")).order_by(lease.c.name).limit(1024)).all()
    out = []
    for name, owner, epoch, expires_at in rows:
        live = owner is not None and expires_at is not None and expires_at > now
        out.append(ShardView(name.removeprefix("shard:"), owner if live else None, int(epoch),
                             (expires_at - now).total_seconds() if live else None))
    return out


@dataclass(frozen=True)
class BucketView:
    bucket: str
    tokens: float
    updated_at: str


def _buckets(conn: Connection) -> list[BucketView]:
    """Shared rate-limit buckets and their last level."""
    rows = conn.execute(select(rate_bucket.c.name, rate_bucket.c.tokens, rate_bucket.c.updated_at)
                        .order_by(rate_bucket.c.name).limit(200)).all()
    return [BucketView(n, round(float(t), 1), u.isoformat()) for n, t, u in rows]


@dataclass(frozen=True)
class StatusReport:
    at: str
    verdict: Verdict
    problems: list[str]  # each makes the verdict unhealthy
    warnings: list[str]  # each makes it at least degraded
    states: dict[str, int]
    queues: dict[str, GroupView]
    tenants: dict[str, GroupView]
    relays: list[ProcessView]
    workers: list[ProcessView]
    shards: list[ShardView]
    rate_buckets: list[BucketView]
    outbox_publication_lag_s: float
    window_s: float
    capped: bool
    cap: int

    @property
    def healthy(self) -> bool:
        return self.verdict is Verdict.HEALTHY

    def as_json(self) -> dict[str, Any]:
        """The report as JSON values (``duebox status --json``)."""
        out = asdict(self)
        out["verdict"] = str(self.verdict)
        out["healthy"] = self.healthy
        out["exit_code"] = self.verdict.exit_code
        return out


def _verdict(problems: list[str], warnings: list[str]) -> Verdict:
    if problems:
        return Verdict.UNHEALTHY
    return Verdict.DEGRADED if warnings else Verdict.HEALTHY


def _state_counts(conn: Connection, cap: int) -> tuple[dict[str, int], bool]:
    counts, capped = {}, False
    for state in JobState:
        ids = select(job.c.id).where(job.c.state == state).limit(cap).subquery()
        n = int(conn.execute(select(func.count()).select_from(ids)).scalar_one())
        if n:
            counts[str(state)] = n
            capped |= n >= cap
    return counts, capped


def _pressing(conn: Connection, horizon: datetime, cap: int,
              own_queues: Collection[str] = ()) -> int:
    """Jobs that need a relay and a worker soon (the module's docstring),
    outside ``own_queues`` (the queues your own consumer reads need no duebox
    worker: docs/own-consumers.md); capped like the counts.  Two ranges of
    the ``(state, due_at)`` index."""
    outside = [job.c.queue.not_in(sorted(own_queues))] if own_queues else []
    n = 0
    for where in (job.c.state.in_(list(_IN_FLIGHT_STATES)),
                  (job.c.state == JobState.SCHEDULED) & (job.c.due_at <= horizon)):
        ids = select(job.c.id).where(where, *outside).limit(cap).subquery()
        n += int(conn.execute(select(func.count()).select_from(ids)).scalar_one())
    return n


def build_report(engine: Engine, now: datetime, *, window: float = 300.0,
                 max_due_age: float = 60.0, overdue_after: float = 60.0,
                 cap: int = DEFAULT_COUNT_CAP, top_tenants: int = 20,
                 own_queues: Collection[str] = (), due_within: float = DUE_WITHIN
                 ) -> StatusReport:
    """``own_queues``: the queues your own consumer reads (the app's
    ``own_consumer_queues``): their jobs need a relay but no duebox worker.
    ``due_within``: seconds ahead in which a scheduled job is work that a
    missing relay or worker makes a problem (the module's docstring)."""
    reader = engine.execution_options(**{SQLITE_DEFERRED: True})
    horizon = now + timedelta(seconds=due_within)
    with db_errors("status"), reader.connect() as conn:
        states, states_capped = _state_counts(conn, cap)
        active = _pressing(conn, horizon, cap)
        for_workers = _pressing(conn, horizon, cap, own_queues) if own_queues else active
        snap = read_snapshot(conn, now, overdue_after=overdue_after, cap=cap,
                             top_tenants=top_tenants)
        sample = lateness_sample(conn, now, window)
        shards = _shards(conn, now)
        buckets = _buckets(conn)
    late_q: dict[str, list[float]] = {}
    late_t: dict[str, list[float]] = {}
    for s in sample:
        late_q.setdefault(s.queue, []).append(s.lateness)
        late_t.setdefault(s.tenant or "", []).append(s.lateness)
    queues = {q: _group_view(snap.queues.get(q), now, late_q.get(q, []))
              for q in sorted(set(snap.queues) | set(late_q))}
    tenants = {t: _group_view(g, now, late_t.get(t, [])) for t, g in sorted(snap.tenants.items())}
    relays = [_process_view(p, now, [s.shard for s in shards if s.owner == p.name])
              for p in snap.processes if p.role == "relay"]
    workers = [_process_view(p, now, []) for p in snap.processes if p.role == "worker"]

    problems: list[str] = []
    warnings: list[str] = []
    # Missing processes matter only when there is work for them; jobs of
    # your own consumer's queues need a relay, not a duebox worker.
    if not relays:
        (problems if active else warnings).append(
            "no live relay: nothing claims, recovers leases or fires schedules")
    if not workers and (for_workers or not own_queues):
        (problems if for_workers else warnings).append("no live worker")
    orphans = [s.shard for s in shards if s.owner is None]
    if orphans and relays:
        warnings.append(f"shards with no live owner: {', '.join(orphans)} "
                        "(taken over within a relay pass; persistent means no relay shards)")
    for q, v in queues.items():
        if v.oldest_due_age_s > max_due_age:
            problems.append(f"queue {q}: oldest due job waited {v.oldest_due_age_s:.0f} s "
                            f"(> {max_due_age:g} s)")
        if v.dlq:
            warnings.append(f"queue {q}: {v.dlq} dead-lettered jobs "
                            f"(oldest {v.dlq_oldest_age_s:.0f} s)")
    return StatusReport(
        at=now.isoformat(), verdict=_verdict(problems, warnings), problems=problems,
        warnings=warnings, states=states, queues=queues, tenants=tenants, relays=relays,
        workers=workers, shards=shards, rate_buckets=buckets,
        outbox_publication_lag_s=snap.oldest_due_age(), window_s=window,
        capped=states_capped or snap.capped, cap=cap)
