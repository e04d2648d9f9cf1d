"""Where every job a worker runs meets a thread: work in, outcomes out.

Work comes as :class:`~.batch.Item` s of three kinds (consumers/batch.py):
a job the usual path started (or ``sql://`` claimed), a delivery whose job
was never started (the batch lane), and — on ``sql://`` — due rows the
runner locks itself.  At most ``concurrency`` run at once, each on a thread
(an executor); every free thread takes the next *unit* the runner forms
from what waits, by the worker's :class:`~.policy.Policy`:

- a started job alone (consumers/execution.py), or, while at least
  ``GROUP_LEAST`` of them wait, a batch of them;
- lane deliveries as a batch (one transaction, no start before it), spread
  over the threads that may take one;
- ``sql://``: due rows, when the lane leads and some are thought to wait.

Outcomes go out as they come: a started job's to the coroutine awaiting it,
the lane's to the worker's :class:`Outcomes` (accounted together, their
messages acknowledged together).

**No job waits for another job's handler while a thread is free.**  Units
are cut from what waits, never held back to gather; and a watchdog looks at
every running handler two hundred times a second.  One that has run past its
straggler time (``Policy.straggler_after``) is *long*: its thread is no
longer counted as free (so the worker takes in less, :meth:`wanted`, and a
lane batch stuck on it no longer counts against the lane's), and if it runs
in a batch, the batch lets it go (``Batch.detach``): the jobs behind it go
back in line for the free threads, the ones before it are committed.

Deliveries handed over a moment before their due time (Redis, RabbitMQ and
Kafka hand over ``HANDOVER_LEAD_SECONDS`` early, ``sql://`` its claimed jobs
``SQL_HANDOVER_LEAD`` early) wait here on one timer until
``LANE_LOCK_LEAD`` before their due time, then join the line; the batch
holds each handler to its due time in its thread (core/timing.py says why
a cancel still wins).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Protocol

from duebox.brokers.base import Broker, Delivery, LaneClaims
from duebox.clock import follows_real_time
from duebox.db import db_errors
from duebox.leases import jobstore
from duebox.leases.holding import Hold
from duebox.message import ORDERING_KEY_HEADER, stored_payload_ok
from duebox.observability.logs import CollapsedLog, kind_of
from duebox.observability.trouble import log_trouble
from duebox.tasks import Task
from duebox.timing import HANDOVER_GATHER, LANE_HOLD_MOST, LANE_LOCK_LEAD
from duebox.wait_any import wait_any

from .batch import Batch, Batches, BatchOutcome, Item, Kind, Running
from .dedupe import SQLDedupeStore
from .execution import Execution, Outcome, Pools, RunStatus
from .policy import Policy

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.worker")

# (delivery — none for a job the lane locked itself —, its job's record,
# outcome, handler start): one settled lane job; a batch's are accounted for
# together.
Settled = tuple[Delivery | None, jobstore.JobRecord, Outcome, datetime]

_EVER = datetime.max.replace(tzinfo=UTC)  # stopping: every held delivery, in due order
# A started job that waited longer than this for a thread is read again
# before it runs alone (a cancel may have landed).
_REREAD_AFTER = timedelta(milliseconds=500)
# How often the watchdog looks at the running handlers.
_WATCH_EVERY = 0.005


class Outcomes(Protocol):
    """The worker's side of the runner."""

    def account(self, batch: Sequence[Settled]) -> None:
        """Lane jobs the runner ran (one batch's, or the part of it a
        detach committed)."""

    def run_usual(self, delivery: Delivery) -> None:
        """A delivery the runner will not run: the worker's usual path
        (which then accounts for it)."""

    def let_go(self, deliveries: int) -> None:
        """That many lane deliveries were acknowledged: room for more."""

    def wake_intake(self) -> None:
        """A thread was freed, or stopped running a straggler: the worker
        may take more in (:meth:`Runner.wanted`)."""

    def count_group(self, size: int) -> None:
        """That many jobs ran in one transaction together."""

    def count_reruns(self, handlers: int) -> None:
        """That many handlers will run a second time: their batch was lost."""

    def count_handed_back(self, jobs: int) -> None:
        """That many jobs went back for other workers (every thread here ran
        a long handler)."""


