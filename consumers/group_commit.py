"""Running started jobs: at most ``concurrency`` at once, a backlog of short
ones several per transaction (group commit).

A transaction per job costs a commit (a WAL flush) and a handful of round
trips; with a backlog, that — not the handlers — bounds how many jobs a
worker runs.  While every executor is busy, started jobs queue here; the next
free executor takes up to ``group_commit`` of them and runs them in one
transaction:

1. one statement inserts their dedupe rows; a job whose row was already there
   is a duplicate, closed without running;
2. one statement locks their job rows (in id order) and each lease is checked
   under the lock (owner, generation, version).  A locked row cannot be
   claimed, recovered or cancelled until the commit — the lock is the lease,
   so no heartbeat is needed — and a job cancelled or taken over before it
   does not run at all;
3. each handler runs in its own SAVEPOINT, emitted at its first statement
   through ``ctx.session`` (a handler that never uses it pays no round trip):
   one that raises is rolled back to it and its failure recorded (retry or
   DEAD) in the same transaction; the others are unaffected;
4. two statements complete the succeeded jobs and close their attempts, and
   the commit makes every handler's writes, dedupe rows and completions
   durable together.

A group stops starting handlers once it has run for ``_BUDGET`` seconds: a
slow handler's group commits early, and the jobs it did not start go back to
the front of the queue.  With no backlog, every job runs alone, in a
transaction of its own, as it always did.

A group lost as a whole.  Every lock duebox's own statements need is taken
before the first handler runs (the dedupe rows, then the job rows in id
order; at READ COMMITTED on MySQL/MariaDB, core/db.py, so no gap locks):
after that they only touch the group's own rows — its job rows, locked; its
dedupe rows, inserted; its jobs' attempt rows, which nobody else writes
while the job rows are locked — so they never wait and cannot deadlock.  A
failure before the first handler leaves nothing to repeat: each job then
runs alone, once.  After handlers ran, the transaction
can still be lost by a real fault: the connection or the commit fails, or —
on MySQL/MariaDB only, where InnoDB rolls back the *whole* transaction on a
deadlock, savepoints and all — a handler's own statement deadlocks (on
PostgreSQL and SQLite its savepoint takes that alone).  Their writes are
gone, so those jobs must run again: each runs alone at once, its handler a
second time, logged and counted (``WorkerStats.reran``).  Such a loss is
detected, never committed past: a savepoint that cannot be rolled back to, or
(MySQL/MariaDB) dedupe rows of the group no longer there at its end, raise
:class:`_GroupLost` instead of completing jobs whose writes were rolled back.

Never grouped: ``async def`` handlers (they run on the event loop), tasks
with a ``timeout`` (a shared transaction cannot be cut short for one of
them) and tasks registered with ``group_commit=False``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from duebox import jobstore, unstarted
from duebox.clock import Clock, wait_until
from duebox.db import bound_idle_transaction, db_errors
from duebox.failures import error_line
from duebox.states import LeaseVerdict
from duebox.tasks import Task

from .dedupe import SQLDedupeStore
from .execution import Execution, Outcome, Pools, RunStatus, job_context, record_failure

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.worker")

# A group starts no further handler once it has run this long: its commit
# (and the locks it holds) should not wait on more than a few short jobs.
_BUDGET = 0.05
# Fewer waiting jobs than this run one by one: a group's fixed statements
# (dedupe rows, lock, completion) and a savepoint per handler cost more than
# a job alone (one statement before the handler, one after, the commit)
# until about six jobs share them.  Measured in one thread on PostgreSQL,
# CPU per no-op job: alone 630-850 us; groups of 2: 965-1,460, of 4: ~970,
# of 8: 485-750.
_GROUP_LEAST = 6
# A job that waited longer than this for an executor is read again before it
# runs alone.
_REREAD_AFTER = timedelta(milliseconds=500)


def group_commit_budget() -> float:
    return _BUDGET


@dataclass(eq=False)
class GroupItem:
    task: Task
    rec: jobstore.JobRecord
    # None for the batch lane's items, which nobody awaits one by one.
    future: asyncio.Future[Outcome] | None
    leased: datetime | None = None
    started: datetime | None = field(default=None)
    # Handed over before its due time: its lease is read again and the
    # handler held to the due time in the executor thread (Execution).
    early: bool = False
    # Its handler was called in a group's transaction (which may then be lost).
    ran: bool = False
    # From the batch lane: locked, never started (core/unstarted.py).
    unstarted: bool = False


def _settle(item: GroupItem, outcome: Outcome) -> None:
    if item.future is not None and not item.future.done():
        item.future.set_result(outcome)


class _GroupLost(Exception):
    """The group's transaction was rolled back by the database after
    handlers ran (see the module notes); ``cause``: why."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the group's transaction was lost: {cause}")
        self.cause = cause


