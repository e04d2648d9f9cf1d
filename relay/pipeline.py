"""One broker's dispatch pipeline: claim, publish, mark; park, hold, reconcile.

A relay (relay/relay.py) runs one pipeline per broker it publishes to: one
on a single broker, one per publishing route with ``broker_routes``, none on
``sql://``, whose workers claim rows from the job table themselves.  Each
runs as a task of its own: a broker that is slow or down stalls only its
pipeline, whose jobs wait in the database (``SCHEDULED``) meanwhile.  Each
pass:

1. **Claim** a bounded batch in a short transaction: ``SCHEDULED`` jobs of
   its route due by ``now + max_delay (+ hold window)`` (the claim window:
   relay/horizon.py; the claim: core/leases/claims.py) become ``DISPATCHING``,
   leased to a per-claim owner token.  The same predicate parks jobs beyond
   the broker's ceiling and picks them up as they come near.  After an
   outage, **overdue** jobs go first: rate-limited, highest priority first,
   too-late ones expired (relay/catchup.py).
2. **Publish** outside any transaction with delay = ``due_at - now`` clipped
   to ``[0, max_delay]`` and rounded *up* to the broker's precision.  Jobs
   the broker cannot delay long enough (Kafka: not at all) are held in a
   heap, still leased in the database, and published at ``due_at -
   max_delay`` (relay/held.py).
3. **Mark** ``ENQUEUED`` with a fenced update; a mark that matches nothing
   means the lease was lost and the publish was a duplicate consumers drop.
4. **Reconcile** with brokers that can tell which ``ENQUEUED`` jobs they
   lost (Redis restarted empty): those go back to ``SCHEDULED`` and are
   published again, at once when the broker reports data loss, else on a
   slow sweep (relay/reconcile.py).
5. **Sleep** until its route's earliest due time, a held job's release or
   the poll interval: woken early by ``NOTIFY`` on PostgreSQL, and by its
   relay when the relay's own steps gave it work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from duebox import reroute, routes
from duebox.brokers.base import Outgoing, PublishingBroker, open_broker
from duebox.db import PgWaker, bound_idle_transaction, db_errors
from duebox.errors import ConfigurationError, DatabaseError, DueboxError
from duebox.fairness.policy import DispatchPolicy
from duebox.leases import dispatch_marks, jobstore
from duebox.metrics import Metrics
from duebox.observability import tracing
from duebox.observability.logs import CollapsedLog, kind_of
from duebox.routes import Route
from duebox.wait_any import wait_any

from .catchup import CatchUp
from .held import HeldJobs
from .horizon import Horizon
from .reconcile import Reconciler
from .refusals import Refusals
from .scale import ScaleControls
from .shards import ShardOwner
from .stats import PassStats, RelayMetrics, RelayTotals, figures

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from duebox.app import Duebox

log = logging.getLogger("duebox.relay")

# A pipeline's claims and marks: (claim owner, published ids).
Marks = Sequence[tuple[str, Sequence[uuid.UUID]]]


@dataclass(frozen=True)
class DispatchOptions:
    """How a relay's pipelines dispatch: the relay's keyword arguments."""

    batch_size: int
    hold_window: float | None  # None: the broker's (poll interval + 1 s without a delay)
    near_window: float
    lead: float | None  # None: the broker's ``publish_lead``
    reconcile_interval: float
    policy: DispatchPolicy


async def keep_passing(one_pass: Callable[[], Awaitable[float]], stop: asyncio.Event,
                       woken: asyncio.Event, observe: RelayMetrics, logged: CollapsedLog) -> None:
    """Run ``one_pass`` (which returns the seconds until the next) until
    ``stop``, or ``woken`` early: the loop of a relay's own steps and of each
    pipeline.  Whatever a pass raises — database and broker outages, and any
    exception from their clients (aiokafka's admin client raised
    ``AttributeError`` while the cluster had no controller) — is counted,
    logged once per kind per interval, and the pass is retried after a
    jittered backoff; only a configuration error (it would fail the same way
    every time) ends the loop."""
    backoff = 0.1
    while not stop.is_set():
        try:
            wait = await one_pass()
            backoff = 0.1
            logged.flush()
        except ConfigurationError:
            raise
        except Exception as exc:
            observe.error()
            wait = backoff * (0.5 + random.random())
            logged.warning(f"pass:{kind_of(exc)}", "relay pass failed (%s: %s); retrying in %.1fs",
                           type(exc).__name__, exc, wait,
                           exc_info=not isinstance(exc, DueboxError))
            backoff = min(backoff * 2, 10.0)
        await wait_any(wait, woken, stop)
        woken.clear()


class Pipeline:
    """Moves one broker's due jobs from the database to it: the jobs of
    ``route``'s queues, claims owned ``<name>#<n>`` with ``n`` from the
    relay's ``claims`` (unique in the process, whatever its pipelines)."""

    def __init__(self, app: Duebox, name: str, broker: PublishingBroker, route: Route,
                 options: DispatchOptions, *, claims: Iterator[int], shards: ShardOwner | None,
                 metrics: Metrics) -> None:
        self.app = app
        self.name = name
        self.broker = broker
        self.batch_size = options.batch_size
        # The jobs of these queues only: every claim, mark and next-due query
        # carries the condition (all queues: a relay given its broker).
        self.route = route
        self._where = route.where()
        self._claims = claims
        # Every mark records the route (core/reroute.py): a queue moved to
        # another broker later has its jobs moved with it (relay/rerouting.py).
        self.published_to = reroute.route_key(broker.url)
        caps = broker.capabilities
        self.max_delay = max_delay = broker.max_delay
        # How far ahead of the broker's ceiling to claim and hold in memory.
        hold_window = options.hold_window
        if hold_window is None:
            hold_window = app.settings.poll_interval + 1.0 if max_delay == 0 else 0.0
        self.hold_window = hold_window
        holds = caps.publish_lead is not None
        self.near_window = max(options.near_window, hold_window) if holds else hold_window
        self.lead = (caps.publish_lead or 0.0) if options.lead is None else options.lead
        # The precise timer runs only inside run(); a bare run_pass() hands
        # every job to the broker's own delay (Kafka's still waits in held).
        self._timer: asyncio.Task[None] | None = None
        self.held = HeldJobs(lead=self.lead, max_delay=max_delay, precision=caps.delay_precision)
        # One publish at a time, in the order they were decided: the timer's
        # releases and a pass's batches would otherwise interleave, and a
        # relay publishes the jobs of one ordering key in due-time order
        # (Capabilities.ordering).  asyncio.Lock wakes its waiters in order.
        self._publishing = asyncio.Lock()
        self.catchup = CatchUp(app, self.batch_size)
        self.scale = ScaleControls(app, options.policy, shards, route=self._where)
        self.horizon = Horizon(max_delay=max_delay, hold_window=hold_window,
                               lease_seconds=app.settings.lease_seconds, catchup=self.catchup,
                               scale=self.scale)
        self.reconciler = Reconciler(app, broker, self.batch_size, options.reconcile_interval,
                                     covers=route.covers)
        self.backend = caps.name
        self.observe = RelayMetrics(metrics, self.backend)
        # Batches the broker confirmed, not yet marked ENQUEUED: (claim owner,
        # ids); the next claim's transaction marks them (see _claim_publish_mark).
        self._unmarked: list[tuple[str, list[uuid.UUID]]] = []
        # Queues your own consumer reads: their marks say DELIVERED
        # (core/leases/own_queues.py, docs/own-consumers.md).
        self._delivered = app.settings.own_queues
        self._log = CollapsedLog(log)
        self.refusals = Refusals(app, name, self._log)
        self._woken = asyncio.Event()
        self.working_since: datetime | None = None

    @property
    def totals(self) -> RelayTotals:
        return self.observe.totals

    def info(self) -> dict[str, object]:
        """This pipeline in its relay's registry row."""
        return {"route": self.route.label, "queues": list(self.route.queues) or "(default)",
                **figures(self.backend, self.observe.totals)}

    def wake(self) -> None:
        """Pass now: the relay's own steps made jobs due (recovered, generated,
        moved between routes) or gave it shards."""
        self._woken.set()

    # --- one pass ------------------------------------------------------------

    async def run_pass(self) -> PassStats:
        stats = PassStats()
        if self.held:  # held jobs now due go first: the rest of the pass takes time
            await self._release_held(stats)
        stats.reconciled = await self.reconciler.step()
        # Claims from here on are this pass's to publish and mark, however
        # slow the broker: its relay's recovery spares them meanwhile.
        self.working_since = self.app.clock.now()
        try:
            if self.scale.fair is None:  # fair mode: overdue jobs are in the fair claim
                await self._catch_up(stats)
            await self._claim_publish_mark(stats)
        finally:
            self.working_since = None
        await self._release_held(stats)
        self.scale.observe(self.observe.metrics)
        self.observe.add(stats)
        return stats

    def _owner(self) -> str:
        return f"{self.name}#{next(self._claims)}"

    async def _catch_up(self, stats: PassStats) -> None:
        """Overdue jobs (the backlog after an outage): bounded batches under the
        catch-up rate limit, highest priority first (see relay/catchup.py)."""
        while True:
            n = self.catchup.allowance()
            # Out of tokens: sleep until the next batch's worth (not spin).
            self.catchup.throttled = n == 0
            if n == 0:
                return
            owner = self._owner()
            records = await asyncio.to_thread(self.claim, owner, n)
            stats.claimed += len(records)
            stats.caught_up += len(records)
            expired = stats.expired
            await self.publish(records, owner, stats)
            self.catchup.spend(len(records) - (stats.expired - expired))
            if len(records) < n:  # the backlog is drained
                return

    async def _claim_publish_mark(self, stats: PassStats) -> None:
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
                owner = self._owner()
                records = []
                records = await self._claim_marking(owner, stats)
                stats.claimed += len(records)
                if sending is not None:
                    task, sending = sending, None
                    await task
                ready, claimed_at = await self._sort(records, owner, stats)
                claimed = records
                records = []  # sorted: held or being sent, no longer ours to hand back
                release = self.held.next_release()
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
                    await asyncio.to_thread(self._db, dispatch_marks.release, owner,
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
        """:meth:`claim`, carrying the marks of confirmed batches."""
        marks, self._unmarked = self._unmarked, []
        try:
            counts, records = await asyncio.to_thread(self.claim_and_mark, owner, marks)
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
    def _count_marks(marks: Marks, counts: list[int], stats: PassStats) -> None:
        for (_, ids), marked in zip(marks, counts, strict=True):
            stats.marked += marked
            stats.lost_marks += len(ids) - marked

    def _mark_all(self, marks: Marks) -> list[int]:
        now = self.app.clock.now()
        fence = self.scale.fence(now)
        with db_errors("mark"), self.app.engine.begin() as conn:
            return [dispatch_marks.mark_enqueued(conn, owner=owner, ids=ids, now=now, fence=fence,
                                             delivered=self._delivered,
                                             published_to=self.published_to)
                    for owner, ids in marks]

    def claim(self, owner: str, catchup: int = 0) -> list[jobstore.JobRecord]:
        """The next batch due by the horizon and not yet backlog; with
        ``catchup``, that many backlog jobs instead, most urgent first."""
        return self.claim_and_mark(owner, (), catchup)[1]

    def claim_and_mark(self, owner: str, marks: Marks, catchup: int = 0
                       ) -> tuple[list[int], list[jobstore.JobRecord]]:
        """:meth:`claim`, and in its transaction the fenced marks of
        ``marks`` (``(claim owner, published ids)``); returns the rows each
        mark changed and the claimed records."""
        now = self.app.clock.now()
        w = self.horizon.window(now, self._near())
        fair = self.scale.fair is not None and not catchup
        with db_errors("claim"), self._claim_connection(fair) as conn:
            if catchup:
                return dispatch_marks.mark_and_claim(
                    conn, marks=marks, owner=owner, horizon=w.backlog_until, limit=catchup,
                    now=now, lease_until=w.lease_until, priority_first=True, fence=w.fence,
                    delivered=self._delivered,
                    published_to=self.published_to,
                )
            limit = self.scale.backpressure.limit(self.batch_size)
            if self.scale.fair is not None:
                counts = [dispatch_marks.mark_enqueued(conn, owner=o, ids=ids, now=now,
                                                   fence=w.fence, delivered=self._delivered,
                                                   published_to=self.published_to)
                          for o, ids in marks]
                return counts, self.scale.fair.claim(
                    conn, owner=owner, horizon=w.horizon, after=None, now=now,
                    lease_until=w.lease_until, limit=limit, fence=w.fence,
                )
            return dispatch_marks.mark_and_claim(
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
                # A relay paused inside it (SIGSTOP, a GC pause) would hold the
                # rows it locked, for everyone, as long as it is paused: the
                # server ends such a transaction after a lease.
                bound_idle_transaction(conn, self.app.settings.lease_seconds)
                yield conn
            return
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn

    async def publish(self, records: list[jobstore.JobRecord], owner: str,
                      stats: PassStats) -> None:
        """Dispatch a fresh claim: expire the too-late, hold the near-due,
        publish and mark the rest."""
        ready, claimed_at = await self._sort(records, owner, stats)
        await self._mark(owner, await self._send(ready, owner, stats, claimed_at), stats)

    async def _sort(self, records: list[jobstore.JobRecord], owner: str, stats: PassStats
                    ) -> tuple[list[jobstore.JobRecord], datetime]:
        """Metrics of a fresh claim; expire the too-late jobs, hold the
        near-due ones; returns the ones to publish now and the claim time."""
        now = self.app.clock.now()
        self.observe.claimed(records, now)
        expired = [r.id for r in records if self.catchup.too_late(r, now)]
        if expired:
            stats.expired += await asyncio.to_thread(self._db, dispatch_marks.expire, owner,
                                                     expired)
        ready = []
        for rec in records:
            if expired and self.catchup.too_late(rec, now):
                continue
            if rec.due_at <= now:  # due: published now whatever the hold rules say
                ready.append(rec)
                continue
            release_at = self.held.release_time(rec, now, self._near())
            if release_at > now:
                self.held.hold(rec, owner, release_at)
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
                    for owner, recs in self.held.take_due(self.app.clock.now())]
        for owner, ok in sent:
            await self._mark(owner, ok, stats)

    async def _mark(self, owner: str, ok: list[uuid.UUID], stats: PassStats) -> None:
        if not ok:
            return
        marked = await asyncio.to_thread(self._db, dispatch_marks.mark_enqueued, owner, ok,
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
                self.observe.metrics.fenced.labels(self.backend).inc(fenced)
        if not records:
            return []
        now = self.app.clock.now()
        batch = [Outgoing(r.to_message(), self.held.delay(r, now)) for r in records]
        started = time.monotonic()
        try:
            with tracing.publish_span([r.headers for r in records], self.backend):
                results = await self.broker.publish(batch)
        except Exception as exc:  # an outage, or any client's own exception
            self.scale.backpressure.observe(len(batch), time.monotonic() - started, error=True)
            self._log.warning(f"publish:{kind_of(exc)}", "publish of %d jobs failed: %s: %s",
                              len(batch), type(exc).__name__, exc)
            stats.failed += len(batch)
            # Back at once, not after their leases: the next pass tries again.
            await asyncio.to_thread(self._db, dispatch_marks.release, owner,
                                    [r.id for r in records])
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

    def seconds_until_next(self) -> float:
        """How long this pipeline may sleep: until its route's earliest due
        job comes within reach, a held job's release (without the timer), or
        the poll interval; less while a sweep or a backlog goes on."""
        now = self.app.clock.now()
        waits = [self.app.settings.poll_interval]
        release = self.held.next_release()
        if release is not None and self._timer is None:
            waits.append((release - now).total_seconds())
        if self.reconciler.sweeping:
            waits.append(0.0)
        if self.catchup.throttled:
            waits.append(self.catchup.bucket.seconds_until(self.catchup.chunk, now))
        rate_wait = self.scale.wait()
        if self.max_delay is not None:
            with db_errors("next due"), self.app.engine.connect() as conn:
                # Another route's due jobs must not wake this pipeline (one
                # whose broker is down would keep every other busy).
                due = routes.next_due(conn, self._where)
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

    async def run(self, stop: asyncio.Event, waker: PgWaker) -> None:
        """Open the broker (retrying while it is unreachable), then passes
        until ``stop``, woken by ``waker`` (a follower of the relay's: one
        LISTEN connection per process, whatever the number of pipelines) and
        by :meth:`wake`.  On the way out its confirmed batches are marked,
        its held jobs go back to ``SCHEDULED`` and the broker is closed."""
        if not await open_broker(self.broker, stop):
            return
        self._woken = waker.event
        self.held.changed = asyncio.Event()  # of this loop: run() may be called again
        self._publishing = asyncio.Lock()
        self._timer = asyncio.create_task(self._fire_held(stop), name="duebox-relay-timer")
        # No duebox worker reads your own consumer's queues: what it would do
        # for them (Redis's mover) runs here.
        own = [q for q in self._delivered if self.route.covers(q)]
        serving = asyncio.create_task(self.broker.serve_own_queues(own, stop),
                                      name="duebox-relay-own-queues")
        try:
            await keep_passing(self._pass_and_wait, stop, self._woken, self.observe, self._log)
        finally:
            serving.cancel()
            await asyncio.wait({serving}, timeout=2.0)
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None
            with contextlib.suppress(DatabaseError):
                await self._flush_marks(PassStats())
            await self._give_back_held()
            await self.broker.close()

    async def _pass_and_wait(self) -> float:
        await self.run_pass()
        return await asyncio.to_thread(self.seconds_until_next)

    async def _fire_held(self, stop: asyncio.Event) -> None:
        """The precise timer: publish held jobs at their release time, whatever
        the pass loop is doing meanwhile (claiming, marking, sleeping)."""
        while not stop.is_set():
            self.held.changed.clear()
            wait = self.app.settings.poll_interval
            release = self.held.next_release()
            if release is not None:
                wait = (release - self.app.clock.now()).total_seconds()
            if wait > 0:
                await wait_any(wait, self.held.changed, stop)
                continue
            stats = PassStats()
            try:
                await self._release_held(stats)
            except ConfigurationError:
                raise
            except Exception as exc:
                # The failed batch went back to SCHEDULED (or its lease expires).
                self.observe.totals.errors += 1
                self._log.warning(f"held:{kind_of(exc)}", "publishing held jobs failed (%s: %s)",
                                  type(exc).__name__, exc,
                                  exc_info=not isinstance(exc, DueboxError))
                await wait_any(0.1 * (0.5 + random.random()), stop)
            self.observe.add(stats, a_pass=False)

    async def _give_back_held(self) -> None:
        """On shutdown, held jobs go back to SCHEDULED at once so another relay
        need not wait for their leases to expire."""
        for owner, ids in self.held.take_all().items():
            with contextlib.suppress(DatabaseError):
                await asyncio.to_thread(self._db, dispatch_marks.release, owner, ids)


__all__ = ["DispatchOptions", "Pipeline", "keep_passing"]
