"""Several jobs in one transaction: a batch.

A transaction per job costs a commit (a WAL flush) and several round trips;
with a backlog of short jobs that, not the handlers, bounds a worker.  A
batch runs up to ``group_commit`` jobs in one transaction:

1. it locks their rows, in id order, and checks them under the lock — how
   depends on the work's :class:`Kind`:

   - ``LEASED``: jobs this worker started or claimed (``RUNNING``): each
     lease (owner, generation, version) is checked under the lock;
   - ``UNSTARTED``: deliveries whose jobs were never started: their rows
     locked by ``(id, version)``, startable, due, not expired, ``SKIP
     LOCKED`` (core/leases/batch_sql.py) — no start transaction before;
   - ``DUE`` (``sql://``): the due rows themselves, locked as a claim scans
     them; those the batch may not run are leased in it, for the usual path.

   A locked row cannot be claimed, recovered, started or cancelled until the
   commit: the lock is the lease (docs/design.md, "The batch lane's lock is
   the lease");
2. one statement inserts their dedupe rows: a job whose row was already
   there is a duplicate, closed without running;
3. each handler runs with its own SAVEPOINT, taken at its first statement
   through ``ctx.session`` (a handler that never uses it pays no round trip,
   consumers/handler_session.py).  One that raises is rolled back to it and
   its failure recorded (retry or DEAD) in the same transaction;
4. the succeeded jobs are completed together, and one commit makes every
   handler's writes, dedupe rows and completions durable.

A batch starts no handler after the budget (policy.BUDGET); the jobs it
did not start go back to the front of the line.

**A straggler is let go** (:meth:`Batch.detach`).  A handler that runs past
its straggler time would hold every job behind it in the batch.  If it has
not used ``ctx.session`` yet, the batch commits without it, from another
thread, while it runs: the jobs that ran before it are completed, its own
job is started for real (``RUNNING``, leased to this worker, its attempt
opened — exactly what the usual path's start writes), the dedupe rows of
it and of the jobs not yet started are dropped, and the commit releases
every lock.  The jobs not started go back in line and start on other
threads at once; the straggler goes on as a job alone: its later statements
go to a transaction of its own, it is heartbeaten, and its completion is
fenced by its lease like any other (a cancel from now on wins as it does
against a running job).  Nothing of it had been written in the batch's
transaction, so nothing of it is committed by that commit.  A straggler
that had written through ``ctx.session`` holds its batch until it returns:
its writes are in the batch's transaction (policy.py then runs its task
alone for a while).

**A batch lost as a whole.**  Every lock duebox's own statements need is
taken before the first handler runs (the dedupe rows, then the job rows in
id order; READ COMMITTED on MySQL/MariaDB, core/db.py, so no gap locks):
after that they only touch the batch's own rows, so they never wait and
cannot deadlock.  A failure before the first handler leaves nothing to
repeat.  After handlers ran, the transaction can still be lost by a real
fault: the connection or the commit fails, or — MySQL/MariaDB only, where
InnoDB rolls back the *whole* transaction on a deadlock — a handler's own
statement deadlocks (on PostgreSQL and SQLite its savepoint takes that
alone).  Their writes are gone, so those jobs must run again: each once more
(its handler a second time), logged and counted.  Such a loss is detected,
never committed past: a savepoint that cannot be rolled back to, or
(MySQL/MariaDB) dedupe rows of the batch no longer there at its end, raise
:class:`BatchLost` instead of completing jobs whose writes were rolled back.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from duebox.brokers.base import Delivery
from duebox.clock import Clock, wait_until
from duebox.db import bound_idle_transaction, db_errors
from duebox.failures import error_line
from duebox.leases import batch_sql, claims, jobstore
from duebox.message import JobMessage, stored_payload_ok
from duebox.states import LeaseVerdict
from duebox.tasks import Task

from .dedupe import SQLDedupeStore
from .execution import (
    Execution,
    Outcome,
    Pools,
    RunStatus,
    call_handler,
    job_context,
    record_failure,
)
from .handler_session import Attachment, Gate, HandlerSession
from .policy import Policy

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.worker")


class Kind(enum.Enum):
    """What a batch locks its jobs by (see the module notes)."""

    LEASED = "leased"
    UNSTARTED = "unstarted"
    DUE = "due"


@dataclass(eq=False)
class Item:
    """One job on its way to a thread."""

    task: Task
    # LEASED: its leased record; UNSTARTED and DUE: set once locked.
    rec: jobstore.JobRecord | None
    kind: Kind
    # UNSTARTED: the message its row is locked by.
    message: JobMessage | None = None
    # A batch-lane delivery, acknowledged once its job is settled (None: the
    # usual path's, which acknowledges it itself; or a DUE row's).
    delivery: Delivery | None = None
    # The usual path awaits its outcome here.
    future: asyncio.Future[Outcome] | None = None
    # When it was last known to be this worker's (LEASED).
    leased: datetime | None = None
    # Handed over before its due time: held to it in the executor thread.
    early: bool = False
    # LEASED: a broker's delivery (not a sql:// claim), whose message goes
    # back to the broker with it if it is given back (Runner._give_back).
    message_back: bool = False
    started: datetime | None = None
    # Its handler was called in a batch's transaction (which may be lost).
    ran: bool = False
    # Its batch was lost: it runs alone now.
    alone: bool = False


@dataclass
class BatchOutcome:
    """What a batch did, or the part of it its detach settled."""

    done: list[tuple[Item, Outcome]] = field(default_factory=list)
    # Locked, never started (the budget ran out, or a straggler was let go):
    # back to the front of the line.
    unrun: list[Item] = field(default_factory=list)
    # UNSTARTED: not locked (held elsewhere, stale, cancelled): the usual
    # path says why.
    skipped: list[Item] = field(default_factory=list)
    # DUE: rows locked that the batch may not run, leased in its transaction
    # for the usual path.
    leased: list[jobstore.JobRecord] = field(default_factory=list)
    # DUE: how many rows it locked (as many as asked: more may be due).
    locked: int = 0


class BatchLost(Exception):
    """The batch's transaction was rolled back by the database after
    handlers ran (see the module notes); ``cause``: why."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the batch's transaction was lost: {cause}")
        self.cause = cause


