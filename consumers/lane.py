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
  its stored payload readable);
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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from duebox import jobstore, tracing
from duebox.brokers.base import Broker, Delivery
from duebox.logs import CollapsedLog, kind_of
from duebox.message import ORDERING_KEY_HEADER, JobMessage, stored_payload_ok
from duebox.tasks import Task

from .execution import Outcome, Pools
from .group_commit import Executors, group_commit_budget

log = logging.getLogger("duebox.worker")

# (delivery, its job's record, outcome, handler start): one settled entry.
Settle = Callable[[Delivery, jobstore.JobRecord, Outcome, datetime], None]


@dataclass(eq=False, slots=True)
class _Entry:
    delivery: Delivery
    message: JobMessage
    task: Task


class Lane:
    def __init__(self, name: str, broker: Broker, tasks: Mapping[str, Task],
                 executors: Executors, pools: Callable[[], Pools], group: int, *,
                 usual: Callable[[Delivery], None], settle: Settle,
                 done: Callable[[int], None]) -> None:
        """``usual``: send a delivery the worker's usual way (which then
        accounts for it); ``settle``: account for one the lane ran;
        ``done``: that many of those were acknowledged and left the worker's
        hands."""
        self.name = name
        self.broker = broker
        self.tasks = tasks
        self.executors = executors
        self.pools = pools
        self.group = group
        self._usual = usual
        self._settle = settle
        self._done = done
        self._waiting: deque[_Entry] = deque()
        self._scheduled = False
        self._running: set[asyncio.Task[None]] = set()
        self._active = 0  # batches running
        self._seq = itertools.count()
        self._log = CollapsedLog(log)
        self._freed = asyncio.Event()
        executors.on_free = self._on_free

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
        if msg is None or msg.due_at > now or tracing.enabled():  # spans: the usual path
            return False
        if rec is not None and (rec.expired(now) or not stored_payload_ok(rec)):
            return False  # the usual path expires it or dead-letters it
        task = self.tasks.get(msg.task)
        if (task is None or not self.executors.groups(task) or not self.executors.short(task)
                or (msg.headers and msg.headers.get(ORDERING_KEY_HEADER) not in (None, ""))):
            return False
        self._waiting.append(_Entry(delivery, msg, task))
        self._schedule()
        return True

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

    async def _run(self, batch: list[_Entry]) -> None:
        try:
            if batch[0].delivery.claimed is not None:
                settled, unrun = await self.pools().handler(
                    self.executors.run_claimed,
                    [(e.delivery.claimed, e.task, e.delivery.claimed_at) for e in batch])
            else:
                settled, unrun = await self.pools().handler(
                    self.executors.run_unstarted, [(e.message, e.task) for e in batch],
                    f"{self.name}#lane{next(self._seq)}")
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
        for i, rec, outcome, started in settled:
            self._settle(batch[i].delivery, rec, outcome, started)
        try:
            await asyncio.gather(*(self.broker.ack(batch[i].delivery) for i, *_ in settled))
        finally:
            self._done(len(settled))

    async def drain(self) -> None:
        """Stopping: run what is in line (it is due) and wait for every batch."""
        while self._waiting or self._running:
            self._flush()
            if self._running:
                await asyncio.wait(set(self._running))
            elif self._waiting:  # every executor busy: until one is free
                self._freed.clear()
                await self._freed.wait()

    def __len__(self) -> int:
        return len(self._waiting)