class _Unit:
    """One thread's work: a job alone or a batch; ``long`` once its running
    handler is a straggler."""

    __slots__ = ("batch", "detaching", "execution", "lane", "long", "seen", "task")

    def __init__(self, *, batch: Batch | None = None, lane: bool = False) -> None:
        self.batch = batch
        self.execution: Execution | None = None
        self.lane = lane  # a lane batch (counts against batches_at_once while short)
        self.long = False
        # The batched handler the watchdog last looked at: ``long`` is its.
        self.seen: Running | None = None
        self.task: asyncio.Task[None] | None = None
        # Letting its straggler go (Batch.detach), once begun.
        self.detaching: asyncio.Task[Callable[[], Awaitable[None]] | None] | None = None


class Runner:
    def __init__(self, app: Duebox, name: str, broker: Broker, dedupe: SQLDedupeStore,
                 pools: Pools, concurrency: int, group: int, outcomes: Outcomes, *,
                 lane: bool, queues: Sequence[str] = (),
                 reread: Callable[[jobstore.JobRecord], Awaitable[bool]]) -> None:
        self.app = app
        self.name = name
        self.broker = broker
        self.pools = pools
        self.concurrency = concurrency
        self.policy = Policy(concurrency, group if group > 1 else 1)
        self.batches = Batches(app, name, dedupe, self.policy, pools)
        self.dedupe = dedupe
        self.outcomes = outcomes
        self.reread = reread
        self.queues = list(queues) or None
        self.lane = lane
        clock = app.clock
        self._holds = follows_real_time(clock)
        # Started jobs waiting for a thread (they hold leases: they go first),
        # and lane items (deliveries, claimed sql:// jobs) waiting for a batch.
        self._leased: deque[Item] = deque()
        self._lane: deque[Item] = deque()
        # Lane deliveries ahead of their due time, by due time, and the one
        # timer that moves them into line.
        self._ahead: Hold[Item] = Hold()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_for: datetime | None = None
        self._scheduled = False
        self._units: set[_Unit] = set()
        self._watch: asyncio.TimerHandle | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._freed = asyncio.Event()
        self._log = CollapsedLog(log)
        # sql://: the backend's lane claims (None elsewhere), and whether due
        # rows are thought to wait for the lane (see pull()).
        self.claims: LaneClaims | None = broker.lane_claims() if lane else None
        self._more_due = False
        # Whether the broker takes a delivery back (Broker.hand_back): known
        # after the first try.
        self._hands_back = True
        self._handing_back: set[asyncio.Task[None]] = set()

    @staticmethod
    def lane_enabled(broker: Broker, dialect: str, concurrency: int, group: int) -> bool:
        """Whether a worker with these settings runs a batch lane at all: a
        broker that promptly returns what a dead consumer held (a worker
        that dies mid-batch leaves nothing changed in the database, and its
        messages come back within the crash-recovery bound), off SQLite
        (which takes its write lock at the first write, after the lane's
        read), with more than one thread and group commit on."""
        return (broker.capabilities.prompt_redelivery and dialect != "sqlite"
                and concurrency > 1 and group > 1)

    # --- how much work to take in --------------------------------------------------

    def free(self) -> int:
        """Threads not running a straggler."""
        return self.concurrency - sum(u.long for u in self._units)

    def wanted(self) -> int:
        """Deliveries to have in hand (started or claimed, running or waiting
        for a thread): per thread not held by a straggler, one and as many
        more as it runs within the batch budget at the batched handlers'
        pace (Policy.extra_per_thread).  A worker whose every thread runs a
        straggler takes nothing more: other workers take it."""
        return self.free() * (1 + self.policy.extra_per_thread())

    # --- the usual path: started jobs ---------------------------------------------------

    async def run_leased(self, task: Task, rec: jobstore.JobRecord,
                         leased: datetime | None = None, *, early: bool = False,
                         message_back: bool = False) -> tuple[Outcome, datetime]:
        """Run one started job; its outcome and when its handler started.
        ``leased``: when the job was last known to be this worker's.  Run
        alone after waiting longer than ``_REREAD_AFTER`` since, it is read
        again first (a cancel may have landed); in a batch the lock does
        that.  ``early``: handed over before its due time (a sync handler on
        a clock that follows real time): read again and held to the due time
        in the executor thread, whether alone or in a batch.
        ``message_back``: a broker's delivery, whose message the caller
        hands back if the job is given back (outcome ``handed_back``)."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        item = Item(task, rec, Kind.LEASED, future=future, leased=leased, early=early,
                    message_back=message_back)
        if not self._leased and self._busy() < self.concurrency:
            # A thread is free and nobody waits: run it in the caller's task
            # rather than one of its own.
            unit = _Unit()
            self._units.add(unit)
            self._watching()
            try:
                await self._alone(item, unit)
            finally:
                self._ended(unit)
            return future.result(), item.started or self.app.clock.now()
        self._leased.append(item)
        self._dispatch()
        if self._leased and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.create_task(self._renew_waiting())
        outcome = await future
        return outcome, item.started or self.app.clock.now()

    def release_waiting(self) -> list[jobstore.JobRecord]:
        """Stopping: the started jobs still waiting for a thread, which will
        not run here; each waiter gets the outcome ``released``."""
        waiting = list(self._leased)
        self._leased.clear()
        for item in waiting:
            _settle(item, Outcome(RunStatus.RELEASED))
        return [item.rec for item in waiting if item.rec is not None]

    # --- the batch lane: deliveries ------------------------------------------------------

    def take(self, delivery: Delivery, now: datetime) -> bool:
        """Take the delivery into the lane if it qualifies; False: it goes
        the usual way.  It must be a decodable message, due or handed over
        at most LANE_HOLD_MOST ahead (a claimed ``sql://`` job: not
        expired, its stored payload readable), of a task the policy lets
        take the lane (Policy.laneable)."""
        if not self.lane:
            return False
        msg, rec = delivery.message, delivery.claimed
        if msg is None:
            return False
        early = msg.due_at > now
        if early and (not self._holds or msg.due_at - now > LANE_HOLD_MOST):
            return False
        if rec is not None and (rec.expired(max(now, msg.due_at)) or not stored_payload_ok(rec)):
            return False  # the usual path expires it or dead-letters it
        task = self.app.tasks.get(msg.task)
        if task is None or not self.policy.laneable(task, msg.headers):
            return False
        if rec is not None and self.claims is not None and not self.claims.leading:
            self.claims.leads(True)  # due jobs of short tasks: the lane claims them
        item = (Item(task, rec, Kind.LEASED, delivery=delivery, leased=delivery.claimed_at,
                     early=rec.due_at > now) if rec is not None
                else Item(task, None, Kind.UNSTARTED, message=msg, delivery=delivery))
        if early and msg.due_at - LANE_LOCK_LEAD > now:
            self._ahead.push(msg.due_at, item)
            self._arm()
            return True
        self._lane.append(item)
        self._schedule()
        return True

    def _arm(self) -> None:
        """One timer, for the earliest held delivery's lock time."""
        earliest = self._ahead.earliest()
        if earliest is None:
            return
        at = earliest - LANE_LOCK_LEAD
        if self._timer is not None:
            if self._timer_for is not None and self._timer_for <= at:
                return
            self._timer.cancel()
        delay = max(0.0, (at - self.app.clock.now()).total_seconds())
        self._timer = asyncio.get_running_loop().call_later(delay, self._release_held)
        self._timer_for = at

    def _release_held(self, everything: bool = False) -> None:
        """Held deliveries whose lock time has come, with those due within
        HANDOVER_GATHER after them, join the line (``everything``: all of
        them, when stopping); the timer is set for the next."""
        self._timer = self._timer_for = None
        until = self.app.clock.now() + LANE_LOCK_LEAD + HANDOVER_GATHER
        self._lane.extend(self._ahead.take_all(_EVER if everything else until))
        self._schedule()
        self._arm()

    def _schedule(self) -> None:
        # After the deliveries that arrived together are all in line: the
        # consumer hands over what its client has buffered without yielding.
        if not self._scheduled and self._lane:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        self._dispatch()

    # --- threads -------------------------------------------------------------------------

    def _busy(self) -> int:
        return len(self._units)

    def _lane_batches(self) -> int:
        """Lane batches running whose handler is not a straggler."""
        return sum(1 for u in self._units if u.lane and not u.long)

    def _dispatch(self) -> None:
        """Every free thread takes the next unit (see the module notes)."""
        while self._busy() < self.concurrency:
            if self._leased:
                self._start_leased()
            elif self._lane and self._lane_batches() < self.policy.batches_at_once(
                    self.concurrency - self._busy() + self._lane_batches()):
                self._start_lane_batch()
            elif (self.claims is not None and self.claims.leading and self._more_due
                  and self._lane_batches() < self.policy.batches_at_once(
                      self.concurrency - self._busy() + self._lane_batches())):
                self._start(Batch(self.batches, Kind.DUE, limit=self.policy.group,
                                  queues=self.queues), lane=True)
                self._more_due = False  # until this batch says it took all it asked for
            else:
                break
        if self._busy() >= self.concurrency and self.free() == 0:
            self._hand_back_waiting()

    def _ended(self, unit: _Unit) -> None:
        """A unit's thread is free: the next unit, and room for more work."""
        self._units.discard(unit)
        self._freed.set()
        self._dispatch()
        self.outcomes.wake_intake()

    def _start_leased(self) -> None:
        head = self._leased.popleft()
        if (not head.alone and self.policy.groups(head.task)
                and self._groupable_waiting() >= self.policy.group_least - 1):
            free = self.concurrency - self._busy()
            size = self.policy.batch_size(len(self._leased) + 1, free)
            items = [head]
            while (self._leased and len(items) < max(size, self.policy.group_least)
                   and not self._leased[0].alone and self.policy.groups(self._leased[0].task)):
                items.append(self._leased.popleft())
            self._start(Batch(self.batches, Kind.LEASED, items), lane=False)
            return
        unit = _Unit()
        unit.task = asyncio.create_task(self._alone_unit(head, unit))
        self._units.add(unit)
        self._watching()

    def _groupable_waiting(self) -> int:
        """How many of the waiting started jobs could join a batch with the
        head just taken (at most enough to decide)."""
        n = 0
        for item in self._leased:
            if n >= self.policy.group_least or item.alone or not self.policy.groups(item.task):
                break
            n += 1
        return n

    def _start_lane_batch(self) -> None:
        threads = self.policy.batches_at_once(self.concurrency - self._busy()
                                              + self._lane_batches())
        size = self.policy.batch_size(len(self._lane), max(1, threads - self._lane_batches()))
        # Claimed (sql://) and unstarted deliveries take different
        # statements: a batch is of one kind.
        kind = self._lane[0].kind
        items: list[Item] = []
        while self._lane and len(items) < size and self._lane[0].kind is kind:
            items.append(self._lane.popleft())
        self._start(Batch(self.batches, kind, items), lane=True)

    def _start(self, batch: Batch, *, lane: bool) -> None:
        unit = _Unit(batch=batch, lane=lane)
        self._units.add(unit)
        unit.task = asyncio.create_task(self._batch_unit(batch, unit))
        self._watching()

    async def _alone_unit(self, item: Item, unit: _Unit) -> None:
        try:
            await self._alone(item, unit)
        finally:
            self._ended(unit)

    async def _alone(self, item: Item, unit: _Unit) -> None:
        assert item.rec is not None
        execution = unit.execution = Execution(
            self.app, item.task, item.rec, self.name, self.dedupe, self.pools,
            check_first=item.early)
        try:
            if (not item.early and item.leased is not None
                    and self.app.clock.now() - item.leased > _REREAD_AFTER
                    and not await self.reread(item.rec)):
                outcome = Outcome(RunStatus.CANCELLED)
            else:
                item.started = self.app.clock.now()
                outcome = await execution.run()
                if execution.handler_seconds is not None:
                    self.policy.ran(item.task.name, execution.handler_seconds, batched=False)
                item.started = execution.started or item.started
        except Exception as exc:
            if item.future is not None and not item.future.done():
                item.future.set_exception(exc)
            elif item.delivery is not None:  # the usual path meets it and says what
                self.outcomes.run_usual(item.delivery)
            return
        if item.delivery is not None:  # a lane item run alone (a lost batch's)
            await self._settle_lane([(item, outcome)])
        else:
            _settle(item, outcome)

    async def _batch_unit(self, batch: Batch, unit: _Unit) -> None:
        try:
            result: BatchOutcome | None = None
            lost: BaseException | None = None
            try:
                result = await self.pools.handler(batch.run)
            except Exception as exc:
                lost = exc
            # What letting its straggler go settled comes out first; its
            # heartbeats end with it.
            stop = await unit.detaching if unit.detaching is not None else None
            if stop is not None:
                await stop()
            if result is None:
                await self._batch_lost(batch, lost or RuntimeError("lost"))
            else:
                await self._after_batch(batch, result)
        finally:
            self._ended(unit)

    async def _after_batch(self, batch: Batch, result: BatchOutcome) -> None:
        """What a batch (or its detach) settled goes out; what it did not run
        goes back in line, or the usual way."""
        for item in reversed(result.unrun):  # still due: first in line again
            if item.kind is Kind.DUE:
                self._more_due = True  # its rows are due again, for the next pull
            elif item.delivery is not None:
                self._lane.appendleft(item)
            else:
                self._leased.appendleft(item)
        for item in result.skipped:
            if item.delivery is not None:
                self.outcomes.run_usual(item.delivery)
        if batch.kind is Kind.DUE:
            self._pulled(batch, result)
        if len(result.done) > 1:
            self.outcomes.count_group(len(result.done))
        done = result.done
        if batch.detach_failed:  # its start was rolled back: it runs again
            done = [(i, o) for i, o in done if not self._again(batch, i, o)]
        lane = [(i, o) for i, o in done if i.future is None]
        for item, outcome in done:
            if item.future is not None:
                _settle(item, outcome)
        self._dispatch()
        if lane:
            await self._settle_lane(lane)

    def _again(self, batch: Batch, item: Item, outcome: Outcome) -> bool:
        """The straggler of a batch whose detach failed, its job never
        started after all (its completion found no lease): a delivery goes
        the usual way, a due row to the next pull."""
        if item is not batch.detached or item.kind is Kind.LEASED or (
                outcome.status is not RunStatus.LEASE_LOST):
            return False
        if item.kind is Kind.DUE:
            self._more_due = True
        elif item.delivery is not None:
            self.outcomes.run_usual(item.delivery)
        return True

    async def _settle_lane(self, done: Sequence[tuple[Item, Outcome]]) -> None:
        self.outcomes.account([(i.delivery, i.rec, o, i.started or self.app.clock.now())
                               for i, o in done if i.rec is not None])
        deliveries = [i.delivery for i, _ in done if i.delivery is not None]
        try:
            await self.broker.ack_many(deliveries)
        finally:
            self.outcomes.let_go(len(deliveries))

    async def _batch_lost(self, batch: Batch, exc: BaseException,
                          items: Sequence[Item] | None = None) -> None:
        """Nothing of the batch happened (``items``: of these of its jobs):
        each job goes again, alone — started ones here, deliveries the usual
        way, due rows to the next pull — a handler that ran, a second time."""
        items = batch.items if items is None else items
        ran = sum(item.ran for item in items if item is not batch.detached)
        if ran:
            self.outcomes.count_reruns(ran)
        else:
            self._log.warning(f"batch:{kind_of(exc)}", "a batch of %d jobs failed (%s: %s); "
                              "each goes again", len(items), type(exc).__name__, exc)
        for item in reversed(items):
            if item is batch.detached:
                # Its own completion failed (the database went away): its
                # job stays leased until recovery takes it back.
                if item.future is not None and not item.future.done():
                    item.future.set_exception(exc)
                elif item.delivery is not None:
                    self.outcomes.run_usual(item.delivery)  # which finds it running, and drops it
                continue
            item.ran = False
            if item.kind is Kind.DUE:
                self._more_due = True
            elif item.kind is Kind.UNSTARTED:
                if item.delivery is not None:
                    self.outcomes.run_usual(item.delivery)
            else:  # started or claimed: leased, run alone
                item.alone = True
                self._leased.appendleft(item)
        if self._leased and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.create_task(self._renew_waiting())

    # --- every thread long: what waits goes to other workers -------------------------------

    def _hand_back_waiting(self) -> None:
        """Every thread runs a straggler: what waits for one would wait for
        a long handler to end.  Another worker should have it now — a lane
        delivery through the broker (Broker.hand_back), a started job back
        to the job table (its message acknowledged: published or claimed
        again).  Kept: jobs with an ordering key (their line is here), and
        everything on a worker of one thread (one line for all)."""
        if self.concurrency == 1:
            return
        if self._hands_back:
            if self._ahead:
                if self._timer is not None:
                    self._timer.cancel()
                self._release_held(everything=True)
            waiting = [i for i in self._lane if i.delivery is not None]
            self._lane = deque(i for i in self._lane if i.delivery is None)
            for item in waiting:
                task = asyncio.create_task(self._hand_back(item))
                self._handing_back.add(task)
                task.add_done_callback(self._handing_back.discard)
        started = [i for i in self._leased if i.future is not None and i.rec is not None
                   and not _keyed(i)]
        if started:
            self._leased = deque(i for i in self._leased if i not in started)
            task = asyncio.create_task(self._give_back(started))
            self._handing_back.add(task)
            task.add_done_callback(self._handing_back.discard)

    async def hand_back(self, delivery: Delivery) -> bool:
        """Give ``delivery`` to the broker for another worker (every thread
        here runs a long handler); False if the broker keeps what it
        delivered (then it is known for the rest of this run) or failed."""
        if not self._hands_back:
            return False
        try:
            taken = await self.broker.hand_back(delivery)
        except Exception as exc:
            self._log.warning(f"hand-back:{kind_of(exc)}", "could not hand a job back to the "
                              "broker (%s: %s); it runs here", type(exc).__name__, exc)
            return False
        if not taken:
            self._hands_back = False
            return False
        self.outcomes.count_handed_back(1)
        return True

    async def _hand_back(self, item: Item) -> None:
        assert item.delivery is not None
        if not await self.hand_back(item.delivery):  # run it here after all
            self._lane.appendleft(item)
            self._dispatch()
            return
        self.outcomes.let_go(1)

    async def _give_back(self, items: list[Item]) -> None:
        # A job whose message goes back to its broker too (Worker.handle) is
        # ENQUEUED, not SCHEDULED: a relay would publish it a second time.
        back = self._hands_back
        by_message = [i.rec for i in items if i.rec is not None and i.message_back and back]
        by_relay = [i.rec for i in items if i.rec is not None and not (i.message_back and back)]
        try:
            await self.pools.db(self._unclaim, by_relay, by_message)
        except Exception as exc:  # they wait here for a thread instead
            self._log.warning(f"give-back:{kind_of(exc)}", "could not give %d waiting jobs "
                              "back (%s: %s); they run here", len(items), type(exc).__name__, exc)
            self._leased.extendleft(reversed(items))
            self._dispatch()
            return
        for item in items:  # their messages: handed back too (Worker.handle)
            _settle(item, Outcome(RunStatus.HANDED_BACK))
        self.outcomes.count_handed_back(len(items))

    def _unclaim(self, by_relay: list[jobstore.JobRecord],
                 by_message: list[jobstore.JobRecord]) -> None:
        now = self.app.clock.now()
        with db_errors("give back"), self.app.engine.begin() as conn:
            jobstore.unclaim_run(conn, records=by_relay, now=now)
            jobstore.unclaim_run(conn, records=by_message, now=now, message_back=True)

    # --- the watchdog ----------------------------------------------------------------------

    def _watching(self) -> None:
        if self._watch is None:
            self._watch = asyncio.get_running_loop().call_later(_WATCH_EVERY, self._look)

    def _look(self) -> None:
        """Every running handler past its straggler time makes its thread
        long; a batch lets such a handler go if it can."""
        self._watch = None
        now = time.monotonic()
        changed = False
        for unit in self._units:
            if unit.batch is not None:
                running = unit.batch.running
                if running is not unit.seen and unit.detaching is None:
                    # Another handler of the batch (or none, between two):
                    # whether the thread is long is that one's to say.
                    unit.seen = running
                    if unit.long:
                        unit.long, changed = False, True
                if unit.long or running is None or (
                        now - running.began <= self.policy.straggler_after(
                            running.item.task.name)):
                    continue
                unit.long = changed = True
                self.policy.straggled()
                if running.gate.begin_detach():
                    unit.detaching = asyncio.create_task(self._detach(unit.batch, running))
                else:  # it wrote into the batch's transaction: the batch waits for it
                    self.policy.held_batch(running.item.task.name)
            elif unit.execution is not None and not unit.long:
                # The handler's own time: a job alone waiting for its commit
                # (SQLite's one writer) is not running a long handler.
                execution = unit.execution
                began = execution.began
                if (began is not None and execution.handler_seconds is None
                        and now - began > self.policy.straggler_after(execution.task.name,
                                                                      batched=False)):
                    unit.long = changed = True
        if changed:  # threads held by stragglers: as good as freed for the rest
            self._freed.set()
            self._dispatch()
            self.outcomes.wake_intake()
        if self._units:
            self._watch = asyncio.get_running_loop().call_later(_WATCH_EVERY, self._look)

    async def _detach(self, batch: Batch, running: Running
                      ) -> Callable[[], Awaitable[None]] | None:
        """Let the straggler go; the straggler's heartbeats' stop, once it
        is a job alone."""
        try:
            result = await self.pools.db(batch.detach, running)
        except Exception as exc:
            # The batch's transaction is gone: what ran in it runs again; the
            # straggler's completion finds its job not leased.
            self._log.warning(f"detach:{kind_of(exc)}", "letting a straggler's batch commit "
                              "without it failed (%s: %s)", type(exc).__name__, exc)
            await self._batch_lost(batch, exc, batch.lost_with_detach)
            return None
        await self._after_batch(batch, result)
        execution = running.control.execution
        return execution.keep_leased() if execution is not None else None

    # --- waiting started jobs keep their leases ---------------------------------------------

    async def _renew_waiting(self) -> None:
        """Jobs waiting for a thread are leased (started or claimed) but no
        handler heartbeats them yet: renew their leases together, every
        third of the lease, while any wait."""
        every = self.app.settings.lease_seconds / 3
        while self._leased:
            await asyncio.sleep(every)
            cutoff = self.app.clock.now() - timedelta(seconds=every)
            stale = [i.rec for i in self._leased if i.rec is not None
                     and (i.leased is None or i.leased < cutoff)]
            if not stale:
                continue
            try:
                renewed = await self.pools.db(self._renew, stale)
            except Exception as exc:  # the next round tries again
                log_trouble(log, "renewing leases", exc,
                            "renewing the leases of %d waiting jobs failed: %s", len(stale), exc)
                continue
            now = self.app.clock.now()
            for item in self._leased:
                if item.rec is not None and item.rec.id in renewed:
                    item.leased = now

    def _renew(self, records: list[jobstore.JobRecord]) -> set[uuid.UUID]:
        with db_errors("renew"), self.app.engine.begin() as conn:
            now = self.app.clock.now()
            until = now + timedelta(seconds=self.app.settings.lease_seconds)
            return jobstore.renew_leases(conn, records, now=now, until=until)

    # --- sql://: due rows locked by the runner itself ----------------------------------------

    async def pull(self) -> None:
        """While the worker consumes (cancelled when it stops): whenever the
        lane leads and due rows are thought to wait — the claimer saw some,
        the last batch took all it asked for, or a poll interval passed —
        free threads take batches of them."""
        claims = self.claims
        if claims is None:
            return
        poll = self.app.settings.poll_interval
        while True:
            if claims.leading and self._more_due:
                self._dispatch()
            await wait_any(poll, claims.wake, self._freed)
            if claims.wake.is_set() or not self._freed.is_set():  # the claimer, or the poll
                self._more_due = True
            claims.wake.clear()
            self._freed.clear()

    def _pulled(self, batch: Batch, result: BatchOutcome) -> None:
        claims = self.claims
        if claims is None:
            return
        if result.locked >= batch.limit:
            self._more_due = True  # it took all it asked for: more may be due
        if result.leased:
            claims.adopt(result.leased, batch.created)
            if len(result.leased) > len(result.done):
                claims.leads(False)  # mostly not the lane's jobs: the claimer takes them

    # --- stopping ------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Stopping: run what is in the lane's line (due, or held to its due
        time by the executor) and wait for every unit of the runner's own
        (the usual path's jobs run in their callers' tasks)."""
        if self._timer is not None:
            self._timer.cancel()
        self._release_held(everything=True)
        self.claims = None  # no more pulls
        while True:
            self._dispatch()
            own = {u.task for u in self._units if u.task is not None}
            if own:
                await asyncio.wait(own, return_when=asyncio.FIRST_COMPLETED)
            elif self._lane or self._leased:  # threads busy with the usual path's jobs
                self._freed.clear()
                await self._freed.wait()
            elif self._handing_back:  # before the broker closes under them
                await asyncio.wait(set(self._handing_back))
            else:
                return

    def __len__(self) -> int:
        return len(self._lane) + len(self._ahead)


def _keyed(item: Item) -> bool:
    headers = item.rec.headers if item.rec is not None else None
    return bool(headers and headers.get(ORDERING_KEY_HEADER) not in (None, ""))


def _settle(item: Item, outcome: Outcome) -> None:
    if item.future is not None and not item.future.done():
        item.future.set_result(outcome)