class _Unset:
    pass


_UNSET = _Unset()


class BatchControl:
    """A batched job's :class:`~duebox.tasks.JobControl`.  Its row is locked
    by the batch's transaction, which is the lease: a heartbeat has nothing
    to renew.  A checkpoint is written in that transaction and kept even
    when the handler then fails (written again after its savepoint rolls
    back).  Once the batch let the job go, its :attr:`execution` (a job
    alone, leased) answers instead."""

    def __init__(self, conn: Connection, rec: jobstore.JobRecord, clock: Clock,
                 gate: Gate) -> None:
        self.conn = conn
        self.rec = rec
        self.clock = clock
        self.gate = gate
        self.saved: Any = _UNSET
        self.execution: Execution | None = None

    @property
    def cancelled(self) -> bool:
        return self.execution is not None and self.execution.cancelled

    def heartbeat(self) -> bool:
        return True if self.execution is None else self.execution.heartbeat()

    def checkpoint(self, state: Any) -> bool:
        if self.gate.bind() is self.conn:
            self.saved = state
            self.write()
            return True
        self.gate.wait_detached()
        assert self.execution is not None  # set before the detach ends
        return self.execution.checkpoint(state)

    def write(self) -> None:
        self.conn.execute(jobstore.checkpoint_stmt(self.rec, self.clock.now(), self.saved))


@dataclass
class Running:
    """The handler a batch runs now (read by the runner's watchdog)."""

    item: Item
    gate: Gate
    control: BatchControl
    began: float  # monotonic


class Batches:
    """What every batch of one worker shares."""

    def __init__(self, app: Duebox, worker: str, dedupe: SQLDedupeStore, policy: Policy,
                 pools: Pools) -> None:
        self.app = app
        self.worker = worker
        self.dedupe = dedupe
        self.policy = policy
        self.pools = pools
        self._seq = itertools.count()

    def owner(self) -> str:
        """A lease owner of this worker's (``<name>#...``: its jobs are known
        to be its own when it dies, core/processes/takeover.py), unique per batch."""
        return f"{self.worker}#batch{next(self._seq)}"


