"""Fair dispatch, backend-neutral: the policy, the shares, the shared rate
buckets and the bounded, index-backed reads behind them.

Two claimers use it: the relay on broker backends (relay/fairness.py, which
moves the picked rows to ``DISPATCHING``) and the ``sql://`` worker
(brokers/sql.py, which moves them straight to ``RUNNING``).  Both get the
same :class:`DispatchPolicy` (``Settings.dispatch_policy`` /
``DUEBOX_DISPATCH_POLICY``) and share the same bucket rows, so one
configuration shapes either path.

Every read here is one bounded seek on ``ix_duebox_job_class_due`` =
``(state, queue, tenant, priority, due_at)``:

* :func:`classes` walks the distinct ``(queue, tenant, priority)`` keys of
  ``SCHEDULED`` jobs with one ``ORDER BY ... LIMIT 1`` seek per key (a loose
  index scan), plus one seek for each key's earliest due time.  Its cost
  grows with the number of keys, never with the number of jobs.
* :func:`candidates` reads the ``limit`` earliest-due jobs of one key,
  ``FOR UPDATE SKIP LOCKED``: within a key the index is already in due order.

A NULL tenant (no tenant) is its own key; it is walked separately because
dialects disagree on where NULL sorts.  On MySQL/MariaDB the default
collation is case-insensitive: names differing only in case are one class
(and share one tenant bucket), as they are one value to every other query.

Shares (:func:`plan`), in the policy's terms:

* **Weighted fair shares** — each queue has a weight (default 1); a queue's
  share of a batch is split equally among its tenants with due jobs, so a
  tenant flooding a queue gets the same share as a tenant with three jobs.
  Shares are kept as deficit counters across batches (deficit round robin),
  so a class whose share is a fraction of a job still gets one every few
  batches: every class with due jobs makes progress.
* **Reserved capacity** — ``reserved[queue]`` slots of every batch belong to
  that queue before weights divide the rest.
* **Work conserving** — slots a class cannot use (nothing due) go to the
  classes that filled theirs, by weight, in a second round.
* **Quotas and rate limits** — token buckets shared by every claimer
  (:func:`lock_buckets`): global, per queue and per tenant (``"*"``: each
  tenant not listed); a class never gets more than its buckets hold, however
  high its priority.
* **Aging** — within a group, candidates are the earliest-due jobs of each
  priority; the batch takes the highest ``priority + floor(waited /
  aging_step)``, so a low-priority job overtakes fresher high-priority work
  after ``(difference in priority) × aging_step`` seconds of waiting: its
  worst-case wait is bounded.

Rate buckets: a bucket is one ``duebox_rate_bucket`` row (``global``,
``queue:<name>``, ``tenant:<name>``) holding ``tokens`` and ``updated_at``.
A claim transaction locks the rows it needs (``SELECT ... FOR UPDATE``, in
name order so two claimers never deadlock), refills them by the time elapsed
since ``updated_at``, claims at most what they allow and writes back what it
spent, all before it commits: a token spent by one process is gone for the
others, and a claim that rolls back spends nothing.  On SQLite the claim's
``BEGIN IMMEDIATE`` already serialises writers, so the row lock is implicit.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, select, update
from sqlalchemy.exc import IntegrityError

from .errors import ConfigurationError
from .states import JobState
from .tables import job, rate_bucket

Group = tuple[str, str | None]  # (queue, tenant)

# A rate-limited claimer wakes when its bucket holds this many seconds' worth
# of tokens: small enough to keep the rate smooth, large enough to batch.
_MIN_REFILL = 0.05

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


def _scheduled(*conds: ColumnElement[bool]) -> ColumnElement[bool]:
    return and_(job.c.state == JobState.SCHEDULED, *conds)


def _tenant_is(tenant: str | None) -> ColumnElement[bool]:
    return job.c.tenant.is_(None) if tenant is None else job.c.tenant == tenant


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
            of_tenant = and_(in_queue, _tenant_is(tenant))
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


def candidates(
    conn: Connection, key: ClassKey, *, horizon: datetime, after: datetime | None, limit: int,
    extra: ColumnElement[bool] | None = None,
) -> list[Candidate]:
    """The ``limit`` earliest-due jobs of ``key`` due by ``horizon`` (and after
    ``after``), locked for this transaction; rows other claims hold are skipped."""
    where = _scheduled(job.c.queue == key.queue, _tenant_is(key.tenant),
                       job.c.priority == key.priority, job.c.due_at <= horizon)
    if after is not None:
        where = and_(where, job.c.due_at > after)
    if extra is not None:
        where = and_(where, extra)
    stmt = (select(job.c.id, job.c.due_at, job.c.priority).where(where)
            .order_by(job.c.due_at).limit(limit).with_for_update(skip_locked=True))
    return [Candidate(*row) for row in conn.execute(stmt)]



# --- rate buckets shared by every claimer -------------------------------------------


@dataclass(frozen=True, slots=True)
class Limit:
    """``rate`` tokens (jobs) per second, at most ``burst`` saved up."""

    rate: float
    burst: float


@dataclass
class Held:
    """A bucket locked by the current transaction."""

    name: str
    limit: Limit
    tokens: float
    at: datetime  # the instant ``tokens`` is the level at
    spent: int = 0

    @property
    def available(self) -> int:
        return max(0, math.floor(self.tokens - self.spent + 1e-9))


def _stamp(conn: Connection, at: datetime) -> datetime:
    """The instant the row can store exactly.  MySQL/MariaDB ``DATETIME``
    columns (as migrated) keep whole seconds: a stored ``12:00:00.9`` read
    back as ``12:00:00`` would refill 0.9 s that already counted."""
    if conn.dialect.name in ("mysql", "mariadb"):
        return at.replace(microsecond=0)
    return at


def _ensure(conn: Connection, name: str, limit: Limit, now: datetime) -> None:
    """Create the row full on first use; a concurrent creator wins harmlessly."""
    if conn.execute(select(rate_bucket.c.name).where(rate_bucket.c.name == name)).first():
        return
    try:
        with conn.begin_nested():
            conn.execute(rate_bucket.insert().values(name=name, tokens=limit.burst,
                                                     updated_at=_stamp(conn, now)))
    except IntegrityError:
        pass


def lock_buckets(conn: Connection, limits: Mapping[str, Limit], now: datetime
                 ) -> dict[str, Held]:
    """Lock and refill these buckets for the current transaction."""
    held: dict[str, Held] = {}
    for name in sorted(limits):
        limit = limits[name]
        _ensure(conn, name, limit, now)
        tokens, at = conn.execute(
            select(rate_bucket.c.tokens, rate_bucket.c.updated_at)
            .where(rate_bucket.c.name == name).with_for_update()
        ).one()
        # A claimer whose ``now`` is older than the row's (it waited for the
        # lock, or its clock is behind) refills nothing and never moves the
        # row back in time, so no interval is counted twice.
        elapsed = max(0.0, (now - at).total_seconds())
        held[name] = Held(name, limit, min(limit.burst, float(tokens) + elapsed * limit.rate),
                          max(now, at))
    return held


def spend_buckets(conn: Connection, buckets: Iterable[Held], now: datetime) -> None:
    """Write back the refilled level minus what this transaction spent.  Where
    the row keeps a coarser time than ``now``, the level is stored as of that
    earlier instant (less what accrues until ``now``): the next refill adds
    it back, so nothing is counted twice or lost."""
    for b in buckets:
        at = max(now, b.at)
        stamp = _stamp(conn, at)
        level = b.tokens - b.spent - (at - stamp).total_seconds() * b.limit.rate
        conn.execute(update(rate_bucket).where(rate_bucket.c.name == b.name)
                     .values(tokens=level, updated_at=stamp))


def bucket_wait(buckets: Iterable[Held], n: int) -> float:
    """How long until every bucket holds ``n`` more tokens than now (0: now)."""
    wait = 0.0
    for b in buckets:
        missing = min(n, b.limit.burst) - (b.tokens - b.spent)
        if missing > 0:
            wait = max(wait, missing / b.limit.rate)
    return wait


# --- the policy ----------------------------------------------------------------------


def _check_map(name: str, value: object, *, integer: bool = False) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{name}: must be a mapping of name to number (got {value!r})")
    out: dict[str, float] = {}
    for k, v in value.items():
        ok = isinstance(v, int) if integer else isinstance(v, int | float)
        if not isinstance(k, str) or isinstance(v, bool) or not ok or v < (0 if integer else 1e-9):
            kind = "an integer >= 0" if integer else "a number > 0"
            raise ConfigurationError(f"{name}[{k!r}]: must be {kind} (got {v!r})")
        out[k] = float(v)
    return out


@dataclass(frozen=True)
class DispatchPolicy:
    """How claims are composed, by the relay and by ``sql://`` workers alike
    (docs/scale.md).

    ``fair``: claim class by class (implied by any other setting here);
    ``queue_weights`` / ``reserved``: per queue; ``aging_step``: seconds of
    waiting worth one priority step; ``rate``, ``queue_rates``,
    ``tenant_rates``: jobs per second shared by all claimers (``"*"`` in
    ``tenant_rates``: every other tenant); ``burst_seconds``: how many
    seconds of rate a bucket may save up; ``class_refresh``: how often the
    classes are rediscovered; ``max_classes``: a cap on that walk.
    """

    fair: bool = False
    queue_weights: Mapping[str, float] = field(default_factory=dict)
    reserved: Mapping[str, int] = field(default_factory=dict)
    aging_step: float = 60.0
    rate: float | None = None
    queue_rates: Mapping[str, float] = field(default_factory=dict)
    tenant_rates: Mapping[str, float] = field(default_factory=dict)
    burst_seconds: float = 1.0
    class_refresh: float = 1.0
    max_classes: int = 1000

    def __post_init__(self) -> None:
        if not isinstance(self.fair, bool):
            raise ConfigurationError(f"fair: must be true or false (got {self.fair!r})")
        _check_map("queue_weights", self.queue_weights)
        _check_map("reserved", self.reserved, integer=True)
        _check_map("queue_rates", self.queue_rates)
        _check_map("tenant_rates", self.tenant_rates)
        for name in ("aging_step", "burst_seconds", "class_refresh"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigurationError(f"{name}: must be a number > 0 (got {value!r})")
        if self.rate is not None and (isinstance(self.rate, bool)
                                      or not isinstance(self.rate, int | float) or self.rate <= 0):
            raise ConfigurationError(f"rate: must be a number > 0 or None (got {self.rate!r})")
        if isinstance(self.max_classes, bool) or not isinstance(self.max_classes, int) \
                or self.max_classes < 1:
            raise ConfigurationError(f"max_classes: must be an integer >= 1 "
                                     f"(got {self.max_classes!r})")

    @property
    def limited(self) -> bool:
        """Any rate limit or quota: dispatch is shaped in time."""
        return bool(self.rate or self.queue_rates or self.tenant_rates)

    @property
    def enabled(self) -> bool:
        return bool(self.fair or self.queue_weights or self.reserved or self.rate
                    or self.queue_rates or self.tenant_rates)

    @classmethod
    def parse(cls, value: object, source: str = "dispatch_policy") -> DispatchPolicy:
        """A policy from itself, a mapping of its fields, or that mapping as JSON."""
        if isinstance(value, DispatchPolicy):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except ValueError as exc:
                raise ConfigurationError(f"{source}: not JSON ({exc})") from None
        if not isinstance(value, Mapping):
            raise ConfigurationError(f"{source}: must be a DispatchPolicy, a mapping of its "
                                     f"fields or that mapping as JSON (got {value!r})")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigurationError(f"{source}: unknown keys {sorted(map(str, unknown))}")
        return cls(**value)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DispatchPolicy:
        """``DUEBOX_DISPATCH_POLICY``: this dataclass's fields as a JSON object."""
        raw = (os.environ if environ is None else environ).get("DUEBOX_DISPATCH_POLICY", "")
        return cls.parse(raw, "DUEBOX_DISPATCH_POLICY")

    @classmethod
    def configured(cls, settings: Any) -> DispatchPolicy:
        """The policy in force: ``settings.dispatch_policy`` if set, else the
        environment's.  Relays and ``sql://`` workers both ask here."""
        value = getattr(settings, "dispatch_policy", None)
        return cls.parse(value) if value is not None else cls.from_env()

    def weight(self, queue: str) -> float:
        return float(self.queue_weights.get(queue, 1.0))

    def tenant_rate(self, tenant: str | None) -> float | None:
        if tenant is not None and tenant in self.tenant_rates:
            return self.tenant_rates[tenant]
        return self.tenant_rates.get("*")

    def limit(self, rate: float) -> Limit:
        return Limit(rate, max(1.0, rate * self.burst_seconds))

    def limits(self, groups: Sequence[Group]) -> dict[str, Limit]:
        """The buckets a batch over these groups must respect, by row name."""
        out: dict[str, Limit] = {}
        if self.rate is not None:
            out["global"] = self.limit(self.rate)
        for queue, tenant in groups:
            if queue in self.queue_rates:
                out[f"queue:{queue}"] = self.limit(self.queue_rates[queue])
            rate = self.tenant_rate(tenant)
            if rate is not None:
                out[f"tenant:{tenant or ''}"] = self.limit(rate)
        return out


