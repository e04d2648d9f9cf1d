"""What the relay counts: each pass's figures, the running totals, and the
Prometheus metrics they feed (docs/observability.md).  The relay's own
steps and each of its pipelines count apart, each under its backend label;
the relay's totals are their sum."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from duebox.leases.records import JobRecord
from duebox.metrics import DBCollector, Metrics, observe_many, seconds
from duebox.processes.heartbeat import ProcessRow, prune

if TYPE_CHECKING:
    from duebox.app import Duebox


@dataclass
class PassStats:
    claimed: int = 0
    published: int = 0
    marked: int = 0
    lost_marks: int = 0
    held: int = 0
    expired: int = 0
    failed: int = 0
    recovered: int = 0
    reconciled: int = 0
    occurrences: int = 0  # schedule occurrences generated
    caught_up: int = 0  # overdue jobs claimed by the rate-limited catch-up claim
    fenced: int = 0  # claimed jobs dropped unpublished: their shard lease was lost
    rerouted: int = 0  # enqueued jobs moved off a broker that no longer serves their queue

    def add(self, other: PassStats) -> None:
        """Count ``other``'s figures in too (a pipeline's pass into its relay's)."""
        for name in PassStats.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class RelayTotals(PassStats):
    passes: int = 0
    errors: int = 0

    @classmethod
    def sum(cls, parts: Iterable[RelayTotals]) -> RelayTotals:
        total = cls()
        for part in parts:
            total.add(part)
            total.passes += part.passes
            total.errors += part.errors
        return total


class RelayMetrics:
    """The relay's event metrics, labelled by backend (and queue)."""

    def __init__(self, metrics: Metrics, backend: str) -> None:
        self.backend = backend
        self.totals = RelayTotals()
        self.use(metrics)

    def use(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._by_queue: dict[str, tuple[Any, Any, Any]] = {}
        self._dispatch_lag = metrics.dispatch_lag.labels(self.backend)

    def _queue(self, queue: str) -> tuple[Any, Any, Any]:
        """The per-queue metric children (claimed, scheduling lag, published):
        ``labels()`` per job cost more than the rest of the bookkeeping."""
        found = self._by_queue.get(queue)
        if found is None:
            m, b = self.metrics, self.backend
            found = self._by_queue[queue] = (m.claimed.labels(b, queue),
                                             m.scheduling_lag.labels(b, queue),
                                             m.published.labels(b, queue))
        return found

    def claimed(self, records: Iterable[JobRecord], now: datetime) -> None:
        """A fresh claim: per queue, how many and how late (claim - due, 0
        when claimed ahead)."""
        lags: dict[str, list[float]] = {}
        for rec in records:
            lags.setdefault(rec.queue, []).append(seconds(now, rec.due_at))
        for queue, late in lags.items():
            claimed, lag, _ = self._queue(queue)
            claimed.inc(len(late))
            observe_many(lag, late)

    def published(self, records: Iterable[JobRecord], ok: set[object], now: datetime,
                  claimed_at: datetime | None, lead: float) -> None:
        """Dispatch lag: publish minus the moment the job could be published
        (its claim, or its release time when it was held ``lead`` before due)."""
        ahead = timedelta(seconds=lead)
        counts: dict[str, int] = {}
        lags = []
        for rec in records:
            if rec.id in ok:
                # Released by the timer: its release time; published ahead
                # (the broker delays it) or overdue: the claim.
                ready = rec.due_at - ahead
                if now < ready or (claimed_at is not None and claimed_at > ready):
                    ready = claimed_at or now
                counts[rec.queue] = counts.get(rec.queue, 0) + 1
                lags.append(seconds(now, ready))
        observe_many(self._dispatch_lag, lags)
        for queue, n in counts.items():
            self._queue(queue)[2].inc(n)

    def recovered(self, kinds: dict[str, int]) -> None:
        for kind, n in kinds.items():
            if n:
                self.metrics.recovered.labels(kind).inc(n)

    def add(self, stats: PassStats, a_pass: bool = True) -> None:
        """A pass (or a timer's publish, ``a_pass=False``) into the counters
        and totals."""
        m, b = self.metrics, self.backend
        if a_pass:
            m.relay_passes.labels(b).inc()
        for counter, n in ((m.marked, stats.marked), (m.lost_marks, stats.lost_marks),
                           (m.expired, stats.expired), (m.publish_failed, stats.failed),
                           (m.reconciled, stats.reconciled)):
            if n:
                counter.labels(b).inc(n)
        self.totals.passes += a_pass
        self.totals.add(stats)

    def error(self) -> None:
        """A pass that failed (retried with backoff)."""
        self.totals.errors += 1
        self.metrics.relay_errors.labels(self.backend).inc()


def figures(backend: str, totals: RelayTotals) -> dict[str, object]:
    """A relay's (or one pipeline's) figures in its registry row."""
    return {"backend": backend, "passes": totals.passes, "claimed": totals.claimed,
            "published": totals.published, "errors": totals.errors}


def collect(app: Duebox, collector: DBCollector,
            workers: Callable[[Iterable[ProcessRow], float], None]) -> None:
    """The database snapshot behind the state gauges, what workers report
    (``workers``: for backpressure), and pruning of expired registry rows
    (run by the relay's heartbeat task)."""
    now = app.clock.now()
    snap = collector.collect(app.engine, now)
    workers(snap.processes, collector.interval)
    if snap.expired_processes:
        with app.engine.begin() as conn:
            prune(conn, now=now, names=snap.expired_processes)


__all__ = ["PassStats", "RelayMetrics", "RelayTotals", "collect", "figures"]