class Batch:
    """One transaction, several jobs (see the module notes).  :meth:`run`
    runs in an executor thread; :meth:`detach` in another, while
    :meth:`run`'s thread is inside a straggling handler."""

    def __init__(self, shared: Batches, kind: Kind, items: Sequence[Item] = (), *,
                 limit: int = 0, queues: Sequence[str] | None = None) -> None:
        self.shared = shared
        self.kind = kind
        self.items = list(items)
        self.limit = limit  # DUE: rows to lock at most
        self.queues = queues  # DUE: of these queues
        self.owner = shared.owner()
        self.created = shared.app.clock.now()
        # The handler running now, for the watchdog (None between handlers).
        self.running: Running | None = None
        # Set once a straggler was let go: the batch's transaction is no
        # longer this thread's.
        self.detached: Item | None = None
        # Letting it go failed: the batch's transaction was lost with the
        # jobs before it, and the straggler's start with it.
        self.detach_failed = False
        self.lost_with_detach: list[Item] = []
        self._conn: Connection | None = None
        self._fresh: set[str] = set()
        self._succeeded: list[Item] = []
        self._duplicates: list[Item] = []
        self._forget: list[str] = []
        self._done: list[tuple[Item, Outcome]] = []

    # --- in the batch's executor thread ----------------------------------------------

    def run(self) -> BatchOutcome:
        app = self.shared.app
        result = BatchOutcome()
        try:
            with db_errors("batch"):
                conn = self._conn = app.engine.connect()
                try:
                    tx = conn.begin()
                    bound_idle_transaction(conn, app.settings.lease_seconds)
                    self._lock(conn, result)
                    if self.items:
                        now = app.clock.now()
                        self._fresh = self.shared.dedupe.claim_many(
                            conn, [str(i.rec.id) for i in self.items if i.rec is not None], now)
                        self._run_locked(conn, result)
                    if self.detached is None:
                        self._complete(conn)
                        tx.commit()
                finally:
                    if self.detached is None:
                        conn.close()
        except BaseException as exc:
            self._lost(exc)
            raise
        result.done += self._done
        return result

    def _lock(self, conn: Connection, result: BatchOutcome) -> None:
        """Lock the batch's rows and keep, in :attr:`items`, the jobs it will
        run (see :class:`Kind`)."""
        app, now = self.shared.app, self.shared.app.clock.now()
        if self.kind is Kind.LEASED:
            leases = jobstore.lock_leased(conn, [i.rec for i in self.items
                                                 if i.rec is not None])
            held = []
            for item in self.items:
                assert item.rec is not None
                verdict = leases[item.rec.id]
                if verdict is LeaseVerdict.HELD:
                    held.append(item)
                else:
                    self._done.append((item, Outcome(RunStatus.CANCELLED
                                                     if verdict is LeaseVerdict.CANCELLED
                                                     else RunStatus.LEASE_LOST)))
            self.items = held
        elif self.kind is Kind.UNSTARTED:
            messages = [i.message for i in self.items if i.message is not None]
            locked = batch_sql.lock_startable(conn, messages, now, self.owner,
                                              due_by=max(m.due_at for m in messages))
            kept = []
            for item in self.items:
                assert item.message is not None
                # A second copy of a message, or a payload stored undecodable:
                # the usual path (which discards or dead-letters it).
                rec = locked.pop(item.message.job_id, None)
                if rec is not None and stored_payload_ok(rec):
                    # Locked before its due time: the lock is its check, and
                    # its handler waits for the due time (_run_one).
                    item.rec, item.early = rec, rec.due_at > now
                    kept.append(item)
                else:
                    result.skipped.append(item)
            self.items = kept
        else:
            rows = batch_sql.lock_due(conn, now=now, limit=self.limit, queues=self.queues,
                                      owner=self.owner)
            result.locked = len(rows)
            policy, others = self.shared.policy, []
            for rec in rows:
                task = app.tasks.get(rec.task)
                if (task is not None and policy.laneable(task, rec.headers)
                        and not rec.expired(now) and stored_payload_ok(rec)):
                    self.items.append(Item(task, rec, Kind.DUE))
                else:
                    others.append(rec)
            if others:
                result.leased = claims.claim_for_run(
                    conn, owner=self.shared.owner(), now=now, limit=len(others),
                    lease_until=now + timedelta(seconds=app.settings.lease_seconds),
                    queues=None, worker=self.shared.worker, ids=[r.id for r in others])

    def _run_locked(self, conn: Connection, result: BatchOutcome) -> None:
        """Run the locked jobs' handlers, in order, until the budget runs out
        or a straggler is let go."""
        began = time.monotonic()
        session = HandlerSession()
        for n, item in enumerate(self.items):
            assert item.rec is not None
            message_id = str(item.rec.id)
            if message_id not in self._fresh:
                self._duplicates.append(item)
                continue
            budget = self.shared.policy.budget
            if (self._succeeded or self._done) and time.monotonic() - began > budget:
                result.unrun += self.items[n:]
                self._forget += [str(i.rec.id) for i in self.items[n:]
                                 if i.rec is not None and str(i.rec.id) in self._fresh]
                return
            failed = self._run_one(session, conn, item)
            if self.detached is not None:
                self._done.append((item, failed or Outcome(RunStatus.SUCCEEDED)))
                return
            if failed is None:
                self._succeeded.append(item)
            else:
                self._forget.append(message_id)
                self._done.append((item, failed))

    def _run_one(self, session: HandlerSession, conn: Connection, item: Item
                 ) -> Outcome | None:
        """One handler, with its savepoint; its failure's outcome, or None.
        If the batch let it go meanwhile: its outcome as a job alone."""
        assert item.rec is not None
        app, clock = self.shared.app, self.shared.app.clock
        gate = session.gate = Gate(conn, app.engine)
        control = BatchControl(conn, item.rec, clock, gate)
        if item.early:  # its row was checked under the lock
            wait_until(clock, item.rec.due_at)
        item.started = clock.now()
        item.ran = True
        began = time.monotonic()
        self.running = Running(item, gate, control, began)
        # A task that keeps its result never runs in a batch (it does not
        # group): the return value is not wanted here.
        error, _ = call_handler(item.task, item.rec.payload,
                                job_context(item.rec, session, self.shared.worker, control),
                                session)
        attachment = gate.finish()
        self.running = None
        self.shared.policy.ran(item.task.name, time.monotonic() - began, batched=True)
        if attachment is Attachment.DETACHED:
            assert control.execution is not None
            self.detached = item
            try:
                return control.execution.finish(session, error)
            finally:
                session.close()  # its own transaction's connection, back to the pool
        if error is None:
            try:
                session.check_rules(conn if attachment is Attachment.ATTACHED else None)
            except Exception as exc:
                error = exc
        if error is None:
            session.release(keep=True)
            return None
        try:
            session.release(keep=False)
        except Exception as lost:
            # No savepoint to go back to: the database rolled the whole
            # transaction back (MySQL/MariaDB on a deadlock) or the
            # connection is gone.  Going on would run the rest of the batch,
            # and complete it, in a new transaction without the writes of
            # the handlers before this one.
            raise BatchLost(error) from lost
        if conn.invalidated:
            raise BatchLost(error)
        verdict = item.task.classifier.classify(error)
        if item.kind is not Kind.LEASED:  # recorded as every failure is: on a started job
            item.rec = control.rec = batch_sql.start_one(
                conn, item.rec, item.started or clock.now(), clock.now(),
                app.settings.lease_seconds, self.shared.worker)
        if control.saved is not _UNSET:
            control.write()
        return record_failure(conn, item.task, item.rec, verdict, error_line(error),
                              clock.now(), error)

    def _complete(self, conn: Connection) -> None:
        """Drop the dedupe rows of jobs that did not complete here, then
        complete the succeeded ones and close the duplicates."""
        dedupe, now = self.shared.dedupe, self.shared.app.clock.now()
        dedupe.forget_many(conn, self._forget)
        succeeded = [(i, i.rec) for i in self._succeeded if i.rec is not None]
        duplicates = [i.rec for i in self._duplicates if i.rec is not None]
        if succeeded and not dedupe.still_claimed(conn, [str(rec.id) for _, rec in succeeded]):
            # MySQL/MariaDB: the transaction was rolled back under the
            # handlers (a deadlock error a handler swallowed) and the
            # statements since ran in a new one: committing it would
            # complete jobs whose writes are gone.
            raise BatchLost(RuntimeError("the batch's dedupe rows are gone"))
        if self.kind is Kind.LEASED:
            jobstore.complete_locked(conn, [rec for _, rec in succeeded], "succeeded", now)
            jobstore.complete_locked(conn, duplicates, "duplicate", now)
        else:
            batch_sql.finish(conn, [(rec, i.started or now, "succeeded") for i, rec in succeeded]
                             + [(rec, now, "duplicate") for rec in duplicates],
                             now, self.shared.worker)
        self._done += [(i, Outcome(RunStatus.SUCCEEDED)) for i in self._succeeded]
        self._done += [(i, Outcome(RunStatus.DUPLICATE)) for i in self._duplicates]
        self._succeeded, self._duplicates = [], []

    def _lost(self, exc: BaseException) -> None:
        ran = sum(item.ran for item in self.items if item is not self.detached)
        if ran:
            log.warning("a batch of %d jobs was rolled back after %d of its handlers ran "
                        "(%s): each runs again, those %d handlers a second time",
                        len(self.items), ran, exc, ran)

    # --- in another thread, while run()'s is inside a straggler -------------------------

    def detach(self, running: Running) -> BatchOutcome:
        """Commit the batch without its straggling handler (see the module
        notes).  Call only once ``running.gate.begin_detach()`` said yes:
        from then on the handler's thread does not touch the batch's
        connection until :meth:`Gate.end_detach`.  Returns what the commit
        settled (the jobs that ran before it) and the jobs not started,
        back for the line; the straggler's own outcome comes from
        :meth:`run`.  Raises :class:`BatchLost` if the commit failed: the
        straggler's job is then not leased, and its completion finds that."""
        app, clock = self.shared.app, self.shared.app.clock
        item, control, conn = running.item, running.control, self._conn
        assert item.rec is not None
        assert conn is not None
        rec = item.rec
        result = BatchOutcome()
        try:
            with db_errors("batch (letting a straggler go)"):
                now = clock.now()
                lease = item.task.lease_seconds or app.settings.lease_seconds
                if item.kind is Kind.LEASED:
                    jobstore.renew_leases(conn, [rec], now=now,
                                          until=now + timedelta(seconds=lease))
                else:
                    rec = batch_sql.start_one(conn, rec, item.started or now, now, lease,
                                              self.shared.worker)
                position = self.items.index(item)
                later = self.items[position + 1:]
                self._forget += [str(i.rec.id) for i in [item, *later]
                                 if i.rec is not None and str(i.rec.id) in self._fresh]
                self._complete(conn)
                conn.commit()
            result.done, self._done = self._done, []
            result.unrun = later
            # The batch is the straggler alone from now on: the rest is settled
            # or back in line (a later loss of the batch concerns it only).
            self.items = [item]
        except BaseException:
            # Nothing of it happened: every other job of the batch goes
            # again (Runner), and run() answers for the straggler alone.
            self.detach_failed = True
            self.lost_with_detach = [i for i in self.items if i is not item]
            self.items, self._done = [item], []
            with contextlib.suppress(Exception):  # a dropped connection took it already
                conn.rollback()
            raise
        finally:
            # Leased now — or, if the commit failed, not: its completion,
            # fenced by this lease, then finds it lost.
            control.execution = Execution(app, item.task, rec, self.shared.worker,
                                          self.shared.dedupe, self.shared.pools)
            item.rec = rec
            with contextlib.suppress(Exception):
                conn.close()
            self.detached = item
            running.gate.end_detach()
        return result
