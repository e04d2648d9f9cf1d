"""Prometheus metrics for the relay and the worker (docs/observability.md).

Two kinds of numbers:

* **Events** — counters and histograms the relay and the worker record as
  they work, from timestamps they already hold (no query per job).
* **State** — gauges read from the database by :func:`read_snapshot`: a few
  bounded, index-backed queries the relay runs every few seconds
  (:class:`DBCollector`), never per scrape.  A scrape reads the last snapshot.

Every :class:`Metrics` has its own :class:`~prometheus_client.CollectorRegistry`
so several relays and workers in one process (the tests) never collide; a
process serves one with :func:`serve`.  :func:`process_metrics` is the one the
``duebox relay`` / ``duebox worker`` commands use.

Under ``duebox worker --processes N`` each worker process keeps its numbers in
prometheus-client's multiprocess files and the supervisor serves their sums
(cli/metrics_dir.py).  Counters and histograms add up; each gauge says how
its values combine (``multiprocess_mode``), ``live*`` so that a process that
exited leaves the gauge.  The database snapshot's gauges come from a
collector of the relay's own, which a worker does not fill: not in the sums.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Connection, case, func, select

from .db import SQLITE_DEFERRED
from .leases import claims
from .processes.heartbeat import ProcessRow, alive, expired_names
from .states import JobState
from .tables import job

# Lags and latencies of delayed jobs: milliseconds (a healthy start) to hours
# (a backlog after an outage).
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
               300.0, 900.0, 3600.0, float("inf"))
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 300.0, float("inf"))

IN_FLIGHT_STATES = (JobState.DISPATCHING, JobState.ENQUEUED, JobState.RUNNING)


class Metrics:
    """The event metrics and the last database snapshot, on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry

        def counter(name: str, doc: str, labels: Sequence[str]) -> Counter:
            return Counter(name, doc, list(labels), registry=r)

        def histogram(name: str, doc: str, labels: Sequence[str],
                      buckets: Sequence[float] = LAG_BUCKETS) -> Histogram:
            return Histogram(name, doc, list(labels), registry=r, buckets=buckets)

        b = ("backend",)
        bq = ("backend", "queue")
        # --- relay ---------------------------------------------------------------
        self.relay_passes = counter("duebox_relay_passes_total", "Relay passes run.", b)
        self.relay_errors = counter(
            "duebox_relay_errors_total", "Relay passes that failed (database or broker).", b)
        self.claimed = counter("duebox_relay_jobs_claimed_total",
                               "Jobs claimed by a relay (SCHEDULED -> DISPATCHING).", bq)
        self.published = counter("duebox_relay_jobs_published_total",
                                 "Jobs the broker accepted.", bq)
        self.publish_failed = counter("duebox_relay_publish_failures_total",
                                      "Jobs the broker refused; released back to SCHEDULED.", b)
        self.marked = counter("duebox_relay_jobs_marked_total",
                              "Published jobs marked ENQUEUED.", b)
        self.lost_marks = counter(
            "duebox_relay_lost_marks_total",
            "Published jobs whose ENQUEUED mark matched no row: the claim's lease was lost "
            "and the publish was a duplicate consumers drop.", b)
        self.recovered = counter(
            "duebox_relay_jobs_recovered_total",
            "Expired leases recovered, by kind: dispatching, running (worker lost), dead "
            "(worker lost on the last attempt), enqueued (message never consumed).", ("kind",))
        self.expired = counter("duebox_relay_jobs_expired_total",
                               "Jobs expired by the relay (past expires_at or max lateness).", b)
        self.reconciled = counter("duebox_relay_jobs_reconciled_total",
                                  "ENQUEUED jobs the broker had lost, published again.", b)
        self.scheduling_lag = histogram(
            "duebox_scheduling_lag_seconds",
            "Claim time minus due time (0 for jobs claimed ahead of due to ride the "
            "broker's native delay).", bq)
        self.dispatch_lag = histogram(
            "duebox_dispatch_lag_seconds",
            "Publish time minus the moment the job could be published (its claim, or its "
            "release from the relay's hold heap).", b)
        # --- relay at scale (docs/scale.md) ----------------------------------------
        self.shards_owned = Gauge("duebox_relay_shards_owned",
                                  "Shards this relay holds a lease on (sharding on).",
                                  ["relay"], registry=r, multiprocess_mode="livesum")
        self.shard_generation = Gauge(
            "duebox_relay_shard_generation",
            "The lease generation of each shard this relay holds (absent: not held).",
            ["relay", "shard"], registry=r, multiprocess_mode="livemax")
        self.shards_lost = counter(
            "duebox_relay_shards_lost_total",
            "Shard leases this relay found taken over (it paused or fell behind).", ("relay",))
        self.fenced = counter(
            "duebox_relay_jobs_fenced_total",
            "Claimed jobs dropped unpublished because their shard lease was lost.", b)
        self.rate_limited = Gauge(
            "duebox_relay_rate_limited_buckets",
            "Token buckets (global, queue, tenant) that ran dry in the relay's last claim.",
            ["kind"], registry=r, multiprocess_mode="livemax")
        self.rate_wait = Gauge(
            "duebox_relay_rate_wait_seconds",
            "How long the relay waits for tokens before its next claim (0: not limited).",
            registry=r, multiprocess_mode="livemax")
        self.backpressure = Gauge(
            "duebox_relay_backpressure_factor",
            "Share of the configured dispatch rate the relay currently allows itself "
            "(1: no overload signalled; lower after broker throttling).", registry=r,
            multiprocess_mode="livemin")
        # --- worker --------------------------------------------------------------
        self.received = counter("duebox_worker_deliveries_total",
                                "Deliveries a worker received.", b)
        self.succeeded = counter("duebox_jobs_succeeded_total", "Jobs completed.", bq)
        self.failed = counter("duebox_jobs_failed_total",
                              "Failed attempts, by failure class.", (*bq, "failure_class"))
        self.retried = counter("duebox_jobs_retried_total",
                               "Failed attempts scheduled for a retry.", bq)
        self.dead = counter("duebox_jobs_dead_total",
                            "Jobs dead-lettered (DLQ ingress), by failure class.",
                            (*bq, "failure_class"))
        self.discarded = counter(
            "duebox_jobs_discarded_total",
            "Deliveries discarded without running, by reason (stale_version, cancelled, "
            "already_succeeded, unknown_job, undecodable, expired, ...).", (*b, "reason"))
        self.duplicates = counter(
            "duebox_jobs_duplicates_total",
            "Duplicate deliveries dropped, by reason (the version check's reason, or "
            "'dedupe' when the dedupe store had the id).", (*b, "reason"))
        self.lease_lost = counter(
            "duebox_jobs_lease_lost_total",
            "Executions whose lease was lost before completion (their writes rolled back).", bq)
        self.deferred = counter("duebox_worker_deferred_total",
                                "Deliveries handed back because they arrived early.", b)
        self.group_size = histogram(
            "duebox_worker_group_size",
            "Jobs per group-commit transaction (a backlog of short jobs run together; "
            "a job run alone is not counted).", b, (2, 4, 8, 16, 32, 64, 128, 256, 1000))
        self.queue_wait = histogram(
            "duebox_queue_wait_seconds",
            "Start minus the moment the message became available: max(published, due).", bq)
        self.start_lateness = histogram(
            "duebox_start_lateness_seconds", "Start time minus due time.", bq)
        self.execution = histogram(
            "duebox_execution_duration_seconds", "Handler run and completion, by outcome.",
            (*bq, "outcome"), DURATION_BUCKETS)
        self.end_to_end = histogram(
            "duebox_end_to_end_latency_seconds", "Completion (SUCCEEDED) minus due time.", bq)
        # --- state, read from the database ---------------------------------------
        self.snapshot_collector = SnapshotCollector()
        r.register(self.snapshot_collector)

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample's value (0.0 when absent): for tests and scripts."""
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