def effective_priority(priority: int, due_at: datetime, now: datetime, step: float) -> int:
    """``priority`` plus one for every ``step`` seconds the job has been due."""
    waited = (now - due_at).total_seconds()
    return priority + (math.floor(waited / step) if waited > 0 else 0)


def plan(groups: Sequence[Group], batch: int, policy: DispatchPolicy,
         deficits: dict[Group, float]) -> dict[Group, int]:
    """Each group's slots in a batch of ``batch``: reserved slots first, the
    rest by weight; fractions carry over in ``deficits`` (updated in place)."""
    if not groups or batch <= 0:
        return {}
    tenants: dict[str, int] = {}
    for queue, _ in groups:
        tenants[queue] = tenants.get(queue, 0) + 1
    reserved = {q: min(int(policy.reserved.get(q, 0)), batch) for q in tenants}
    total_reserved = sum(reserved.values())
    scale = min(1.0, batch / total_reserved) if total_reserved else 1.0
    rest = max(0.0, batch - total_reserved * scale)
    weights = {g: policy.weight(g[0]) / tenants[g[0]] for g in groups}
    total_weight = sum(weights.values())
    shares: dict[Group, int] = {}
    for g in groups:
        credit = reserved[g[0]] * scale / tenants[g[0]] + rest * weights[g] / total_weight
        deficits[g] = min(float(batch), deficits.get(g, 0.0) + credit)
        shares[g] = math.floor(deficits[g] + 1e-9)
    # Rounding down can leave slots unassigned: hand them to the largest deficits.
    spare = batch - sum(shares.values())
    for g in sorted(groups, key=lambda g: deficits[g] - shares[g], reverse=True)[:max(0, spare)]:
        shares[g] += 1
    return shares


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

    def refresh_soon(self) -> None:
        """Rediscover classes on the next claim (new jobs were announced)."""
        self._refreshed = -math.inf

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

    @staticmethod
    def _refill(b: Held) -> int:
        return max(1, math.ceil(b.limit.rate * _MIN_REFILL))

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
            rows = candidates(conn, key, horizon=horizon, after=after,
                              limit=allowed + mine, extra=fence)
            pool += [c for c in rows if c.id not in skip]
        step = self.policy.aging_step
        pool.sort(key=lambda c: (-effective_priority(c.priority, c.due_at, now, step), c.due_at))
        got = pool[:allowed]
        for b in limiting:
            b.spent += len(got)
        report.by_group[g] = report.by_group.get(g, 0) + len(got)
        return got
