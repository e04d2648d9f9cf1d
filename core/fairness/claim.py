"""Fair dispatch, backend-neutral: a claim composed class by class under a
:class:`~duebox.fairness.policy.DispatchPolicy` (core/fairness/policy.py:
shares, reserved capacity, aging) and within the shared rate buckets
(core/fairness/buckets.py).

Two claimers use it: the relay on broker backends (:meth:`FairPicker.claim`
moves the picked rows to ``DISPATCHING``) and the ``sql://`` worker
(brokers/sql.py, which moves them straight to ``RUNNING``).  Both get the
same policy (``Settings.dispatch_policy`` / ``DUEBOX_DISPATCH_POLICY``) and
share the same bucket rows, so one configuration shapes either path.

Every read here is one bounded seek on ``ix_duebox_job_class_due`` =
``(state, queue, tenant, priority, due_at)``:

* :func:`classes` walks the distinct ``(queue, tenant, priority)`` keys of
  ``SCHEDULED`` jobs with one ``ORDER BY ... LIMIT 1`` seek per key (a loose
  index scan), plus one seek for each key's earliest due time.  Its cost
  grows with the number of keys, never with the number of jobs.
* :func:`duebox.leases.claims.class_candidates` reads the ``limit`` earliest-due jobs of one key,
  ``FOR UPDATE SKIP LOCKED``: within a key the index is already in due order.

A NULL tenant (no tenant) is its own key; it is walked separately because
dialects disagree on where NULL sorts.  On MySQL/MariaDB the default
collation is case-insensitive: names differing only in case are one class
(and share one tenant bucket), as they are one value to every other query.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, select

from ..leases.claims import Candidate, ClassKey, claim_selected, class_candidates, tenant_is
from ..leases.records import JobRecord
from ..states import JobState
from ..tables import job
from ..timing import MIN_REFILL_SECONDS
from .buckets import Held, bucket_wait, lock_buckets, spend_buckets
from .policy import DispatchPolicy, Group, effective_priority, plan


def _scheduled(*conds: ColumnElement[bool]) -> ColumnElement[bool]:
    return and_(job.c.state == JobState.SCHEDULED, *conds)


def _first(conn: Connection, column: Any, where: ColumnElement[bool]) -> Any:
    return conn.execute(select(column).where(where).order_by(column).limit(1)).first()


def _walk(conn: Connection, column: Any, where: ColumnElement[bool], cap: int) -> list[Any]:
    """Distinct non-NULL values of ``column`` under ``where``, one seek each."""
    out: list[Any] = []
    row = _first(conn, column, and_(where, column.is_not(None)))
    while row is not None and len(out) < cap:
        out.append(row[0])
        row = _first(conn, column, and_(where, column > row[0]))
    return out


def classes(conn: Connection, *, cap: int, queues: Sequence[str] | None = None
            ) -> list[tuple[ClassKey, datetime]]:
    """Every class with a SCHEDULED job (at most ``cap``) and its earliest due
    time; with ``queues``, only theirs (a worker's: no walk over the others)."""
    found: list[tuple[ClassKey, datetime]] = []
    names = sorted(set(queues)) if queues else _walk(conn, job.c.queue, _scheduled(), cap)
    for queue in names:
        in_queue = _scheduled(job.c.queue == queue)
        tenants: list[str | None] = []
        if _first(conn, job.c.id, and_(in_queue, job.c.tenant.is_(None))) is not None:
            tenants.append(None)
        tenants += _walk(conn, job.c.tenant, in_queue, cap)
        for tenant in tenants:
            of_tenant = and_(in_queue, tenant_is(tenant))
            for priority in _walk(conn, job.c.priority, of_tenant, cap):
                due = conn.execute(
                    select(job.c.due_at).where(of_tenant, job.c.priority == priority)
                    .order_by(job.c.due_at).limit(1)
                ).scalar()
                if due is not None:
                    found.append((ClassKey(queue, tenant, priority), due))
                if len(found) >= cap:
                    return found
    return found




@dataclass
class BatchReport:
    """What the last fair claim did (metrics and the claimer's sleep)."""

    by_group: dict[Group, int] = field(default_factory=dict)
    throttled: set[str] = field(default_factory=set)  # bucket names that ran dry
    wait: float = 0.0  # seconds until a dry bucket has tokens again


class FairPicker:
    """Picks (and locks) the rows of one fair claim; the caller moves them on
    in the same transaction (the relay to DISPATCHING, a ``sql://`` worker to
    RUNNING), so a claim that rolls back has spent no tokens."""

    def __init__(self, policy: DispatchPolicy) -> None:
        self.policy = policy
        self.deficits: dict[Group, float] = {}
        self._keys: list[ClassKey] = []
        self._queues: tuple[str, ...] | None = None
        self._refreshed = -math.inf
        self.last = BatchReport()

    def _classes(self, conn: Connection, queues: Sequence[str] | None
                 ) -> dict[Group, list[ClassKey]]:
        wanted = tuple(sorted(set(queues))) if queues else None
        if wanted != self._queues or \
                time.monotonic() - self._refreshed >= self.policy.class_refresh:
            self._keys = [k for k, _ in classes(conn, cap=self.policy.max_classes,
                                                queues=wanted)]
            self._queues = wanted
            self._refreshed = time.monotonic()
            live = {(k.queue, k.tenant) for k in self._keys}
            self.deficits = {g: d for g, d in self.deficits.items() if g in live}
        groups: dict[Group, list[ClassKey]] = {}
        for k in self._keys:
            groups.setdefault((k.queue, k.tenant), []).append(k)
        return groups

    def pick(
        self, conn: Connection, *, horizon: datetime, after: datetime | None, now: datetime,
        limit: int, fence: ColumnElement[bool] | None = None,
        queues: Sequence[str] | None = None,
    ) -> list[uuid.UUID]:
        """Up to ``limit`` SCHEDULED jobs due by ``horizon``, locked for this
        transaction, composed by the policy; their tokens are spent (written
        back) here."""
        groups = self._classes(conn, queues)
        report = BatchReport()
        self.last = report
        if not groups:
            return []
        buckets = lock_buckets(conn, self.policy.limits(list(groups)), now)
        budget = limit
        if "global" in buckets:
            budget = min(budget, buckets["global"].available)
        shares = plan(list(groups), budget, self.policy, self.deficits)
        chosen: list[Candidate] = []
        full: list[Group] = []
        for g, share in shares.items():
            got = self._take(conn, g, groups[g], share, buckets, report, horizon, after, now,
                             fence)
            chosen += got
            self.deficits[g] = max(0.0, self.deficits.get(g, 0.0) - len(got))
            if share and len(got) == share:
                full.append(g)
            elif len(got) < share:
                self.deficits[g] = 0.0  # nothing more due (or no tokens): no credit hoarded
        left = budget - len(chosen)
        for g in sorted(full, key=lambda g: -self.policy.weight(g[0])):
            if left <= 0:
                break
            got = self._take(conn, g, groups[g], left, buckets, report, horizon, after, now,
                             fence, skip={c.id for c in chosen})
            chosen += got
            left -= len(got)
        if "global" in buckets and buckets["global"].available == 0:
            report.throttled.add("global")
        spend_buckets(conn, buckets.values(), now)
        dry = [buckets[n] for n in report.throttled]
        if dry:
            report.wait = min(bucket_wait([b], self._refill(b)) for b in dry)
        return [c.id for c in chosen]

    def claim(
        self, conn: Connection, *, owner: str, horizon: datetime, after: datetime | None,
        now: datetime, lease_until: datetime, limit: int,
        fence: ColumnElement[bool] | None = None,
    ) -> list[JobRecord]:
        """The relay's claim: :meth:`pick`, then the picked rows SCHEDULED →
        DISPATCHING, leased to ``owner``, in due order."""
        ids = self.pick(conn, horizon=horizon, after=after, now=now, limit=limit, fence=fence)
        return claim_selected(conn, ids, owner=owner, now=now, lease_until=lease_until,
                              fence=fence)

    @staticmethod
    def _refill(b: Held) -> int:
        return max(1, math.ceil(b.limit.rate * MIN_REFILL_SECONDS))

    def _take(
        self, conn: Connection, g: Group, keys: list[ClassKey], share: int,
        buckets: dict[str, Held], report: BatchReport, horizon: datetime,
        after: datetime | None, now: datetime, fence: ColumnElement[bool] | None,
        skip: set[Any] | None = None,
    ) -> list[Candidate]:
        """Up to ``share`` jobs of group ``g``, best effective priority first,
        within what its buckets allow (spent here)."""
        limiting = [buckets[n] for n in ("global", f"queue:{g[0]}", f"tenant:{g[1] or ''}")
                    if n in buckets]
        allowed = min([share, *(b.available for b in limiting)])
        for b in limiting:
            if b.available < share:
                report.throttled.add(b.name)
        if allowed <= 0:
            return []
        skip = skip or set()
        # Rows this transaction already took are locked by it, so SKIP LOCKED
        # returns them again: read past them.
        mine = report.by_group.get(g, 0) if skip else 0
        pool: list[Candidate] = []
        for key in keys:
            rows = class_candidates(conn, key, horizon=horizon, after=after,
                                    limit=allowed + mine, fence=fence)
            pool += [c for c in rows if c.id not in skip]
        step = self.policy.aging_step
        pool.sort(key=lambda c: (-effective_priority(c.priority, c.due_at, now, step), c.due_at))
        got = pool[:allowed]
        for b in limiting:
            b.spent += len(got)
        report.by_group[g] = report.by_group.get(g, 0) + len(got)
        return got


__all__ = ["BatchReport", "ClassKey", "DispatchPolicy", "FairPicker", "Group", "classes"]