_process_metrics: Metrics | None = None
_process_lock = threading.Lock()


def process_metrics() -> Metrics:
    """This process's default :class:`Metrics` (created on first use)."""
    global _process_metrics
    with _process_lock:
        if _process_metrics is None:
            _process_metrics = Metrics()
        return _process_metrics


def serve(metrics: Metrics | CollectorRegistry, port: int, host: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` (of a :class:`Metrics`, or of any registry) over
    HTTP on a daemon thread; returns the server (``server.server_port`` is
    the port when ``port`` was 0; ``server.shutdown()`` stops it)."""
    registry = metrics.registry if isinstance(metrics, Metrics) else metrics
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server


def seconds(later: datetime, earlier: datetime) -> float:
    """``later - earlier`` in seconds, never negative."""
    return max(0.0, (later - earlier).total_seconds())


def observe_many(child: Any, amounts: Sequence[float]) -> None:
    """``child.observe(a)`` for each of ``amounts`` (a histogram child), with
    one increment per bucket hit and one of the sum: a relay observes two
    lags per job, and ``observe()`` takes two locks and walks the bucket
    bounds for each.  A histogram whose insides are not prometheus_client's
    usual ones is observed one amount at a time."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if not amounts:
        return
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for amount in amounts:
            child.observe(amount)
        return
    hits: dict[int, int] = {}
    for amount in amounts:
        if amount != amount:  # NaN: in no bucket, as observe() does
            continue
        # observe() counts an amount in the first bucket whose bound is >= it.
        i = bisect.bisect_left(bounds, amount)
        hits[i] = hits.get(i, 0) + 1
    total.inc(sum(amounts))
    for i, n in hits.items():
        if i < len(buckets):  # +Inf is the last bound: nothing lies beyond it
            buckets[i].inc(n)


# --- state from the database ----------------------------------------------------

# Counts above this many rows per category are reported as this many (and the
# snapshot says so): every query stays bounded on a huge backlog.
DEFAULT_COUNT_CAP = 100_000


@dataclass
class Group:
    """Numbers for one queue or one tenant."""

    due_backlog: int = 0
    oldest_due_at: datetime | None = None
    overdue: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)
    dlq: int = 0
    oldest_dlq_at: datetime | None = None

    def add_due(self, n: int, oldest: datetime | None, overdue: int) -> None:
        self.due_backlog += n
        self.overdue += overdue
        if oldest is not None and (self.oldest_due_at is None or oldest < self.oldest_due_at):
            self.oldest_due_at = oldest

    def add_dead(self, n: int, oldest: datetime | None) -> None:
        self.dlq += n
        if oldest is not None and (self.oldest_dlq_at is None or oldest < self.oldest_dlq_at):
            self.oldest_dlq_at = oldest


@dataclass
class Snapshot:
    at: datetime
    queues: dict[str, Group]
    tenants: dict[str, Group]
    processes: list[ProcessRow]
    capped: bool
    duration: float = 0.0
    expired_processes: list[str] = field(default_factory=list)  # registry rows to prune

    def oldest_due_age(self) -> float:
        oldest = [g.oldest_due_at for g in self.queues.values() if g.oldest_due_at]
        return seconds(self.at, min(oldest)) if oldest else 0.0


def _tenant_key(tenant: str | None) -> str:
    return tenant if tenant is not None else ""


def read_snapshot(
    conn: Connection, now: datetime, *, overdue_after: float = 60.0,
    cap: int = DEFAULT_COUNT_CAP, top_tenants: int = 20,
) -> Snapshot:
    """Backlog, in-flight and DLQ per queue and per tenant, and the live
    processes: three capped scans of the ``(state, due_at)`` index and one
    read of the (small) process registry."""
    queues: dict[str, Group] = {}
    tenants: dict[str, Group] = {}
    capped = False

    def both(queue: str, tenant: str | None) -> tuple[Group, Group]:
        return (queues.setdefault(queue, Group()),
                tenants.setdefault(_tenant_key(tenant), Group()))

    due = (select(job.c.queue, job.c.tenant, job.c.due_at)
           .where(claims.due(now))
           .order_by(job.c.due_at).limit(cap).subquery())
    late = now - timedelta(seconds=overdue_after)
    rows = conn.execute(
        select(due.c.queue, due.c.tenant, func.count(), func.min(due.c.due_at),
               func.sum(case((due.c.due_at <= late, 1), else_=0)))
        .group_by(due.c.queue, due.c.tenant)).all()
    capped |= sum(int(r[2]) for r in rows) >= cap
    for queue, tenant, n, oldest, overdue in rows:
        for g in both(queue, tenant):
            g.add_due(int(n), oldest, int(overdue or 0))

    flying = (select(job.c.queue, job.c.tenant, job.c.state)
              .where(job.c.state.in_(list(IN_FLIGHT_STATES))).limit(cap).subquery())
    rows = conn.execute(
        select(flying.c.queue, flying.c.tenant, flying.c.state, func.count())
        .group_by(flying.c.queue, flying.c.tenant, flying.c.state)).all()
    capped |= sum(int(r[3]) for r in rows) >= cap
    for queue, tenant, state, n in rows:
        for g in both(queue, tenant):
            g.in_flight[str(state)] = g.in_flight.get(str(state), 0) + int(n)

    dead = (select(job.c.queue, job.c.tenant, job.c.finished_at)
            .where(job.c.state == JobState.DEAD).order_by(job.c.due_at).limit(cap).subquery())
    rows = conn.execute(
        select(dead.c.queue, dead.c.tenant, func.count(), func.min(dead.c.finished_at))
        .group_by(dead.c.queue, dead.c.tenant)).all()
    capped |= sum(int(r[2]) for r in rows) >= cap
    for queue, tenant, n, oldest in rows:
        for g in both(queue, tenant):
            g.add_dead(int(n), oldest)

    if len(tenants) > top_tenants:
        ranked = sorted(tenants.items(), key=lambda kv: (-kv[1].due_backlog,
                                                         -sum(kv[1].in_flight.values()), kv[0]))
        tenants = dict(ranked[:top_tenants])
    return Snapshot(now, queues, tenants, alive(conn, now), capped,
                    expired_processes=expired_names(conn, now=now))


class SnapshotCollector(Collector):
    """Serves the last :class:`Snapshot` as gauges (nothing until the first)."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self.last_success: float | None = None

    def update(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot  # one reference swap: a scrape sees old or new
        self.last_success = time.time()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.snapshot
        if snap is None:
            return
        fams = {
            "backlog": GaugeMetricFamily(
                "duebox_due_backlog_jobs", "SCHEDULED jobs whose due time has passed.",
                labels=["queue"]),
            "oldest": GaugeMetricFamily(
                "duebox_oldest_due_age_seconds",
                "Age of the oldest due SCHEDULED job (0 when none).", labels=["queue"]),
            "overdue": GaugeMetricFamily(
                "duebox_overdue_jobs",
                "Due SCHEDULED jobs whose due time passed more than overdue_after ago.",
                labels=["queue"]),
            "flight": GaugeMetricFamily(
                "duebox_in_flight_jobs", "Jobs DISPATCHING, ENQUEUED or RUNNING.",
                labels=["queue", "state"]),
            "dlq": GaugeMetricFamily("duebox_dlq_jobs", "DEAD jobs (the DLQ).",
                                     labels=["queue"]),
            "dlq_age": GaugeMetricFamily(
                "duebox_dlq_oldest_age_seconds", "Age of the oldest DEAD job (0 when none).",
                labels=["queue"]),
            "tenant": GaugeMetricFamily(
                "duebox_tenant_due_backlog_jobs",
                "Due backlog per tenant (top tenants only; '' is no tenant).",
                labels=["tenant"]),
            "tenant_flight": GaugeMetricFamily(
                "duebox_tenant_in_flight_jobs", "In-flight jobs per tenant (top tenants only).",
                labels=["tenant"]),
        }
        for q, g in sorted(snap.queues.items()):
            fams["backlog"].add_metric([q], g.due_backlog)
            fams["oldest"].add_metric(
                [q], seconds(snap.at, g.oldest_due_at) if g.oldest_due_at else 0.0)
            fams["overdue"].add_metric([q], g.overdue)
            for state in IN_FLIGHT_STATES:
                fams["flight"].add_metric([q, str(state)], g.in_flight.get(state, 0))
            fams["dlq"].add_metric([q], g.dlq)
            fams["dlq_age"].add_metric(
                [q], seconds(snap.at, g.oldest_dlq_at) if g.oldest_dlq_at else 0.0)
        for t, g in sorted(snap.tenants.items()):
            fams["tenant"].add_metric([t], g.due_backlog)
            fams["tenant_flight"].add_metric([t], sum(g.in_flight.values()))
        yield from fams.values()
        yield GaugeMetricFamily(
            "duebox_outbox_publication_lag_seconds",
            "Age of the oldest due job not yet handed on (= max of "
            "duebox_oldest_due_age_seconds): a stuck relay shows here first.",
            value=snap.oldest_due_age())
        live = GaugeMetricFamily("duebox_live_processes",
                                 "Relays and workers with an unexpired heartbeat row.",
                                 labels=["role"])
        age = GaugeMetricFamily("duebox_heartbeat_age_seconds_max",
                                "Oldest heartbeat among the live processes of a role.",
                                labels=["role"])
        for role in ("relay", "worker"):
            rows = [p for p in snap.processes if p.role == role]
            live.add_metric([role], len(rows))
            ages = [seconds(snap.at, p.heartbeat_at) for p in rows if p.heartbeat_at]
            age.add_metric([role], max(ages) if ages else 0.0)
        yield live
        yield age
        yield GaugeMetricFamily("duebox_state_counts_capped",
                                "1 when a count reached the cap and is a lower bound.",
                                value=1.0 if snap.capped else 0.0)
        yield GaugeMetricFamily("duebox_state_collect_duration_seconds",
                                "How long the last database snapshot took.",
                                value=snap.duration)
        if self.last_success is not None:
            yield GaugeMetricFamily("duebox_state_collect_timestamp_seconds",
                                    "Unix time of the last successful snapshot.",
                                    value=self.last_success)


class DBCollector:
    """Reads a :class:`Snapshot` at most every ``interval`` seconds (the relay
    calls :meth:`maybe_collect` once per pass, in a thread)."""

    def __init__(self, metrics: Metrics, *, interval: float = 5.0,
                 overdue_after: float = 60.0, cap: int = DEFAULT_COUNT_CAP) -> None:
        self.metrics = metrics
        self.interval = interval
        self.overdue_after = overdue_after
        self.cap = cap
        self._last = -float("inf")

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval

    def collect(self, engine: Any, now: datetime) -> Snapshot:
        self._last = time.monotonic()
        started = time.perf_counter()
        # A plain read: on SQLite it must not take the write lock.
        with engine.connect().execution_options(**{SQLITE_DEFERRED: True}) as conn:
            snap = read_snapshot(conn, now, overdue_after=self.overdue_after, cap=self.cap)
        snap.duration = time.perf_counter() - started
        self.metrics.snapshot_collector.update(snap)
        return snap


__all__ = [
    "DBCollector",
    "Group",
    "Metrics",
    "Snapshot",
    "SnapshotCollector",
    "observe_many",
    "process_metrics",
    "read_snapshot",
    "seconds",
    "serve",
]
