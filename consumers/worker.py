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
import functools
import gc
import logging
import random
import threading
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.pool import SingletonThreadPool, StaticPool

from duebox.batched_calls import Batched
from duebox.brokers.base import Broker, Delivery, open_broker
from duebox.clock import Clock, follows_real_time
from duebox.credentials import redacted
from duebox.db import db_errors
from duebox.errors import ConfigurationError, DatabaseError, DueboxError, ValidationError
from duebox.failures import FailureClass, SystemFailure, Verdict
from duebox.ids import process_token
from duebox.leases import dispatch_marks, jobstore
from duebox.message import JobMessage, check_stored_payload
from duebox.metrics import Metrics, observe_many, process_metrics, seconds
from duebox.observability import tracing
from duebox.observability.logs import CollapsedLog, kind_of
from duebox.observability.trouble import log_trouble
from duebox.processes.heartbeat import ProcessHeartbeat
from duebox.registry import check_queue_name
from duebox.states import Discard
from duebox.tasks import Task
from duebox.timing import EARLY_HOLD_SECONDS, EXECUTOR_HOLD_MOST, REREAD_LEAD

from .dedupe import SQLDedupeStore
from .execution import Execution, Outcome, Pools, RunStatus, still_leased, warm_up
from .job_lines import JobLines
from .runner import Runner, Settled
from .settling import until_answered
from .starts import Starts
from .turns import Turn, Turns

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.worker")

# Discards that mean the message was a duplicate of work already done or
# dropped (the duplicates metric).
_DUPLICATE_REASONS = frozenset({Discard.STALE_VERSION, Discard.ALREADY_SUCCEEDED,
                                Discard.ALREADY_RUNNING, Discard.CANCELLED})

# A delivery whose handling failed unexpectedly (the database down) comes back
# after this long.
_RETRY_DELIVERY_SECONDS = 5.0

