"""How claims are composed, by the relay and by ``sql://`` workers alike
(docs/scale.md): the :class:`DispatchPolicy` (``Settings.dispatch_policy`` /
``DUEBOX_DISPATCH_POLICY``), each group's share of a batch (:func:`plan`) and
aging (:func:`effective_priority`).  core/fairness/claim.py applies it.

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
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..errors import ConfigurationError
from .buckets import Limit

Group = tuple[str, str | None]  # (queue, tenant)


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


__all__ = ["DispatchPolicy", "Group", "effective_priority", "plan"]
