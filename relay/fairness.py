"""Fair dispatch: what share of each claim batch every class of jobs gets.

Classes are ``(queue, tenant)`` groups; within a group, jobs of several
priorities compete by *effective* priority (see :func:`effective_priority`).

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
* **Quotas and rate limits** — token buckets shared by every relay
  (relay/ratelimit.py): global, per queue and per tenant (``"*"``: each
  tenant not listed); a class never gets more than its buckets hold, however
  high its priority.
* **Aging** — within a group, candidates are the earliest-due jobs of each
  priority; the batch takes the highest ``priority + floor(waited /
  aging_step)``, so a low-priority job overtakes fresher high-priority work
  after ``(difference in priority) × aging_step`` seconds of waiting: its
  worst-case wait is bounded.

Every read is bounded and index-backed (core/fair_claim.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection

from duebox import fair_claim, jobstore
from duebox.errors import ConfigurationError
from duebox.fair_claim import Candidate, ClassKey

from . import ratelimit
from .ratelimit import Held, Limit

Group = tuple[str, str | None]  # (queue, tenant)

# A rate-limited relay wakes when its bucket holds this many seconds' worth
# of tokens: small enough to keep the rate smooth, large enough to batch.
_MIN_REFILL = 0.05


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
    """How the relay composes its claim batches (docs/scale.md).

    ``fair``: claim class by class (implied by any other setting here);
    ``queue_weights`` / ``reserved``: per queue; ``aging_step``: seconds of
    waiting worth one priority step; ``rate``, ``queue_rates``,
    ``tenant_rates``: jobs per second shared by all relays (``"*"`` in
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
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DispatchPolicy:
        """``DUEBOX_DISPATCH_POLICY``: this dataclass's fields as a JSON object."""
        raw = (os.environ if environ is None else environ).get("DUEBOX_DISPATCH_POLICY", "")
        if not raw:
            return cls()
        try:
            values = json.loads(raw)
        except ValueError as exc:
            raise ConfigurationError(f"DUEBOX_DISPATCH_POLICY: not JSON ({exc})") from None
        if not isinstance(values, dict):
            raise ConfigurationError("DUEBOX_DISPATCH_POLICY: must be a JSON object")
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigurationError(f"DUEBOX_DISPATCH_POLICY: unknown keys {sorted(unknown)}")
        return cls(**values)

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
    """What the last fair claim did (metrics and the relay's sleep)."""

    by_group: dict[Group, int] = field(default_factory=dict)
    throttled: set[str] = field(default_factory=set)  # bucket names that ran dry
    wait: float = 0.0  # seconds until a dry bucket has tokens again


class FairClaim:
    """The relay's claim when a :class:`DispatchPolicy` is enabled."""

    def __init__(self, policy: DispatchPolicy) -> None:
        self.policy = policy
        self.deficits: dict[Group, float] = {}
        self._keys: list[ClassKey] = []
        self._refreshed = -math.inf
        self.last = BatchReport()

    def _classes(self, conn: Connection) -> dict[Group, list[ClassKey]]:
        if time.monotonic() - self._refreshed >= self.policy.class_refresh:
            self._keys = [k for k, _ in fair_claim.classes(conn, cap=self.policy.max_classes)]
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

    def claim(
        self, conn: Connection, *, owner: str, horizon: datetime, after: datetime | None,
        now: datetime, lease_until: datetime, limit: int,
        fence: ColumnElement[bool] | None = None,
    ) -> list[jobstore.JobRecord]:
        groups = self._classes(conn)
        report = BatchReport()
        self.last = report
        if not groups:
            return []
        buckets = ratelimit.lock(conn, self.policy.limits(list(groups)), now)
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
        ratelimit.spend(conn, buckets.values(), now)
        dry = [buckets[n] for n in report.throttled]
        if dry:
            report.wait = min(ratelimit.seconds_until([b], self._refill(b)) for b in dry)
        records = jobstore.claim_selected(conn, [c.id for c in chosen], owner=owner, now=now,
                                          lease_until=lease_until, fence=fence)
        records.sort(key=lambda r: (r.due_at, r.id))
        return records

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
            rows = fair_claim.candidates(conn, key, horizon=horizon, after=after,
                                         limit=allowed + mine, extra=fence)
            pool += [c for c in rows if c.id not in skip]
        step = self.policy.aging_step
        pool.sort(key=lambda c: (-effective_priority(c.priority, c.due_at, now, step), c.due_at))
        got = pool[:allowed]
        for b in limiting:
            b.spent += len(got)
        report.by_group[g] = report.by_group.get(g, 0) + len(got)
        return got
