"""The relay loop.

Each pass:

0. **Generate** due schedule occurrences (relay/schedules.py) and, after an
   outage, release **overdue** jobs first: rate-limited, highest priority
   first, too-late ones expired (relay/catchup.py).
1. **Claim** a bounded batch in a short transaction: ``SCHEDULED`` jobs due by
   ``now + max_delay (+ hold window)`` (the claim window: relay/horizon.py;
   the claim: core/claims.py) become ``DISPATCHING``, leased to a per-claim
   owner token.  The same predicate parks jobs beyond the broker's ceiling
   and picks them up as they come near.
2. **Publish** outside any transaction with delay = ``due_at - now`` clipped to
   ``[0, max_delay]`` and rounded *up* to the broker's precision.  Jobs the
   broker cannot delay long enough (Kafka: not at all) are held in a heap,
   still leased in the database, and published at ``due_at - max_delay``.
3. **Mark** ``ENQUEUED`` with a fenced update; a mark that matches nothing
   means the lease was lost and the publish was a duplicate consumers drop.
4. **Recover** expired leases (plus a clock-skew margin) back to ``SCHEDULED``;
   **reconcile** with brokers that can tell which ``ENQUEUED`` jobs they lost
   (Redis restarted empty): those go back to ``SCHEDULED`` and are published
   again, at once when the broker reports data loss, else on a slow sweep.
5. **Sleep** until the earliest due time, a held job's release, the next
   recovery or the poll interval — woken early by ``NOTIFY`` on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from duebox import claims, dispatched, jobstore, reroute, routes, tracing
from duebox.brokers.base import Broker, Outgoing, PublishingBroker, open_broker
from duebox.credentials import redacted
from duebox.db import PgWaker, db_errors, parse_database_url
from duebox.dispatch_policy import DispatchPolicy
from duebox.errors import ConfigurationError, DatabaseError, DueboxError
from duebox.heartbeat import ProcessHeartbeat
from duebox.ids import process_token
from duebox.logs import CollapsedLog, kind_of
from duebox.metrics import DBCollector, Metrics, process_metrics
from duebox.planner_stats import PlannerStats
from duebox.timing import NEAR_WINDOW_SECONDS
from duebox.waiting import wait_any

from .catchup import CatchUp
from .held import HeldJobs
from .horizon import Horizon
from .reconcile import Reconciler
from .recovering import LeaseRecovery
from .refusals import Refusals
from .rerouting import Rerouting
from .routes import RelayLanes
from .scale import ScaleControls
from .schedules import ScheduleStep
from .shards import ShardConfig
from .stats import PassStats, RelayMetrics, RelayTotals, collect

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from duebox.app import Duebox

log = logging.getLogger("duebox.relay")

class Relay:
    """Moves due jobs from the database to the broker.  Run as many as you like:
    ``SKIP LOCKED`` partitions the rows between them."""

    def __init__(
        self,
        app: Duebox,
        *,
        broker: Broker | None = None,
        batch_size: int | None = None,
        name: str | None = None,
        hold_window: float | None = None,
        recover_interval: float = 1.0,
        reconcile_interval: float = 300.0,
        metrics: Metrics | None = None,
        heartbeat_interval: float = 5.0,
        collect_interval: float = 5.0,
        near_window: float = NEAR_WINDOW_SECONDS,
        lead: float | None = None,
        policy: DispatchPolicy | None = None,
        shards: ShardConfig | None = None,
        route: routes.Route | None = None,
    ) -> None:
        self.app = app
        self.name = name or process_token("relay")
        self._claims = itertools.count()
        # A lane: this relay publishes one route's queues for the relay that
        # made it, which keeps the process's own steps (relay/routes.py).
        self.route = route
        self.lanes: RelayLanes | None = None
        # A relay given its broker serves what it was given, not the app's
        # routes: it moves no job between routes (self.rerouting).
        follows_routes = broker is None and route is None
        if follows_routes and app.routes.active:
            if shards is not None or ShardConfig.from_env() is not None:
                raise ConfigurationError(
                    "shards: a relay with broker_routes is not sharded (yet); run one relay "
                    "per route's shards with broker= instead, or unset DUEBOX_SHARDS")

            def lane(route: routes.Route, broker: Broker) -> Relay:
                made = Relay(app, broker=broker, name=self.name, route=route,
                             batch_size=batch_size, hold_window=hold_window,
                             reconcile_interval=reconcile_interval, metrics=metrics,
                             near_window=near_window, lead=lead, policy=policy)
                made._claims = self._claims  # claim owners stay unique in the process
                return made

            self.lanes = RelayLanes(app, self.name, lane)
            broker = self.lanes.broker
        self.broker = broker or app.broker(self.name)
        self.batch_size = batch_size or app.settings.batch_size
        # Absent where workers claim rows from the job table (sql://): then
        # the relay publishes nothing; it recovers, takes over and generates.
        self.publisher = self.broker if isinstance(self.broker, PublishingBroker) else None
        # Every mark records the route (core/reroute.py): a queue moved to
        # another broker later has its jobs moved with it (self.rerouting).
        self.published_to = reroute.route_key(self.broker.url)
        self.rerouting = Rerouting(app, self.batch_size, active=follows_routes)
        caps = self.broker.capabilities
        max_delay = self.broker.max_delay
        # How far ahead of the broker's ceiling to claim and hold in memory.
        if hold_window is None:
            hold_window = app.settings.poll_interval + 1.0 if max_delay == 0 else 0.0
        self.hold_window = hold_window
        holds = caps.publish_lead is not None
        self.near_window = max(near_window, hold_window) if holds else hold_window
        self.lead = (caps.publish_lead or 0.0) if lead is None else lead
        # The precise timer runs only inside run(); a bare run_pass() hands
        # every job to the broker's own delay (Kafka's still waits in _held).
        self._timer: asyncio.Task[None] | None = None
        self.max_delay = max_delay
        self._held = HeldJobs(lead=self.lead, max_delay=max_delay,
                              precision=caps.delay_precision)
        # One publish at a time, in the order they were decided: the timer's
        # releases and a pass's batches would otherwise interleave, and a
        # relay publishes the jobs of one ordering key in due-time order
        # (Capabilities.ordering).  asyncio.Lock wakes its waiters in order.
        self._publishing = asyncio.Lock()
        self.schedules = ScheduleStep(app, self.batch_size, process=self.name)
        self.catchup = CatchUp(app, self.batch_size)
        # Operating at scale (docs/scale.md): fair, rate-limited claims and
        # fenced shard ownership; both off unless configured.
        if shards is not None and self.publisher is None:
            raise ConfigurationError(
                f"shards: sharding fences a relay's claim for a broker; on {caps.name}:// "
                "workers claim rows from the job table themselves and are not sharded "
                "(SKIP LOCKED partitions the rows between them): pass no shards")
        self.scale = ScaleControls(app, self.name, policy, shards,
                                   route=route.where() if route is not None else None)
        self.horizon = Horizon(max_delay=max_delay, hold_window=hold_window,
                               lease_seconds=app.settings.lease_seconds, catchup=self.catchup,
                               scale=self.scale)
        self.reconciler = Reconciler(app, self.broker, self.batch_size, reconcile_interval,
                                     active=self.publisher is not None,
                                     covers=route.covers if route is not None else None)
        # Observability (docs/observability.md): event metrics, the periodic
        # database snapshot and this relay's registry row.
        self.backend = caps.name
        self.observe = RelayMetrics(metrics or process_metrics(), self.backend)
        # Batches the broker confirmed, not yet marked ENQUEUED: (claim owner,
        # ids); the next claim's transaction marks them (see _pipeline).
        self._unmarked: list[tuple[str, list[uuid.UUID]]] = []
        # Queues your own consumer reads: their marks say DELIVERED
        # (core/own_queues.py, docs/own-consumers.md).
        self._delivered = app.settings.own_queues
        self.collector = DBCollector(self.metrics, interval=collect_interval)
        snapshot = functools.partial(collect, app, self.collector, self.scale)
        self._log = CollapsedLog(log)
        self.refusals = Refusals(app, self.name, self._log)
        self.heartbeat = ProcessHeartbeat(
            app.engine, app.clock, role="relay", name=self.name, interval=heartbeat_interval,
            info=self._info, tick=snapshot, tick_interval=collect_interval)
        self.recovery = LeaseRecovery(app, self.broker, self.batch_size, self.name,
                                      recover_interval)
        # PostgreSQL: the job table's planner statistics kept fresh through a
        # burst (core/planner_stats.py).
        self.planner_stats = PlannerStats(app.engine)

    def _info(self) -> dict[str, object]:
        """This relay's registry row: its figures (with its lanes'), and the
        routes it follows (relay/rerouting.py)."""
        info = (self.observe.info() if self.lanes is None
                else self.lanes.info(self.observe.info))
        if self.rerouting.active:
            info["routing"] = self.rerouting.fingerprint
        return info

    @property
    def metrics(self) -> Metrics:
        return self.observe.metrics

    @metrics.setter
    def metrics(self, metrics: Metrics) -> None:
        self.observe.use(metrics)

    @property
    def totals(self) -> RelayTotals:
        return self.observe.totals

    # --- one pass ------------------------------------------------------------

    async def run_pass(self) -> PassStats:
        stats = PassStats()
        if self._held:  # held jobs now due go first: the rest of the pass takes time
            await self._release_held(stats)
        if self.route is None:  # a lane leaves the process's steps to its relay
            await self._own_steps(stats)
        if self.publisher is not None:
            stats.reconciled = await self.reconciler.step()
            if self.scale.shards is not None:
                await asyncio.to_thread(self.scale.step_shards, self._held.ids())
            if self.scale.fair is None:  # fair mode: overdue jobs are in the fair claim
                await self._catch_up(stats)
            await self._pipeline(stats)
            await self._release_held(stats)
            self.scale.observe(self.metrics)
        if self.lanes is not None and self._timer is None:  # run() runs them side by side
            await self.lanes.run_pass(stats)
        self.observe.add(stats)
        return stats

    async def _own_steps(self, stats: PassStats) -> None:
        """The process's steps, whatever the routes: recovery and takeover,
        too-late jobs, schedule occurrences."""
        if self.recovery.wait() <= 0:
            for recovered in await self.recovery.step():
                stats.recovered += recovered.total
                self.observe.recovered({kind: getattr(recovered, kind) for kind in
                                        ("dispatching", "running", "dead", "enqueued")})
            stats.expired += await asyncio.to_thread(self.catchup.sweep)
        stats.occurrences = await self.schedules.run()
        stats.rerouted = await self.rerouting.step()
        if self.planner_stats.due():
            await asyncio.to_thread(self.planner_stats.step)

    async def _catch_up(self, stats: PassStats) -> None:
        """Overdue jobs (the backlog after an outage): bounded batches under the
        catch-up rate limit, highest priority first (see relay/catchup.py)."""
        while True:
            n = self.catchup.allowance()
            # Out of tokens: sleep until the next batch's worth (not spin).
            self.catchup.throttled = n == 0
            if n == 0:
                return
            owner = f"{self.name}#{next(self._claims)}"
            records = await asyncio.to_thread(self._claim, owner, n)
            stats.claimed += len(records)
            stats.caught_up += len(records)
            expired = stats.expired
            await self._dispatch(records, owner, stats)
            self.catchup.spend(len(records) - (stats.expired - expired))
            if len(records) < n:  # the backlog is drained
                return

    async def _pipeline(self, stats: PassStats) -> None:
        """Claim, publish and mark batches until one comes back short,
        pipelined: the next batch is claimed while the broker confirms the
        last one, and a confirmed batch's fenced mark rides with the next
        claim (one statement, one round trip on PostgreSQL).  Nothing is
        published before it would have been; a job published and not yet
        marked when the relay dies is recovered by its lease expiry and
        published again, and consumers drop the duplicate."""
        sending: asyncio.Task[None] | None = None
        records: list[jobstore.JobRecord] = []
        owner = ""
        try:
            while True:
                owner = f"{self.name}#{next(self._claims)}"
                records = []
                records = await self._claim_marking(owner, stats)
                stats.claimed += len(records)
                if sending is not None:
                    task, sending = sending, None
                    await task
                ready, claimed_at = await self._sort(records, owner, stats)
                claimed = records
                records = []  # sorted: held or being sent, no longer ours to hand back
                release = self._held.next_release()
                if ready and release is not None and release <= claimed_at:
                    # Held jobs due before these (a late timer): published first.
                    await self._release_held(stats)
                sending = asyncio.create_task(self._send_then_mark_later(
                    ready, owner, stats, claimed_at))
                if len(claimed) < self.batch_size:
                    break
            task, sending = sending, None
            await task
        except BaseException as exc:
            if sending is not None:
                # Its confirmations still become marks, unless we are cancelled.
                if isinstance(exc, asyncio.CancelledError):
                    sending.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await sending
            if records:  # claimed, never published: back to SCHEDULED at once
                with contextlib.suppress(DatabaseError):
                    await asyncio.to_thread(self._db, dispatched.release, owner,
                                            [r.id for r in records])
            with contextlib.suppress(DatabaseError):
                await self._flush_marks(stats)
            raise
        await self._flush_marks(stats)

    async def _send_then_mark_later(self, records: list[jobstore.JobRecord], owner: str,
                                    stats: PassStats, claimed_at: datetime) -> None:
        ok = await self._send(records, owner, stats, claimed_at=claimed_at)
        if ok:
            self._unmarked.append((owner, ok))

    async def _claim_marking(self, owner: str, stats: PassStats) -> list[jobstore.JobRecord]:
        """:meth:`_claim`, carrying the marks of confirmed batches."""
        marks, self._unmarked = self._unmarked, []
        try:
            counts, records = await asyncio.to_thread(self._claim_and_mark, owner, marks)
        except BaseException:
            self._unmarked[:0] = marks  # not marked: the next claim or flush tries again
            raise
        self._count_marks(marks, counts, stats)
        return records

    async def _flush_marks(self, stats: PassStats) -> None:
        if not self._unmarked:
            return
        marks, self._unmarked = self._unmarked, []
        try:
            counts = await asyncio.to_thread(self._mark_all, marks)
        except BaseException:
            self._unmarked[:0] = marks
            raise
        self._count_marks(marks, counts, stats)

    @staticmethod
    def _count_marks(marks: Sequence[tuple[str, Sequence[uuid.UUID]]], counts: list[int],
                     stats: PassStats) -> None:
        for (_, ids), marked in zip(marks, counts, strict=True):
            stats.marked += marked
            stats.lost_marks += len(ids) - marked

    def _mark_all(self, marks: Sequence[tuple[str, Sequence[uuid.UUID]]]) -> list[int]:
        now = self.app.clock.now()
        fence = self.scale.fence(now)
        with db_errors("mark"), self.app.engine.begin() as conn:
            return [dispatched.mark_enqueued(conn, owner=owner, ids=ids, now=now, fence=fence,
                                             delivered=self._delivered,
                                             published_to=self.published_to)
                    for owner, ids in marks]

    def _claim(self, owner: str, catchup: int = 0) -> list[jobstore.JobRecord]:
        """The next batch due by the horizon and not yet backlog; with
        ``catchup``, that many backlog jobs instead, most urgent first."""
        return self._claim_and_mark(owner, (), catchup)[1]

    def _claim_and_mark(self, owner: str, marks: Sequence[tuple[str, Sequence[uuid.UUID]]],
                        catchup: int = 0) -> tuple[list[int], list[jobstore.JobRecord]]:
        """:meth:`_claim`, and in its transaction the fenced marks of
        ``marks`` (``(claim owner, published ids)``); returns the rows each
        mark changed and the claimed records."""
        now = self.app.clock.now()
        w = self.horizon.window(now, self._near())
        fair = self.scale.fair is not None and not catchup
        with db_errors("claim"), self._claim_connection(fair) as conn:
            if catchup:
                return dispatched.mark_and_claim(
                    conn, marks=marks, owner=owner, horizon=w.backlog_until, limit=catchup,
                    now=now, lease_until=w.lease_until, priority_first=True, fence=w.fence,
                    delivered=self._delivered,
                    published_to=self.published_to,
                )
            limit = self.scale.backpressure.limit(self.batch_size)
            if self.scale.fair is not None:
                counts = [dispatched.mark_enqueued(conn, owner=o, ids=ids, now=now,
                                                   fence=w.fence, delivered=self._delivered,
                                                   published_to=self.published_to)
                          for o, ids in marks]
                return counts, self.scale.fair.claim(
                    conn, owner=owner, horizon=w.horizon, after=None, now=now,
                    lease_until=w.lease_until, limit=limit, fence=w.fence,
                )
            return dispatched.mark_and_claim(
                conn, marks=marks, owner=owner, horizon=w.horizon, limit=limit, now=now,
                lease_until=w.lease_until, after=w.backlog_until, fence=w.fence,
                delivered=self._delivered,
                published_to=self.published_to,
            )

    @contextlib.contextmanager
    def _claim_connection(self, fair: bool) -> Iterator[Connection]:
        """On PostgreSQL the claim, and each mark that goes with it, is one
        statement, atomic by itself; they need not be atomic together (each
        mark carries its own fence).  Autocommit spares the BEGIN and COMMIT
        round trips.  The fair claim locks rows before it updates them, and
        MySQL's claim takes three statements: those run in a transaction."""
        engine = self.app.engine
        if fair or engine.dialect.name != "postgresql":
            with engine.begin() as conn:
                yield conn
            return
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn

    async def _dispatch(self, records: list[jobstore.JobRecord], owner: str,
                        stats: PassStats) -> None:
        ready, claimed_at = await self._sort(records, owner, stats)
        await self._publish(ready, owner, stats, claimed_at=claimed_at)

    async def _sort(self, records: list[jobstore.JobRecord], owner: str, stats: PassStats
                    ) -> tuple[list[jobstore.JobRecord], datetime]:
        """Metrics of a fresh claim; expire the too-late jobs, hold the
        near-due ones; returns the ones to publish now and the claim time."""
        now = self.app.clock.now()
        self.observe.claimed(records, now)
        expired = [r.id for r in records if self.catchup.too_late(r, now)]
        if expired:
            stats.expired += await asyncio.to_thread(self._db, dispatched.expire, owner, expired)
        ready = []
        for rec in records:
            if expired and self.catchup.too_late(rec, now):
                continue
            if rec.due_at <= now:  # due: published now whatever the hold rules say
                ready.append(rec)
                continue
            release_at = self._held.release_time(rec, now, self._near())
            if release_at > now:
                self._held.hold(rec, owner, release_at)
                stats.held += 1
            else:
                ready.append(rec)
        return ready, now

    def _near(self) -> float:
        return self.near_window if self._timer is not None else self.hold_window

    async def _release_held(self, stats: PassStats) -> None:
        # Popped and sent in one turn, so nothing decided later overtakes them.
        async with self._publishing:
            sent = [(owner, await self._send_in_turn(recs, owner, stats, None))
                    for owner, recs in self._held.take_due(self.app.clock.now())]
        for owner, ok in sent:
            await self._mark(owner, ok, stats)

    async def _publish(self, records: list[jobstore.JobRecord], owner: str,
                       stats: PassStats, claimed_at: datetime | None = None) -> None:
        await self._mark(owner, await self._send(records, owner, stats, claimed_at), stats)

    async def _mark(self, owner: str, ok: list[uuid.UUID], stats: PassStats) -> None:
        if not ok:
            return
        marked = await asyncio.to_thread(self._db, dispatched.mark_enqueued, owner, ok,
                                         fence=self.scale.fence(self.app.clock.now()),
                                         delivered=self._delivered,
                                         published_to=self.published_to)
        stats.marked += marked
        stats.lost_marks += len(ok) - marked

    async def _send(self, records: list[jobstore.JobRecord], owner: str,
                    stats: PassStats, claimed_at: datetime | None = None) -> list[uuid.UUID]:
        """Publish ``records``; those the broker refused go back to SCHEDULED.
        Returns the ids it confirmed, for the caller to mark."""
        async with self._publishing:
            return await self._send_in_turn(records, owner, stats, claimed_at)

    async def _send_in_turn(self, records: list[jobstore.JobRecord], owner: str,
                            stats: PassStats, claimed_at: datetime | None) -> list[uuid.UUID]:
        if self.scale.shards is not None:
            records, fenced = await asyncio.to_thread(self.scale.still_owned, records)
            stats.fenced += fenced
            if fenced:
                self.metrics.fenced.labels(self.backend).inc(fenced)
        if not records or self.publisher is None:  # nothing is claimed without one
            return []
        now = self.app.clock.now()
        batch = [Outgoing(r.to_message(), self._held.delay(r, now)) for r in records]
        started = time.monotonic()
        try:
            with tracing.publish_span([r.headers for r in records], self.backend):
                results = await self.publisher.publish(batch)
        except Exception as exc:  # an outage, or any client's own exception
            self.scale.backpressure.observe(len(batch), time.monotonic() - started, error=True)
            self._log.warning(f"publish:{kind_of(exc)}", "publish of %d jobs failed: %s: %s",
                              len(batch), type(exc).__name__, exc)
            stats.failed += len(batch)
            # Back at once, not after their leases: the next pass tries again.
            await asyncio.to_thread(self._db, dispatched.release, owner, [r.id for r in records])
            raise
        ok = [r.job_id for r in results if r.ok]
        failed = [r for r in results if not r.ok]
        self.scale.backpressure.observe(len(batch), time.monotonic() - started, refused=len(failed))
        stats.published += len(ok)
        self.observe.published(records, set(ok), now, claimed_at, self.lead)
        if failed:
            stats.failed += len(failed)
            await self.refusals.handle(records, owner, failed, len(results))
        return ok

    def _db(self, fn: object, owner: str, ids: Sequence[object], **kw: object) -> int:
        with db_errors("mark"), self.app.engine.begin() as conn:
            result: int = fn(conn, owner=owner, ids=ids, now=self.app.clock.now(), **kw)  # type: ignore[operator]
            return result

    # --- the loop --------------------------------------------------------------

    def _seconds_until_next(self) -> float:
        now = self.app.clock.now()
        waits = [self.app.settings.poll_interval, self.recovery.wait()]
        release = self._held.next_release()
        if release is not None and self._timer is None:
            waits.append((release - now).total_seconds())
        if self.reconciler.sweeping or self.schedules.pending or self.rerouting.pending:
            waits.append(0.0)
        if self.catchup.throttled:
            waits.append(self.catchup.bucket.seconds_until(self.catchup.chunk, now))
        rate_wait = self.scale.wait()
        if self.publisher is not None and self.max_delay is not None:
            with db_errors("next due"), self.app.engine.connect() as conn:
                due = (claims.next_due(conn) if self.route is None
                       else routes.next_due(conn, self.route.where()))
            reach = self.horizon.reach()
            if due is not None and reach is not None:
                until_reach = (due - now).total_seconds() - reach
                if until_reach > 0:
                    # Not within reach yet.  It need not be claimed the moment
                    # it is: the reach keeps at least half of itself ahead of
                    # it (kafka://: poll_interval + 1 s).  Claiming a moment
                    # later takes together the jobs a trickle brings into
                    # reach: woken for each, the relay ran a claim per job
                    # (kafka://: 4.5 ms of CPU per job at 100 jobs/s).  Jobs
                    # already within reach (a backlog) are claimed at once.
                    until_reach += min(self.app.settings.poll_interval, reach / 2)
                due_wait = self.catchup.adjust_wait(due, now, until_reach)
                # Rate-limited: due jobs wait for tokens, not a busy loop.
                waits.append(max(due_wait, rate_wait))
        # Every wait counts from ``now``; the query above took some of it.
        return max(0.0, min(waits) - (self.app.clock.now() - now).total_seconds())

    async def run(self, stop: asyncio.Event | None = None,
                  waker: PgWaker | None = None) -> None:
        """Run passes until ``stop`` is set.  Whatever a pass raises —
        database and broker outages, and any exception from their clients
        (aiokafka's admin client raised ``AttributeError`` while the cluster
        had no controller) — is logged, once per kind per interval, and the
        pass is retried after a jittered backoff; only a configuration error
        (it would fail the same way every time) ends the relay.  A lane is
        woken by its relay's ``waker`` (one LISTEN connection per process)."""
        stop = stop or asyncio.Event()
        waker = waker or PgWaker(parse_database_url(self.app.settings.database_url))
        if not await open_broker(self.broker, stop):
            return
        await waker.start()
        beating = None
        if self.route is None:  # a lane runs under its relay's registry row
            # The liveness lock and registry row come before the first claim.
            await asyncio.to_thread(self.heartbeat.register)
            beating = asyncio.create_task(self.heartbeat.run(stop),
                                          name="duebox-relay-heartbeat")
        gc.freeze()  # as the worker does (consumers/worker.py): no long full collections
        self._held.changed = asyncio.Event()  # of this loop: run() may be called again
        self._publishing = asyncio.Lock()
        self._timer = asyncio.create_task(self._fire_held(stop), name="duebox-relay-timer")
        # No duebox worker reads your own consumer's queues: what it would do
        # for them (Redis's mover) runs here.
        serving = asyncio.create_task(self.broker.serve_own_queues(self._delivered, stop),
                                      name="duebox-relay-own-queues")
        backoff = 0.1
        if self.lanes is not None:
            self.lanes.start(waker)
            log.info("relay %s started: %s -> routes: %s", self.name,
                     redacted(self.app.settings.database_url), self.lanes.describe())
        elif self.route is None:  # a lane's route is in its relay's line
            log.info("relay %s started: %s -> %s (max_delay=%s)", self.name,
                     redacted(self.app.settings.database_url),
                     redacted(self.app.settings.broker_url), self.max_delay)
        try:
            while not stop.is_set():
                try:
                    if self.lanes is not None:
                        self.lanes.check()
                    await self.run_pass()
                    wait = await asyncio.to_thread(self._seconds_until_next)
                    backoff = 0.1
                    self._log.flush()
                except ConfigurationError:
                    raise
                except Exception as exc:
                    self.totals.errors += 1
                    self.metrics.relay_errors.labels(self.backend).inc()
                    wait = backoff * (0.5 + random.random())
                    self._log.warning(f"pass:{kind_of(exc)}", "relay pass failed (%s: %s); "
                                      "retrying in %.1fs", type(exc).__name__, exc, wait,
                                      exc_info=not isinstance(exc, DueboxError))
                    backoff = min(backoff * 2, 10.0)
                await wait_any(wait, waker.event, stop)
                waker.event.clear()
        finally:
            serving.cancel()
            await asyncio.wait({serving}, timeout=2.0)
            if self.lanes is not None:
                await self.lanes.stop()
            if beating is not None:
                await self.heartbeat.stop(beating)
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None
            with contextlib.suppress(DatabaseError):
                await self._flush_marks(PassStats())
            await self._give_back_held()
            with contextlib.suppress(DatabaseError):
                await asyncio.to_thread(self.scale.release)
            await waker.stop()
            await self.broker.close()
            if self.route is None:
                log.info("relay %s stopped", self.name)

    async def _fire_held(self, stop: asyncio.Event) -> None:
        """The precise timer: publish held jobs at their release time, whatever
        the pass loop is doing meanwhile (claiming, marking, sleeping)."""
        while not stop.is_set():
            self._held.changed.clear()
            wait = self.app.settings.poll_interval
            release = self._held.next_release()
            if release is not None:
                wait = (release - self.app.clock.now()).total_seconds()
            if wait > 0:
                await wait_any(wait, self._held.changed, stop)
                continue
            stats = PassStats()
            try:
                await self._release_held(stats)
            except ConfigurationError:
                raise
            except Exception as exc:
                # The failed batch went back to SCHEDULED (or its lease expires).
                self.totals.errors += 1
                self._log.warning(f"held:{kind_of(exc)}", "publishing held jobs failed (%s: %s)",
                                  type(exc).__name__, exc,
                                  exc_info=not isinstance(exc, DueboxError))
                await wait_any(0.1 * (0.5 + random.random()), stop)
            self.observe.add(stats, a_pass=False)

    async def _give_back_held(self) -> None:
        """On shutdown, held jobs go back to SCHEDULED at once so another relay
        need not wait for their leases to expire."""
        for owner, ids in self._held.take_all().items():
            with contextlib.suppress(DatabaseError):
                await asyncio.to_thread(self._db, dispatched.release, owner, ids)