# The shortest deferral: a job found not yet due after all is looked at again
# this much later, not in a tight loop.
_MIN_DEFER_SECONDS = 0.1


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
    grouped: int = 0  # jobs run in a group-commit transaction with others
    laned: int = 0  # jobs run by the batch lane (consumers/runner.py)
    # Of those, jobs the lane locked due itself (sql://): no claim written.
    direct: int = 0
    # Handlers called a second time because their group's transaction was
    # lost after they ran (consumers/batch.py says when that happens).
    reran: int = 0
    throttled: int = 0  # failures classed as throttled (the relay slows down on them)
    # Jobs given to other workers: every thread here ran a long handler.
    handed_back: int = 0
    # Jobs whose own transaction a lost connection cut (a failover): settled
    # once a server answered, to run again at once (consumers/settling.py).
    interrupted: int = 0
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
        group_commit: int | None = None,
        log_jobs: bool | None = None,
    ) -> None:
        self.app = app
        self.name = name or process_token("worker")
        self.queues = list(queues) if queues else app.queues
        # Queues on several routes: one consumer per route's broker, all
        # feeding this worker's executors (brokers/routed.py).
        self.broker = broker or app.broker(self.name, queues=self.queues)
        self._given_broker = broker is not None
        self.concurrency = concurrency or app.settings.concurrency
        # The worker's thread pools: started by run(), shut down after it.
        self.pools = Pools()
        self.dedupe = dedupe or SQLDedupeStore()
        self.stats = WorkerStats()
        self.group_commit = group_commit or app.settings.group_commit
        reread = functools.partial(still_leased, app)
        self.rereads: Batched[jobstore.JobRecord, bool] = Batched(
            "re-reading", lambda records: self.pools.db(reread, records))
        # Every job this worker runs goes through the runner: alone or in a
        # batch, its policy decides (consumers/runner.py).
        self.runner = Runner(
            app, self.name, self.broker, self.dedupe, self.pools, self.concurrency,
            self.group_commit, self, queues=self.queues, reread=self.rereads.call,
            lane=Runner.lane_enabled(self.broker, app.engine.dialect.name, self.concurrency,
                                     self.group_commit))
        self.starts = Starts(app, self.name, self.pools)
        # A broker buffers up to ``prefetch`` unacknowledged messages for
        # this worker; with group commit a few per executor, so a group can
        # form from those that wait while all executors are busy.
        self.prefetch = self.concurrency * (1 + min(3, self.group_commit - 1))
        self._in_hand = 0
        self._turns = Turns()  # handlers of one ordering key start in arrival order
        self._room = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics = metrics or process_metrics()
        self.backend = self.broker.capabilities.name
        self._real_time = follows_real_time(app.clock)
        self._received = self.metrics.received.labels(self.backend)
        self._by_queue: dict[str, tuple[Any, Any, Any, Any, Any]] = {}
        self._log = CollapsedLog(log)
        # One line per finished job, when asked (consumers/job_lines.py).
        self.job_lines = JobLines(app.settings.log_jobs if log_jobs is None else log_jobs)
        self.heartbeat = ProcessHeartbeat(
            app.engine, app.clock, role="worker", name=self.name, interval=heartbeat_interval,
            info=self._info)
        self.broker.registry_changed = self.heartbeat.poke

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Consume until ``stop`` is set, then finish what is running."""
        stop = stop or asyncio.Event()
        for queue in self.queues:  # a worker told to consume what no job can be in
            try:
                check_queue_name(self.broker.url if self._given_broker
                                 else self.app.routes.url_for(queue), queue)
            except ValidationError as exc:
                raise ConfigurationError(f"queues: {exc}") from None
        if not await open_broker(self.broker, stop):
            return
        self.pools.start(self.concurrency)
        # The liveness lock and registry row come before the first lease.
        await asyncio.to_thread(self.heartbeat.register)
        await self._warm_up()
        self.job_lines.start()
        # Everything allocated so far (modules, SQLAlchemy's caches, the app)
        # lives as long as the process: out of the collector's sight, a full
        # collection no longer stops every thread for tens of milliseconds
        # (a 60 ms stall made four consecutive jobs late at 100 jobs/s).
        gc.freeze()
        log.info("worker %s started: queues %s on %s, concurrency %d", self.name,
                 ", ".join(self.queues), redacted(self.broker.url),
                 self.concurrency)
        consumer = asyncio.create_task(self._consume(), name="duebox-consume")
        # sql://: the lane locks due rows itself while it leads (consumers/runner.py).
        pulling = (asyncio.create_task(self.runner.pull(), name="duebox-lane-pull")
                   if self.runner.claims is not None else None)
        stopper = asyncio.create_task(stop.wait())
        beating = asyncio.create_task(self.heartbeat.run(stop), name="duebox-worker-heartbeat")
        try:
            await asyncio.wait({consumer, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if consumer.done():
                consumer.result()  # surface the error that ended consumption
        finally:
            consumer.cancel()
            stopper.cancel()
            if pulling is not None:
                pulling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pulling
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            # Jobs taken in but not started by an executor go back now, not
            # after their leases (a broker's message is acked: the relay
            # publishes the job again).
            waiting = self.runner.release_waiting()
            if waiting:
                with contextlib.suppress(DatabaseError):
                    await self.pools.db(self._give_back, waiting)
            await self.runner.drain()  # due lane jobs, never started: run now
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.heartbeat.stop(beating)
            await self.broker.close()
            self.pools.shutdown()
            log.info("worker %s stopped", self.name)

    async def _warm_up(self) -> None:
        """Connections for the executors and the per-job statements compiled
        before the first job (see execution.warm_up); a failure here is only
        logged: the jobs would meet it again and handle it."""
        # One shared connection (in-memory SQLite): nothing to open ahead,
        # and one warm-up transaction at a time.
        shared = isinstance(self.app.engine.pool, StaticPool | SingletonThreadPool)
        count = 1 if shared else min(self.concurrency, _WARM_CONNECTIONS)
        holding = threading.Barrier(count)
        try:
            await asyncio.gather(*(
                self.pools.handler(warm_up, self.app, self.dedupe, holding)
                for _ in range(count)))
        except Exception as exc:
            holding.abort()
            log_trouble(log, "warming up", exc, "warming up the worker's connections failed: %s",
                        exc)

    async def _consume(self) -> None:
        """Hand every delivery to a task of its own.  Whatever a broker or
        database client raises (an outage, a driver's own bug) ends this
        round only: logged, and consumption starts again after a jittered
        backoff.  A configuration error stops the worker (it would fail the
        same way every time)."""
        backoff = 0.1
        while True:
            try:
                # Closed here, not when collected: a backend gives back what
                # it read and never handed on before the broker closes.
                async with _closing(self.broker.consume(
                        self.queues, self.prefetch, wanted=self.wanted)) as deliveries:
                    async for delivery in deliveries:
                        try:
                            if not await self._room_for(delivery):
                                continue  # handed to another worker
                        except asyncio.CancelledError:  # stopping: never handled here
                            self.broker.release(delivery)
                            raise
                        self._in_hand += 1
                        self._log.flush()  # counts of errors that stopped a while ago
                        if self.runner.take(delivery, self.app.clock.now()):
                            continue
                        turn = None if delivery.message is None else self._turns.take(
                            "" if self.concurrency == 1 else delivery.message.ordering_key())
                        self._spawn(delivery, turn)
                backoff = 0.1
            except ConfigurationError:
                raise
            except Exception as exc:
                wait = backoff * (0.5 + random.random())
                self._log.warning(f"consume:{kind_of(exc)}", "consuming failed (%s: %s); "
                                  "retrying in %.1fs", type(exc).__name__, exc, wait,
                                  exc_info=not isinstance(exc, DueboxError))
                await asyncio.sleep(wait)
                backoff = min(backoff * 2, 10.0)

    async def _room_for(self, delivery: Delivery) -> bool:
        """Wait until the worker wants another delivery in hand (True) — or,
        while every thread of it runs a long handler, hand this one to
        another worker at once instead of holding it until one ends (False:
        handed back; a delivery with an ordering key keeps its place here)."""
        while self._in_hand >= self.wanted():
            if (self.runner.free() == 0 and self.concurrency > 1
                    and (delivery.message is None
                         or delivery.message.ordering_key() == delivery.message.id_text)
                    and await self.runner.hand_back(delivery)):
                return False
            self._room.clear()
            await self._room.wait()
        return True

    def _spawn(self, delivery: Delivery, turn: Turn | None) -> None:
        t = asyncio.create_task(self._guarded(delivery, turn))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # --- the runner's outcomes (consumers/runner.py, Outcomes) ---------------------------

    def run_usual(self, delivery: Delivery) -> None:
        """A delivery the runner will not run: the usual way."""
        self._spawn(delivery, None)

    def let_go(self, deliveries: int) -> None:
        """That many deliveries left the worker's hands: room for more."""
        self._in_hand -= deliveries
        self._room.set()

    def wake_intake(self) -> None:
        self._room.set()
        self.broker.wanted_changed()

    def count_group(self, size: int) -> None:
        self.stats.grouped += size
        self.metrics.group_size.labels(self.backend).observe(size)

    def count_reruns(self, handlers: int) -> None:
        self.stats.reran += handlers

    def count_handed_back(self, jobs: int) -> None:
        self.stats.handed_back += jobs

    async def _guarded(self, delivery: Delivery, turn: Turn | None = None) -> None:
        try:
            await self.handle(delivery, turn)
        except Exception as exc:
            # The job stays leased; lease recovery publishes it again.  The
            # broker's message is handed back for later rather than left
            # unacked, where it would hold a prefetch slot until the channel
            # closes (RabbitMQ's consumer_timeout is 30 minutes).
            self._log.warning(f"delivery:{kind_of(exc)}", "delivery failed (%s: %s); the job's "
                              "lease will expire and it will be retried", type(exc).__name__,
                              exc, exc_info=not isinstance(exc, DueboxError))
            with contextlib.suppress(Exception):
                if delivery.claimed is not None or await self.broker.defer(
                        delivery, _RETRY_DELIVERY_SECONDS) is False:
                    await self.broker.ack(delivery)
        finally:
            if turn is not None:
                turn.pass_on()
            self.let_go(1)

    # --- one delivery ----------------------------------------------------------

    async def handle(self, delivery: Delivery, turn: Turn | None = None) -> None:
        """Start, hold, run and settle one delivery.  ``turn``: its place among
        deliveries of its ordering key (consumers/turns.py), taken on arrival."""
        self.stats.received += 1
        self._received.inc()
        msg = delivery.message
        if msg is None:
            undecoded = delivery.decode_reason
            self._discard(undecoded)
            self._log.warning(f"reject:{undecoded}", "rejected a message that is not a duebox "
                              "message (%s): %s", undecoded, delivery.decode_error)
            await self.broker.reject(delivery, delivery.decode_error or undecoded)
            return
        clock = self.app.clock
        ahead = (msg.due_at - clock.now()).total_seconds()  # seconds before its due time
        if ahead > EARLY_HOLD_SECONDS and delivery.claimed is None:
            # Held or deferred only if the job table says it may wait.
            checked = await self._early(delivery, msg)
            if checked is None:
                return
            ahead = checked
        rec = delivery.claimed
        obtained = delivery.claimed_at
        if rec is None:
            obtained = clock.now()  # no later than the start itself
            # A message a moment early (the relay publishes near-due jobs just
            # ahead, to cover the hand-over) is started now, version-checked
            # and leased, and its handler held below: the round trip is done
            # by the due time instead of after it.
            # A failover (a batch of the lane lost with it, or the start
            # itself cut): started once a server takes writes again, not
            # handed back to the broker for _RETRY_DELIVERY_SECONDS.
            rec, reason = await until_answered(
                lambda: self.starts.start(msg, max(0.0, ahead)), _RETRY_DELIVERY_SECONDS)
            if rec is None:
                if reason is Discard.NOT_DUE:
                    checked = await self._early(delivery, msg)
                    if checked is not None:  # due by now after all: look again shortly
                        await self._defer(delivery, msg, max(checked, _MIN_DEFER_SECONDS))
                elif reason is not None:  # (never None when no record came back)
                    self._discard(reason)
                    await self.broker.reject(delivery, reason)
                return
        # Whether the executor thread reads the job again and holds it to its
        # due time (see _checks_in_thread), rather than this task.
        in_thread = False
        if obtained is not None and obtained < rec.due_at - REREAD_LEAD:
            # Leased well before its due time: a cancel or a takeover since
            # then must still win, so the job is read again — a round trip
            # before the due time, not after it (the window left is the one
            # every start has between its check and the handler; a cancel
            # landing there finds the completion fenced and rolls the
            # writes back).
            in_thread = self._checks_in_thread(rec)
            if not in_thread or rec.due_at - clock.now() > EXECUTOR_HOLD_MOST:
                await _hold_until(clock, rec.due_at - REREAD_LEAD)
            if not in_thread:
                if not await self.rereads.call(rec):
                    self._discard(Discard.CANCELLED)
                    await self.broker.ack(delivery)
                    return
                obtained = clock.now()
        if not in_thread:
            await _hold_until(clock, rec.due_at)
        started = clock.now()
        try:
            task = self.app.get_task(rec.task)
            check_stored_payload(rec.payload)
        except ValidationError as exc:
            # Nothing here can run it (no such task, or a stored payload that
            # is not JSON): dead-letter it with the reason.
            self._observe_start(rec, started)
            orphan = Task(name=rec.task, fn=_no_handler, queue=rec.queue,
                          secret_keys=self.app.settings.secret_keys)
            outcome = await self.pools.db(
                Execution(self.app, orphan, rec, self.name, self.dedupe, self.pools).settle,
                Verdict(FailureClass.PERMANENT), str(exc))
            self.stats.dead += 1
            self._observe_outcome(rec, outcome, started)
            await self.broker.ack(delivery)
            return
        if rec.expired(clock.now()):
            await self.pools.db(self._expire, rec)
            self._discard(Discard.EXPIRED)
            await self.broker.ack(delivery)
            return
        if turn is not None:
            await turn.wait()
            # Handed over before this task next yields (Runner.run_leased
            # queues it at once): the next of its key cannot overtake it.
            turn.pass_on()
        # A broker's message goes back with its job if the job is given back
        # (a sql:// claim is the job's row itself).
        by_broker = delivery.claimed is None
        status = await self._execute(task, rec, obtained, in_thread, message_back=by_broker)
        if status is RunStatus.HANDED_BACK:
            if await self.runner.hand_back(delivery):
                return  # with its job: another worker starts it
            if by_broker:  # the broker kept it after all: a relay publishes the job again
                try:
                    await self.pools.db(self._requeue, rec)
                except DatabaseError as exc:
                    self._log.warning(f"requeue:{kind_of(exc)}", "could not return job %s to "
                                      "the relay (%s); recovery publishes it again", rec.id, exc)
        await self.broker.ack(delivery)

    async def _early(self, delivery: Delivery, msg: JobMessage) -> float | None:
        """A message that came before its due time, checked against the job
        table before it is held or deferred: one for no job, a stale version
        or a finished job is discarded (forged or replayed messages must not
        occupy the broker or the worker); one whose job is not due within
        the hold window is deferred to the *job's* due time.  Returns the
        seconds until that due time when the job is to be started now."""
        reason, due_at = await self.starts.check_early(msg)
        if reason is not None or due_at is None:
            reason = reason or Discard.UNKNOWN_JOB
            self._discard(reason)
            await self.broker.reject(delivery, reason)
            return None
        ahead = (due_at - self.app.clock.now()).total_seconds()
        if ahead > EARLY_HOLD_SECONDS:
            await self._defer(delivery, msg, ahead)
            return None
        return ahead

    async def _defer(self, delivery: Delivery, msg: JobMessage, seconds: float) -> None:
        """Hand the message back to the broker for ``seconds``; if the broker
        cannot take it back, the job goes back to the job table (the relay
        publishes it when due) and the message is dropped: never a loop."""
        self.stats.deferred += 1
        self.metrics.deferred.labels(self.backend).inc()
        # ``is False``: a backend of another package whose defer() predates
        # the bool (returns None) still counts as having taken it back.
        if await self.broker.defer(delivery, seconds) is not False:
            return
        await self.pools.db(self.starts.give_back, msg)
        self._discard(Discard.DEFER_REFUSED)
        await self.broker.ack(delivery)

    def _checks_in_thread(self, rec: jobstore.JobRecord) -> bool:
        """Whether a job handed over before its due time can be read again
        and held to its due time by the executor that runs it (see
        Execution): a sync handler without a timeout, a job that cannot
        expire meanwhile, a clock a thread can wait for by sleeping."""
        task = self.app.tasks.get(rec.task)
        return (task is not None and not task.is_async and task.timeout is None
                and rec.expires_at is None and self._real_time)

    def wanted(self) -> int:
        """Deliveries to have in hand: see :meth:`Runner.wanted`."""
        return self.runner.wanted()

    def _discard(self, reason: str) -> None:
        self.stats.discarded[reason] += 1
        self.metrics.discarded.labels(self.backend, reason).inc()
        if reason in _DUPLICATE_REASONS:
            self.stats.duplicates += 1
            self.metrics.duplicates.labels(self.backend, reason).inc()

    def _give_back(self, records: list[jobstore.JobRecord]) -> None:
        with db_errors("give back"), self.app.engine.begin() as conn:
            jobstore.unclaim_run(conn, records=records, now=self.app.clock.now())

    def _requeue(self, rec: jobstore.JobRecord) -> None:
        with db_errors("requeue"), self.app.engine.begin() as conn:
            jobstore.requeue_handed_back(conn, rec=rec, now=self.app.clock.now())

    def _expire(self, rec: jobstore.JobRecord) -> None:
        with self.app.engine.begin() as conn:
            dispatch_marks.expire(conn, owner=rec.lease_owner or "", ids=[rec.id],
                            now=self.app.clock.now())

    async def _execute(self, task: Task, rec: jobstore.JobRecord, leased: datetime | None,
                       in_thread: bool = False, message_back: bool = False) -> RunStatus:
        with tracing.attempt_span(rec.task, rec.queue, rec.id, rec.attempt, rec.headers) as span:
            outcome, started = await self.runner.run_leased(task, rec, leased, early=in_thread,
                                                            message_back=message_back)
            tracing.outcome(span, outcome.status, None if outcome.failure_class is None
                            else str(outcome.failure_class))
        self._account(rec, outcome, started)
        return outcome.status

    def account(self, batch: Sequence[Settled]) -> None:
        """Jobs one batch of the lane ran (deliveries', or due rows it
        locked): succeeded ones are observed together, per queue (two
        histograms and a counter per job, one at a time, were a tenth of
        the worker's time per job); the rest one by one."""
        st = self.stats
        n = len(batch)
        st.received += n
        st.laned += n
        self._received.inc(n)
        by_queue: dict[str, list[tuple[jobstore.JobRecord, datetime]]] = {}
        for delivery, rec, outcome, started in batch:
            st.direct += delivery is None
            if outcome.status is RunStatus.SUCCEEDED:
                by_queue.setdefault(rec.queue, []).append((rec, started))
            else:
                self._account(rec, outcome, started)
        finished = self.app.clock.now()
        for queue, done in by_queue.items():
            lateness, queue_wait, ran, succeeded, end_to_end = self._queue_metrics(queue)
            observe_many(lateness, [seconds(started, rec.due_at) for rec, started in done])
            observe_many(queue_wait, [seconds(started, _available(rec)) for rec, started in done])
            observe_many(ran, [seconds(finished, started) for _, started in done])
            observe_many(end_to_end, [seconds(finished, rec.due_at) for rec, _ in done])
            succeeded.inc(len(done))
            st.succeeded += len(done)
            if self.job_lines.enabled:
                for rec, started in done:
                    self.job_lines.write(rec, RunStatus.SUCCEEDED, started, finished)

    def _account(self, rec: jobstore.JobRecord, outcome: Outcome, started: datetime) -> None:
        if outcome.status in (RunStatus.RELEASED, RunStatus.HANDED_BACK):  # never started
            return
        if outcome.status is RunStatus.CANCELLED:  # seen under the group's lock, before it ran
            self._discard(Discard.CANCELLED)
            return
        self._observe_start(rec, started)
        self._observe_outcome(rec, outcome, started)
        st = self.stats
        if outcome.status is RunStatus.SUCCEEDED:
            st.succeeded += 1
        elif outcome.status is RunStatus.DUPLICATE:
            st.succeeded += 1
            st.duplicates += 1
        elif outcome.status is RunStatus.LEASE_LOST:
            st.lease_lost += 1
        elif outcome.status is RunStatus.INTERRUPTED:
            st.interrupted += 1
        else:
            st.failed += 1
            st.throttled += outcome.failure_class == FailureClass.THROTTLED
            st.retried += outcome.status is RunStatus.RETRIED
            st.dead += outcome.status is RunStatus.DEAD


    # --- observability -----------------------------------------------------------

    def _info(self) -> dict[str, Any]:
        st = self.stats
        return {"role": "worker", "backend": self.backend, "queues": self.queues,
                "concurrency": self.concurrency, "received": st.received,
                "succeeded": st.succeeded, "failed": st.failed, "dead": st.dead,
                "throttled": st.throttled, "lease_lost": st.lease_lost,
                "interrupted": st.interrupted,
                "laned": st.laned, **self._lane_info(), **self.broker.registry_info()}

    def _lane_info(self) -> dict[str, Any]:
        """sql://: whether the batch lane claims due jobs itself right now,
        and how many it ran so (docs/worker.md, "The batch lane")."""
        claims = self.runner.claims
        return {} if claims is None else {"lane_leads": claims.leading,
                                           "direct": self.stats.direct}

    def _queue_metrics(self, queue: str) -> tuple[Any, Any, Any, Any, Any]:
        """The per-queue metric children every job touches (start lateness,
        queue wait, run time of successes, successes, end to end):
        ``labels()`` per job was a good part of the worker's bookkeeping."""
        found = self._by_queue.get(queue)
        if found is None:
            m, b = self.metrics, self.backend
            found = self._by_queue[queue] = (
                m.start_lateness.labels(b, queue), m.queue_wait.labels(b, queue),
                m.execution.labels(b, queue, "succeeded"), m.succeeded.labels(b, queue),
                m.end_to_end.labels(b, queue))
        return found

    def _observe_start(self, rec: jobstore.JobRecord, started: datetime) -> None:
        lateness, queue_wait, *_ = self._queue_metrics(rec.queue)
        lateness.observe(seconds(started, rec.due_at))
        queue_wait.observe(seconds(started, _available(rec)))

    def _observe_outcome(self, rec: jobstore.JobRecord, outcome: Outcome,
                         started: datetime) -> None:
        m, b, q = self.metrics, self.backend, rec.queue
        finished = self.app.clock.now()
        if self.job_lines.enabled:
            self.job_lines.write(rec, outcome.status, started, finished)
        _, _, ran, succeeded, end_to_end = self._queue_metrics(q)
        if outcome.status is not RunStatus.SUCCEEDED:
            ran = m.execution.labels(b, q, outcome.status)
        ran.observe(seconds(finished, started))
        if outcome.status in (RunStatus.SUCCEEDED, RunStatus.DUPLICATE):
            succeeded.inc()
            end_to_end.observe(seconds(finished, rec.due_at))
            if outcome.status is RunStatus.DUPLICATE:
                m.duplicates.labels(b, "dedupe").inc()
        elif outcome.status is RunStatus.LEASE_LOST:
            m.lease_lost.labels(b, q).inc()
        else:
            # No failure class: the attempt was lost, not failed by its handler.
            cls = str(outcome.failure_class or (SystemFailure.LOST if outcome.status in (
                RunStatus.INTERRUPTED, RunStatus.DEAD) else "unknown"))
            m.failed.labels(b, q, cls).inc()
            if outcome.status is RunStatus.RETRIED:
                m.retried.labels(b, q).inc()
            elif outcome.status is RunStatus.DEAD:
                m.dead.labels(b, q, cls).inc()


@contextlib.asynccontextmanager
async def _closing(stream: AsyncIterator[Delivery]) -> AsyncGenerator[AsyncIterator[Delivery]]:
    """``stream``, closed on the way out if it can be (a backend's consume
    is an async generator whose ``finally`` gives back what it holds)."""
    try:
        yield stream
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def _available(rec: jobstore.JobRecord) -> datetime:
    """When the job could first be started: due, and handed to the broker."""
    if rec.published_at is not None and rec.published_at > rec.due_at:
        return rec.published_at
    return rec.due_at


async def _hold_until(clock: Clock, due_at: datetime) -> None:
    """Invariant 1: a handler never starts before its due time.  Started or
    claimed a moment ahead, the job waits here, on the app's clock (a test's
    fake clock moves when slept on), until that clock agrees it is due."""
    while (wait := (due_at - clock.now()).total_seconds()) > 0:
        await clock.sleep(wait)


# Connections opened before the first job: one per executor, up to the
# engine's default pool size (more would be closed again on their return).
_WARM_CONNECTIONS = 10


def _no_handler(payload: Any, ctx: Any) -> None:  # pragma: no cover - never called
    raise RuntimeError("no handler")
