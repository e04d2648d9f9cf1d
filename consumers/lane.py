"""The batch lane: deliveries that are due, of tasks that may share a
transaction, run as one unit.

The usual path gives every delivery an asyncio task of its own, a
version-checked start in a transaction of its own (batched with others) and
then a handler transaction: two commits and three row versions per job,
and futures at every step.  Under a backlog that bookkeeping, not the
handlers, bounds a worker.  Here the deliveries that arrive together wait
in one line; the next free executor takes up to ``group_commit`` of them and
in one transaction locks their rows (version-checked, SKIP LOCKED), runs
their handlers each in a savepoint and completes them (core/unstarted.py
says why the lock is the lease).  Then the broker's messages are
acknowledged.

Only what needs nothing else takes the lane:

- a decodable message, already due (a claimed ``sql://`` job: not expired,
  its stored payload readable), or one handed over a moment before its due
  time (Redis and RabbitMQ hand over HANDOVER_LEAD early, ``sql://`` its
  claimed jobs SQL_HANDOVER_LEAD early):
  held here, on one timer for all of them, until LANE_LOCK_LEAD before its
  due time, then locked with its batch and its handler held to the due
  time in the executor (core/timing.py says why a cancel still wins);
- of a task that group commit may run (sync, no timeout, not opted out) and
  whose handlers are known to be short: a handler holds its batch's row
  locks, which are the leases, while it runs, so a task that runs long (or
  has not run yet here) takes the usual path, with heartbeats;
- with no ``ordering_key`` (keys keep their line on the usual path,
  consumers/turns.py), with tracing off (the usual path makes the spans);
- on a broker that promptly redelivers what a dead consumer held
  (``Capabilities.prompt_redelivery``: RabbitMQ when the connection closes,
  Redis once the owner is known dead; ``sql://`` claims rows that lease
  recovery hands back): a worker that dies mid-batch leaves nothing changed
  in the database, and its messages come back within the crash-recovery
  bound.  SQS (a visibility timeout the worker extends) and Kafka (a
  group's session timeout) keep the usual path, whose started jobs the
  relay recovers as soon as their owner is known dead;
- off SQLite, with more than one executor.

A paused worker's batch (SIGSTOP, a network cut) holds its locks: on
PostgreSQL the server ends the session once the transaction has been idle
for ``lease_seconds`` (core/db.py, bound_idle_transaction), and lease expiry
takes over as from any lost worker.  Anything the lane cannot settle — a
row locked by someone else, a stale or cancelled job, a lost transaction —
is handed to the usual path, which knows why and acts on it.

On ``sql://`` nothing needs to be delivered at all (:meth:`Lane.pull`):
once deliveries of short tasks arrive, the lane *leads* — the backend's
claimer takes only jobs not yet due (to hand them over on time) and the
lane locks the due rows itself, in the transaction that runs them
(consumers/lane_runs.py ``run_due``): one row version per job, no claim
transaction.  Rows it locks and may not run are leased in that transaction
and delivered the usual way; when they outnumber the ones it ran, the
lane stops leading and the claimer claims everything again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from duebox import jobstore
from duebox.brokers.base import Broker, Delivery, LaneClaims
from duebox.clock import Clock, follows_real_time
from duebox.holding import Hold
from duebox.logs import CollapsedLog, kind_of
from duebox.message import JobMessage, stored_payload_ok
from duebox.tasks import Task
from duebox.timing import HANDOVER_GATHER, LANE_HOLD_MOST, LANE_LOCK_LEAD
from duebox.waiting import wait_any

from .execution import Outcome, Pools
from .group_commit import group_commit_budget
from .lane_runs import DueBatch, LaneResult, LaneRuns

log = logging.getLogger("duebox.worker")

_GATHER = timedelta(seconds=HANDOVER_GATHER)
_EVER = datetime.max.replace(tzinfo=UTC)  # stopping: every held delivery, in due order

# (delivery — none for a job the lane locked itself —, its job's record,
# outcome, handler start): one settled entry; a batch's are accounted for
# together.
Settled = tuple[Delivery | None, jobstore.JobRecord, Outcome, datetime]
Settle = Callable[[Sequence[Settled]], None]


@dataclass(eq=False, slots=True)
class _Entry:
    delivery: Delivery
    message: JobMessage
    task: Task


class Lane:
    def __init__(self, name: str, broker: Broker, runs: LaneRuns,
                 pools: Callable[[], Pools], group: int, *,
                 usual: Callable[[Delivery], None], settle: Settle,
                 done: Callable[[int], None], queues: Sequence[str] = (),
                 clock: Clock | None = None, poll: float = 1.0) -> None:
        """``usual``: send a delivery the worker's usual way (which then
        accounts for it); ``settle``: account for one the lane ran;
        ``done``: that many of those were acknowledged and left the worker's
        hands.  ``queues``, ``clock``, ``poll``: the worker's, for
        :meth:`pull`."""
        self.name = name
        self.broker = broker
        self.runs = runs
        self.executors = executors = runs.executors
        self.queues = list(queues) or None
        self.clock = clock
        self.poll = poll
        self.pools = pools
        self.group = group
        self._usual = usual
        self._settle = settle
        self._done = done
        self._waiting: deque[_Entry] = deque()
        # Deliveries ahead of their due time, by due time (then arrival), and
        # the one timer that moves them into line (see _release_held).  Only
        # on a clock that runs by itself: the executor sleeps until due.
        self._held: Hold[_Entry] = Hold()
        self._holds = clock is not None and follows_real_time(clock)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_for: datetime | None = None
        self._scheduled = False
        self._running: set[asyncio.Task[None]] = set()
        self._active = 0  # batches running
        self._seq = itertools.count()
        self._log = CollapsedLog(log)
        self._freed = asyncio.Event()
        executors.on_free = self._on_free
        # sql://: the backend's lane claims (None elsewhere), and whether due
        # rows are thought to wait for the lane (see pull()).
        self.claims = broker.lane_claims()
        self._more_due = False

    @staticmethod
    def enabled(broker: Broker, dialect: str, concurrency: int, group: int) -> bool:
        """Whether a worker with these settings runs a lane at all.  SQLite
        takes its write lock at the first write, after the lane's read: it
        keeps the usual path."""
        return (broker.capabilities.prompt_redelivery and dialect != "sqlite"
                and concurrency > 1 and group > 1)

    def take(self, delivery: Delivery, now: datetime) -> bool:
        """Take the delivery into the lane if it qualifies (see the module
        notes); False: it goes the usual way."""
        msg, rec = delivery.message, delivery.claimed
        if msg is None:
            return False
        early = msg.due_at > now
        if early and (not self._holds or msg.due_at - now > LANE_HOLD_MOST):
            return False
        if rec is not None and (rec.expired(max(now, msg.due_at)) or not stored_payload_ok(rec)):
            return False  # the usual path expires it or dead-letters it
        task = self.runs.app.tasks.get(msg.task)
        if task is None or not self.runs.runnable(task, msg.headers):
            return False
        if rec is not None and self.claims is not None and not self.claims.leading:
            self.claims.leads(True)  # due jobs of short tasks: the lane claims them
        entry = _Entry(delivery, msg, task)
        if early and msg.due_at - LANE_LOCK_LEAD > now:
            self._held.push(msg.due_at, entry)
            self._arm()
            return True
        self._waiting.append(entry)
        self._schedule()
        return True

    def _arm(self) -> None:
        """One timer, for the earliest held delivery's lock time."""
        earliest = self._held.earliest()
        if earliest is None or self.clock is None:
            return
        at = earliest - LANE_LOCK_LEAD
        if self._timer is not None:
            if self._timer_for is not None and self._timer_for <= at:
                return
            self._timer.cancel()
        delay = max(0.0, (at - self.clock.now()).total_seconds())
        self._timer = asyncio.get_running_loop().call_later(delay, self._release_held)
        self._timer_for = at

    def _release_held(self, everything: bool = False) -> None:
        """Held deliveries whose lock time has come, with those due within
        HANDOVER_GATHER after them, one batch (``everything``: all of them,
        when stopping), join the line; the timer is set for the next."""
        self._timer = self._timer_for = None
        if self.clock is None:
            return
        until = self.clock.now() + LANE_LOCK_LEAD + _GATHER
        self._waiting.extend(self._held.take_all(_EVER if everything else until))
        self._schedule()
        self._arm()

    def _on_free(self) -> None:
        self._freed.set()
        self._schedule()

    def _schedule(self) -> None:
        # After the deliveries that arrived together are all in line: the
        # consumer hands over what its client has buffered without yielding.
        if not self._scheduled and self._waiting:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _most_at_once(self) -> int:
        """Batches to run at once.  Short handlers: two — one runs while the
        next fills — so deliveries gather into large batches instead of each
        taking an executor and a transaction of its own.  Handlers too slow
        for a full batch within the group budget: as many as executors."""
        pace = self.executors.pace
        if pace is None or pace * self.group <= group_commit_budget():
            return 2
        return self.executors.count

    def _flush(self) -> None:
        self._scheduled = False
        while (self._waiting and self._active < self._most_at_once()
               and self.executors.take_slot()):
            self._active += 1
            # Claimed and unclaimed deliveries (one backend gives one kind)
            # take different statements: a batch is of one kind.
            claimed = self._waiting[0].delivery.claimed is not None
            batch: list[_Entry] = []
            while (self._waiting and len(batch) < self.group
                   and (self._waiting[0].delivery.claimed is not None) == claimed):
                batch.append(self._waiting.popleft())
            t = asyncio.create_task(self._run(batch))
            self._running.add(t)
            t.add_done_callback(self._running.discard)

    def _owner(self) -> str:
        """A lease owner of this worker's (``<name>#...``: its jobs are
        known to be its own when it dies, core/takeover.py), unique per batch."""
        return f"{self.name}#lane{next(self._seq)}"

    async def _run(self, batch: list[_Entry]) -> None:
        settled: list[LaneResult]
        unrun: list[int]
        try:
            if batch[0].delivery.claimed is not None:
                settled, unrun = await self.pools().handler(
                    self.runs.run_claimed,
                    [(e.delivery.claimed, e.task, e.delivery.claimed_at) for e in batch])
            else:
                settled, unrun = await self.pools().handler(
                    self.runs.run_unstarted, [(e.message, e.task) for e in batch],
                    self._owner())
        except Exception as exc:  # nothing of it happened: every entry the usual way
            self._log.warning(f"lane:{kind_of(exc)}", "a batch of %d jobs failed (%s: %s); "
                              "each goes the usual way", len(batch), type(exc).__name__, exc)
            settled, unrun = [], []
        finally:
            self._active -= 1
            self.executors.give_slot()
        handled = {i for i, *_ in settled}
        for i in reversed(unrun):  # still due: first in line again
            self._waiting.appendleft(batch[i])
            handled.add(i)
        self._schedule()
        for i, entry in enumerate(batch):
            if i not in handled:
                self._usual(entry.delivery)
        if len(settled) > 1:  # run in one transaction with others: a group
            self.executors.on_group(len(settled))
        self._settle([(batch[i].delivery, rec, outcome, started)
                      for i, rec, outcome, started in settled])
        try:
            await self.broker.ack_many([batch[i].delivery for i, *_ in settled])
        finally:
            self._done(len(settled))

    # --- sql://: due rows locked by the lane itself ---------------------------

    async def pull(self) -> None:
        """While the worker consumes (cancelled when it stops): whenever the
        lane leads and due rows are thought to wait — the claimer saw some,
        the last batch was full, or a poll interval passed — run batches of
        them, as many at once as :meth:`_most_at_once` allows."""
        claims = self.claims
        if claims is None:
            return
        while True:
            if claims.leading and self._more_due:
                self._pull_batches(claims)
            await wait_any(self.poll, claims.wake, self._freed)
            if claims.wake.is_set() or not self._freed.is_set():  # the claimer, or the poll
                self._more_due = True
            claims.wake.clear()
            self._freed.clear()

    def _pull_batches(self, claims: LaneClaims) -> None:
        while (self._more_due and self._active < self._most_at_once()
               and self.executors.take_slot()):
            self._active += 1
            t = asyncio.create_task(self._pull_one(claims))
            self._running.add(t)
            t.add_done_callback(self._running.discard)

    async def _pull_one(self, claims: LaneClaims) -> None:
        claimed_at = self.clock.now() if self.clock is not None else None
        try:
            batch: DueBatch = await self.pools().handler(
                self.runs.run_due, self.queues, self.group, self._owner(), self._owner)
        except Exception as exc:  # changed nothing: the rows stay due, looked at next poll
            self._more_due = False
            self._log.warning(f"lane:{kind_of(exc)}", "a batch of due jobs failed (%s: %s); "
                              "trying again shortly", type(exc).__name__, exc)
            return
        finally:
            self._active -= 1
            self.executors.give_slot()
        if batch.locked < self.group:
            self._more_due = False  # drained: the claimer wakes the lane for more
        if batch.leased:
            claims.adopt(batch.leased, claimed_at or batch.leased[0].due_at)
            if len(batch.leased) > len(batch.settled):
                claims.leads(False)  # mostly not the lane's jobs: the claimer takes them
        if len(batch.settled) > 1:
            self.executors.on_group(len(batch.settled))
        self._settle([(None, rec, outcome, started) for _, rec, outcome, started in batch.settled])
        self._pull_batches(claims)

    async def drain(self) -> None:
        """Stopping: run what is in line (due, or held to its due time by the
        executor) and wait for every batch."""
        if self._timer is not None:
            self._timer.cancel()
        self._release_held(everything=True)
        while self._waiting or self._running:
            self._flush()
            if self._running:
                await asyncio.wait(set(self._running))
            elif self._waiting:  # every executor busy: until one is free
                self._freed.clear()
                await self._freed.wait()

    def __len__(self) -> int:
        return len(self._waiting) + len(self._held)
