"""The worker: receive, check, run, complete — each step fenced.

For every delivery:

1. A message that does not decode is rejected with its reason (never a crash).
2. A message that arrived before its due time waits (short) or is deferred.
3. The job is *started* with a version-checked conditional update (skipped by
   ``sql://``, whose claim already did it): a cancelled or rescheduled job, a
   stale version or a duplicate finds no row and is discarded.
4. The handler runs inside one transaction together with the dedupe row and
   the fenced completion (``lease_owner`` and ``lease_generation``): if the
   lease was lost meanwhile, everything the handler wrote rolls back.
5. A failure is recorded on the attempt and the job retried later with a new
   version, or dead-lettered when its attempts are used up.

A heartbeat renews the lease while the handler runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from duebox import jobstore
from duebox.brokers.base import Broker, Delivery, open_broker
from duebox.clock import Clock
from duebox.db import db_errors
from duebox.errors import DatabaseError, ValidationError
from duebox.failures import FailureClass, Verdict
from duebox.heartbeat import ProcessHeartbeat
from duebox.ids import process_token
from duebox.message import check_stored_payload
from duebox.metrics import Metrics, process_metrics, seconds
from duebox.tasks import Task

from .dedupe import SQLDedupeStore
from .execution import Execution, Outcome, Pools

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.worker")

# A delivery whose handling failed unexpectedly (the database down) comes back
# after this long.
_RETRY_DELIVERY_SECONDS = 5.0

# A message that arrives this close before its due time is held in the
# worker; further out it goes back to the broker.
_EARLY_HOLD_SECONDS = 1.0


@dataclass
class WorkerStats:
    received: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    dead: int = 0
    duplicates: int = 0
    lease_lost: int = 0
    deferred: int = 0
    discarded: Counter[str] = field(default_factory=Counter)


class Worker:
    def __init__(
        self,
        app: Duebox,
        *,
        broker: Broker | None = None,
        queues: Sequence[str] | None = None,
        concurrency: int | None = None,
        name: str | None = None,
        dedupe: SQLDedupeStore | None = None,
        metrics: Metrics | None = None,
        heartbeat_interval: float = 5.0,
    ) -> None:
        self.app = app
        self.name = name or process_token("worker")
        self.broker = broker or app.broker(self.name)
        self.queues = list(queues) if queues else app.queues
        self.concurrency = concurrency or app.settings.concurrency
        # Replaced by the worker's own thread pools while it runs (see Pools).
        self.pools = Pools.default()
        self.dedupe = dedupe or SQLDedupeStore()
        self.stats = WorkerStats()
        self._slots = asyncio.Semaphore(self.concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics = metrics or process_metrics()
        self.backend = self.broker.capabilities.name
        self.heartbeat = ProcessHeartbeat(
            app.engine, app.clock, role="worker", name=self.name, interval=heartbeat_interval,
            info=self._info)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Consume until ``stop`` is set, then finish what is running."""
        stop = stop or asyncio.Event()
        if not await open_broker(self.broker, stop):
            return
        self.pools = Pools.for_worker(self.concurrency)
        await asyncio.to_thread(self.heartbeat.sync_clock_once)
        consumer = asyncio.create_task(self._consume(), name="duebox-consume")
        stopper = asyncio.create_task(stop.wait())
        beating = asyncio.create_task(self.heartbeat.run(stop), name="duebox-worker-heartbeat")
        try:
            await asyncio.wait({consumer, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if consumer.done():
                consumer.result()  # surface the error that ended consumption
        finally:
            consumer.cancel()
            stopper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.heartbeat.stop(beating)
            await self.broker.close()
            self.pools.shutdown()
            self.pools = Pools.default()

    async def _consume(self) -> None:
        backoff = 0.1
        while True:
            try:
                async for delivery in self.broker.consume(self.queues, self.concurrency):
                    await self._slots.acquire()
                    t = asyncio.create_task(self._guarded(delivery))
                    self._tasks.add(t)
                    t.add_done_callback(self._tasks.discard)
                backoff = 0.1
            except DatabaseError as exc:
                log.warning("consume failed (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _guarded(self, delivery: Delivery) -> None:
        try:
            await self.handle(delivery)
        except Exception:
            # The job stays leased; lease recovery publishes it again.  The
            # broker's message is handed back for later rather than left
            # unacked, where it would hold a prefetch slot until the channel
            # closes (RabbitMQ's consumer_timeout is 30 minutes).
            log.exception("delivery failed; the job's lease will expire and it will be retried")
            with contextlib.suppress(Exception):
                if delivery.claimed is not None:
                    await self.broker.ack(delivery)
                else:
                    await self.broker.defer(delivery, _RETRY_DELIVERY_SECONDS)
        finally:
            self._slots.release()

    # --- one delivery ----------------------------------------------------------

    async def handle(self, delivery: Delivery) -> None:
        self.stats.received += 1
        self.metrics.received.labels(self.backend).inc()
        msg = delivery.message
        if msg is None:
            self._discard("undecodable")
            log.warning("rejected a message that is not a duebox message: %s",
                        delivery.decode_error)
            await self.broker.reject(delivery, delivery.decode_error or "undecodable")
            return
        clock = self.app.clock
        early = (msg.due_at - clock.now()).total_seconds()
        if early > _EARLY_HOLD_SECONDS and delivery.claimed is None:
            self.stats.deferred += 1
            self.metrics.deferred.labels(self.backend).inc()
            await self.broker.defer(delivery, early)
            return
        rec = delivery.claimed
        obtained = delivery.claimed_at
        if rec is None:
            obtained = clock.now()  # no later than the start itself
            # A message a moment early (the relay publishes near-due jobs just
            # ahead, to cover the hand-over) is started now, version-checked
            # and leased, and its handler held below: the round trip is done
            # by the due time instead of after it.
            rec, reason = await self.pools.db(self._start, delivery, max(0.0, early))
            if rec is None:
                if reason == "not_due":
                    self.stats.deferred += 1
                    self.metrics.deferred.labels(self.backend).inc()
                    await self.broker.defer(delivery, 1.0)
                else:
                    self._discard(reason)
                    await self.broker.reject(delivery, reason)
                return
        await _hold_until(clock, rec.due_at)
        # Leased before its due time (or long before now): a cancel or a
        # takeover since then must still win (version-checked execution reads
        # the job again right before running it).
        if (obtained is not None and _must_reread(obtained, rec.due_at, clock.now())
                and not await self.pools.db(self._still_leased, rec)):
            self._discard("cancelled")
            await self.broker.ack(delivery)
            return
        started = clock.now()
        self._observe_start(rec, started)
        try:
            task = self.app.get_task(rec.task)
            check_stored_payload(rec.payload)
        except ValidationError as exc:
            # Nothing here can run it (no such task, or a stored payload that
            # is not JSON): dead-letter it with the reason.
            orphan = Task(name=rec.task, fn=_no_handler, queue=rec.queue)
            outcome = await self.pools.db(
                Execution(self.app, orphan, rec, self.name, self.dedupe, self.pools).settle,
                Verdict(FailureClass.PERMANENT), str(exc))
            self.stats.dead += 1
            self._observe_outcome(rec, outcome, started)
            await self.broker.ack(delivery)
            return
        if rec.expired(clock.now()):
            await self.pools.db(self._expire, rec)
            self._discard("expired")
            await self.broker.ack(delivery)
            return
        await self._execute(task, rec, started)
        await self.broker.ack(delivery)

    def _discard(self, reason: str) -> None:
        self.stats.discarded[reason] += 1
        self.metrics.discarded.labels(self.backend, reason).inc()
        if reason in ("stale_version", "already_succeeded", "already_running", "cancelled"):
            self.stats.duplicates += 1
            self.metrics.duplicates.labels(self.backend, reason).inc()

    def _start(self, delivery: Delivery, ahead: float) -> tuple[jobstore.JobRecord | None, str]:
        assert delivery.message is not None
        s = self.app.settings
        with db_errors("start"), self.app.engine.begin() as conn:
            now = self.app.clock.now()
            rec = jobstore.start(
                conn, message=delivery.message, owner=f"{self.name}#{delivery.message.job_id}",
                now=now, lease_until=now + timedelta(seconds=s.lease_seconds + ahead),
                worker=self.name, ahead=ahead,
            )
            if rec is not None:
                return rec, "started"
            return None, jobstore.why_not_started(
                conn, delivery.message, now + timedelta(seconds=ahead))

    def _still_leased(self, rec: jobstore.JobRecord) -> bool:
        with db_errors("re-read"), self.app.engine.connect() as conn:
            return jobstore.still_leased(conn, rec)

    def _expire(self, rec: jobstore.JobRecord) -> None:
        with self.app.engine.begin() as conn:
            jobstore.expire(conn, owner=rec.lease_owner or "", ids=[rec.id],
                            now=self.app.clock.now())

    async def _execute(self, task: Task, rec: jobstore.JobRecord, started: datetime) -> None:
        outcome = await Execution(self.app, task, rec, self.name, self.dedupe, self.pools).run()
        self._observe_outcome(rec, outcome, started)
        st = self.stats
        if outcome.status == "succeeded":
            st.succeeded += 1
        elif outcome.status == "duplicate":
            st.succeeded += 1
            st.duplicates += 1
        elif outcome.status == "lease_lost":
            st.lease_lost += 1
        else:
            st.failed += 1
            st.retried += outcome.status == "retried"
            st.dead += outcome.status == "dead"


    # --- observability -----------------------------------------------------------

    def _info(self) -> dict[str, Any]:
        st = self.stats
        return {"role": "worker", "backend": self.backend, "queues": self.queues,
                "concurrency": self.concurrency, "received": st.received,
                "succeeded": st.succeeded, "failed": st.failed, "dead": st.dead}

    def _observe_start(self, rec: jobstore.JobRecord, started: datetime) -> None:
        m, labels = self.metrics, (self.backend, rec.queue)
        m.start_lateness.labels(*labels).observe(seconds(started, rec.due_at))
        available = rec.due_at
        if rec.published_at is not None and rec.published_at > available:
            available = rec.published_at
        m.queue_wait.labels(*labels).observe(seconds(started, available))

    def _observe_outcome(self, rec: jobstore.JobRecord, outcome: Outcome,
                         started: datetime) -> None:
        m, b, q = self.metrics, self.backend, rec.queue
        finished = self.app.clock.now()
        m.execution.labels(b, q, outcome.status).observe(seconds(finished, started))
        if outcome.status in ("succeeded", "duplicate"):
            m.succeeded.labels(b, q).inc()
            m.end_to_end.labels(b, q).observe(seconds(finished, rec.due_at))
            if outcome.status == "duplicate":
                m.duplicates.labels(b, "dedupe").inc()
        elif outcome.status == "lease_lost":
            m.lease_lost.labels(b, q).inc()
        else:
            cls = str(outcome.failure_class or "unknown")
            m.failed.labels(b, q, cls).inc()
            if outcome.status == "retried":
                m.retried.labels(b, q).inc()
            elif outcome.status == "dead":
                m.dead.labels(b, q, cls).inc()


async def _hold_until(clock: Clock, due_at: datetime) -> None:
    """Invariant 1: a handler never starts before its due time.  Started or
    claimed a moment ahead, the job waits here, on the app's clock (a test's
    fake clock moves when slept on), until that clock agrees it is due."""
    while (wait := (due_at - clock.now()).total_seconds()) > 0:
        await clock.sleep(wait)


# A lease older than this when its handler starts is read again first.
_REREAD_AFTER = timedelta(milliseconds=500)


def _must_reread(obtained: datetime, due_at: datetime, now: datetime) -> bool:
    return obtained < due_at or now - obtained > _REREAD_AFTER


def _no_handler(payload: Any, ctx: Any) -> None:  # pragma: no cover - never called
    raise RuntimeError("no handler")