class _Unset:
    pass


_UNSET = _Unset()


class _GroupControl:
    """A grouped job's :class:`~duebox.tasks.JobControl`.  Its row is locked by
    the group's transaction, which is the lease: a heartbeat has nothing to
    renew.  A checkpoint is written in that transaction and kept even when
    the handler then fails (written again after its savepoint rolls back)."""

    cancelled = False

    def __init__(self, conn: Connection, rec: jobstore.JobRecord, clock: Clock) -> None:
        self.conn = conn
        self.rec = rec
        self.clock = clock
        self.saved: Any = _UNSET

    def heartbeat(self) -> bool:
        return True

    def checkpoint(self, state: Any) -> bool:
        self.saved = state
        self.write()
        return True

    def write(self) -> None:
        self.conn.execute(jobstore.checkpoint_stmt(self.rec, self.clock.now(), self.saved))


class Executors:
    """At most ``count`` executions at once; while all are busy, started jobs
    wait in order and the next free executor takes up to ``group`` of them."""

    def __init__(self, app: Duebox, worker: str, dedupe: SQLDedupeStore,
                 pools: Callable[[], Pools], count: int, group: int,
                 on_group: Callable[[int], None],
                 reread: Callable[[jobstore.JobRecord], Awaitable[bool]],
                 on_rerun: Callable[[int], None] = lambda n: None) -> None:
        self.app = app
        self.worker = worker
        self.dedupe = dedupe
        self.pools = pools
        self.count = count
        self.group = group
        self.on_group = on_group
        self.on_rerun = on_rerun
        self.reread = reread
        self._pending: deque[GroupItem] = deque()
        self._active = 0
        self._running: set[asyncio.Task[None]] = set()
        # Handler seconds per job, smoothed (None: none ran yet).
        self.pace: float | None = None
        # The same per task, from every run (alone: its commit included).
        self.task_pace: dict[str, float] = {}
        self._renewer: asyncio.Task[None] | None = None
        # Called when an executor may be free for the batch lane.
        self.on_free: Callable[[], None] = lambda: None

    def groups(self, task: Task) -> bool:
        return (self.group > 1 and task.group_commit and task.timeout is None
                and not task.is_async)

    async def run(self, task: Task, rec: jobstore.JobRecord, leased: datetime | None = None,
                  *, early: bool = False) -> tuple[Outcome, datetime]:
        """Run one started job; its outcome and when its handler started.
        ``leased``: when the job was last known to be this worker's.  Run
        alone after waiting longer than ``_REREAD_AFTER`` since, it is read
        again first (a cancel may have landed); in a group the lock does that.
        ``early``: handed over before its due time (a sync handler on a clock
        that follows real time): read again and held to the due time in the
        executor thread, whether alone or in a group."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        item = GroupItem(task, rec, future, leased, early=early)
        if not self._pending and self._active < self.count:
            # An executor is free and nobody waits: run it in the caller's
            # task rather than one of its own.
            self._active += 1
            try:
                await self._alone(item)
            finally:
                self._active -= 1
                self._dispatch()
            return future.result(), item.started or self.app.clock.now()
        self._pending.append(item)
        self._dispatch()
        if self._pending and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.create_task(self._renew_waiting())
        outcome = await future
        return outcome, item.started or self.app.clock.now()

    def take_slot(self) -> bool:
        """An executor for the batch lane, if one is free and no started job
        waits for one (those hold leases: they go first)."""
        if self._pending or self._active >= self.count:
            return False
        self._active += 1
        return True

    def give_slot(self) -> None:
        self._active -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        self._dispatch_waiting()
        if not self._pending and self._active < self.count:
            self.on_free()

    def _dispatch_waiting(self) -> None:
        while self._pending and self._active < self.count:
            items = [self._pending.popleft()]
            if self.groups(items[0].task) and self._groupable_waiting() >= _GROUP_LEAST:
                while (self._pending and len(items) < self.group
                       and self.groups(self._pending[0].task)):
                    items.append(self._pending.popleft())
            self._active += 1
            t = asyncio.create_task(self._execute(items))
            self._running.add(t)
            t.add_done_callback(self._running.discard)

    async def _execute(self, items: list[GroupItem]) -> None:
        try:
            if len(items) == 1:
                await self._alone(items[0])
                return
            try:
                done, unrun = await self.pools().handler(self.run_group, items)
            except Exception as exc:
                # Rolled back as a whole: none of it happened.  Each job runs
                # alone; a handler that had run in the group runs a second
                # time (see the module notes for when that can happen).
                ran = sum(item.ran for item in items)
                if ran:
                    self.on_rerun(ran)
                    log.warning("a group of %d jobs was rolled back after %d of its handlers "
                                "ran (%s): each job runs again alone, those %d handlers a "
                                "second time", len(items), ran, exc, ran)
                else:
                    log.warning("a group of %d jobs failed before any handler ran (%s); "
                                "running each alone", len(items), exc)
                for item in items:
                    item.ran = False
                    await self._alone(item)
                return
            self.on_group(len(items) - len(unrun))
            for item, outcome in done:
                _settle(item, outcome)
            self._pending.extendleft(reversed(unrun))
        finally:
            self._active -= 1
            self._dispatch()

    def _groupable_waiting(self) -> int:
        """How many of the next waiting jobs could join a group (the one
        just taken included)."""
        n = 1
        for item in self._pending:
            if n >= _GROUP_LEAST or not self.groups(item.task):
                break
            n += 1
        return n

    def release_waiting(self) -> list[jobstore.JobRecord]:
        """Stopping: the jobs still waiting for an executor, which will not
        run here; each waiter gets the outcome ``released``."""
        waiting = list(self._pending)
        self._pending.clear()
        for item in waiting:
            _settle(item, Outcome(RunStatus.RELEASED))
        return [item.rec for item in waiting]

    def _paced(self, seconds: float, task: str) -> None:
        """One grouped handler's run time (alone, a job's time includes its
        own commit, which is what grouping saves: not its pace)."""
        self.pace = seconds if self.pace is None else 0.8 * self.pace + 0.2 * seconds
        self._task_paced(seconds, task)

    def _task_paced(self, seconds: float, task: str) -> None:
        before = self.task_pace.get(task)
        self.task_pace[task] = seconds if before is None else 0.8 * before + 0.2 * seconds

    def short(self, task: Task) -> bool:
        """Whether the task's handlers are known to take less than the group
        budget: the batch lane takes only those (a handler that runs long
        holds its batch's row locks, which are its leases, all that time)."""
        pace = self.task_pace.get(task.name)
        return pace is not None and pace <= _BUDGET

    async def _renew_waiting(self) -> None:
        """Jobs waiting for an executor are leased (started or claimed) but
        no handler heartbeats them yet: renew their leases together, every
        third of the lease, while any wait."""
        every = self.app.settings.lease_seconds / 3
        while self._pending:
            await asyncio.sleep(every)
            cutoff = self.app.clock.now() - timedelta(seconds=every)
            stale = [i.rec for i in self._pending if i.leased is None or i.leased < cutoff]
            if not stale:
                continue
            try:
                renewed = await self.pools().db(self._renew, stale)
            except Exception as exc:  # the next round tries again
                log.warning("renewing the leases of %d waiting jobs failed: %s",
                            len(stale), exc)
                continue
            now = self.app.clock.now()
            for item in self._pending:
                if item.rec.id in renewed:
                    item.leased = now

    def _renew(self, records: list[jobstore.JobRecord]) -> set[uuid.UUID]:
        with db_errors("renew"), self.app.engine.begin() as conn:
            now = self.app.clock.now()
            until = now + timedelta(seconds=self.app.settings.lease_seconds)
            return jobstore.renew_leases(conn, records, now=now, until=until)

    async def _alone(self, item: GroupItem) -> None:
        pools = self.pools()
        execution = Execution(self.app, item.task, item.rec, self.worker, self.dedupe, pools,
                              check_first=item.early)
        try:
            if (not item.early and item.leased is not None
                    and self.app.clock.now() - item.leased > _REREAD_AFTER
                    and not await self.reread(item.rec)):
                outcome = Outcome(RunStatus.CANCELLED)
            else:
                item.started = self.app.clock.now()
                began = time.monotonic()
                outcome = await execution.run()
                self._task_paced(time.monotonic() - began, item.task.name)
                item.started = execution.started or item.started
        except Exception as exc:
            if item.future is not None and not item.future.done():
                item.future.set_exception(exc)
            return
        _settle(item, outcome)

    # --- in an executor thread ----------------------------------------------------

    def run_group(self, items: list[GroupItem]
                  ) -> tuple[list[tuple[GroupItem, Outcome]], list[GroupItem]]:
        with db_errors("group commit"), Session(self.app.engine) as session, session.begin():
            conn = session.connection()
            bound_idle_transaction(conn, self.app.settings.lease_seconds)
            fresh = self.dedupe.claim_many(conn, [str(i.rec.id) for i in items],
                                           self.app.clock.now())
            leases = jobstore.lock_leased(conn, [i.rec for i in items])
            return self.run_locked(session, conn, items, leases, fresh)

    def run_locked(self, session: Session, conn: Connection, items: list[GroupItem],
                    leases: dict[uuid.UUID, LeaseVerdict], fresh: set[str]
                    ) -> tuple[list[tuple[GroupItem, Outcome]], list[GroupItem]]:
        """Run the handlers of a group whose rows are locked (``leases``: which
        are still this worker's) and complete those that succeeded."""
        clock = self.app.clock
        done: list[tuple[GroupItem, Outcome]] = []
        unrun: list[GroupItem] = []
        forget: list[str] = []
        succeeded: list[GroupItem] = []
        duplicates: list[GroupItem] = []
        began = time.monotonic()
        for item in items:
            message_id = str(item.rec.id)
            lease = leases[item.rec.id]
            if lease is not LeaseVerdict.HELD:
                if message_id in fresh:
                    forget.append(message_id)
                done.append((item, Outcome(RunStatus.CANCELLED
                                           if lease is LeaseVerdict.CANCELLED
                                           else RunStatus.LEASE_LOST)))
            elif message_id not in fresh:
                duplicates.append(item)
            elif (succeeded or done) and time.monotonic() - began > _BUDGET:
                forget.append(message_id)
                unrun.append(item)
            else:
                failed = self._run_one(session, conn, item)
                if failed is None:
                    succeeded.append(item)
                else:
                    forget.append(message_id)
                    done.append((item, failed))
        now = clock.now()
        self.dedupe.forget_many(conn, forget)
        if succeeded and not self.dedupe.still_claimed(
                conn, [str(i.rec.id) for i in succeeded]):
            # MySQL/MariaDB: the transaction was rolled back under the
            # handlers (a deadlock error a handler swallowed) and the
            # statements since ran in a new one: committing it would
            # complete jobs whose writes are gone.
            raise _GroupLost(RuntimeError("the group's dedupe rows are gone"))
        if items and items[0].unstarted:
            unstarted.finish(conn, [(i.rec, i.started or now, "succeeded") for i in succeeded]
                             + [(i.rec, now, "duplicate") for i in duplicates], now, self.worker)
        else:
            jobstore.complete_locked(conn, [i.rec for i in succeeded], "succeeded", now)
            jobstore.complete_locked(conn, [i.rec for i in duplicates], "duplicate", now)
        done += [(i, Outcome(RunStatus.SUCCEEDED)) for i in succeeded]
        done += [(i, Outcome(RunStatus.DUPLICATE)) for i in duplicates]
        return done, unrun

    def _run_one(self, session: Session, conn: Connection, item: GroupItem) -> Outcome | None:
        """One handler in its savepoint; its failure's outcome, or None."""
        clock = self.app.clock
        control = _GroupControl(conn, item.rec, clock)
        # The session emits the SAVEPOINT lazily, at the handler's first
        # statement through it: a handler that never touches the database
        # costs no round trip for it.  A checkpoint written through ``conn``
        # before that is outside the savepoint, which is where it belongs: it
        # survives a failure (written again below in case the savepoint had it).
        savepoint = session.begin_nested()
        try:
            if item.early:  # its lease was checked under the lock
                wait_until(clock, item.rec.due_at)
            item.started = clock.now()
            began = time.monotonic()
            item.ran = True
            try:
                item.task.fn(item.rec.payload,
                             job_context(item.rec, session, self.worker, control))
            finally:
                self._paced(time.monotonic() - began, item.task.name)
        except Exception as exc:
            try:
                savepoint.rollback()
            except Exception as lost:
                # No savepoint to go back to: the database rolled the whole
                # transaction back (MySQL/MariaDB on a deadlock) or the
                # connection is gone.  Going on would run the rest of the
                # group, and complete it, in a new transaction without the
                # writes of the handlers before this one.
                raise _GroupLost(exc) from lost
            verdict = item.task.classifier.classify(exc)
            if item.unstarted:  # recorded as every failure is: on a started job
                item.rec = control.rec = unstarted.start_one(
                    conn, item.rec, item.started or clock.now(), clock.now(),
                    self.app.settings.lease_seconds, self.worker)
            if control.saved is not _UNSET:
                control.write()
            return record_failure(conn, item.task, item.rec, verdict, error_line(exc),
                                  clock.now(), exc)
        savepoint.commit()
        return None
