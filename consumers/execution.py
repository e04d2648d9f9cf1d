"""Running one started job: handler, dedupe row and completion in one
transaction; heartbeat, checkpoint, timeout and cancellation around it;
failures classified and settled (retry later or dead-letter), all fenced by
the lease the start returned."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from duebox import dlq
from duebox.clock import wait_until
from duebox.db import NOTIFY_CHANNEL, SQLITE_DEFERRED, db_errors
from duebox.errors import DatabaseError, LeaseLostError, ValidationError
from duebox.failures import (
    FailureClass,
    HandlerAbortError,
    SystemFailure,
    Verdict,
    bounded_traceback,
    error_line,
)
from duebox.ids import uuid7
from duebox.leases import jobstore
from duebox.masking import masked_text
from duebox.observability.logs import job_fields, log_traced
from duebox.observability.trouble import log_trouble
from duebox.reads import results
from duebox.states import LeaseVerdict
from duebox.tasks import JobContext, JobControl, Task

from .dedupe import SQLDedupeStore
from .handler_session import HandlerSession
from .settling import unreachable, until_written

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.worker")

T = TypeVar("T")


class Pools:
    """Where blocking work runs.  Handlers get a pool as large as the worker's
    concurrency; the worker's own short database calls (start, heartbeat,
    settle) get a separate one, so busy handlers can never starve the
    heartbeats that keep their leases (which would let a healthy job be
    taken over and run again).  Until :meth:`start` (and after
    :meth:`shutdown`) both are the event loop's default executor."""

    def __init__(self) -> None:
        self._handlers: ThreadPoolExecutor | None = None
        self._control: ThreadPoolExecutor | None = None

    def start(self, concurrency: int) -> None:
        self._handlers = ThreadPoolExecutor(concurrency, thread_name_prefix="duebox-handler")
        self._control = ThreadPoolExecutor(4, thread_name_prefix="duebox-db")

    def handler(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self._handlers, fn, *args)

    def db(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self._control, fn, *args)

    def shutdown(self) -> None:
        # A timed-out sync handler may still be running: do not wait for it.
        pools, self._handlers, self._control = (self._handlers, self._control), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


class _Duplicate(Exception):
    """Raised inside the handler's transaction to roll it back."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__("duplicate")
        self.outcome = outcome


class _Cut(Exception):
    """Raised out of an async handler's transaction: a lost connection cut
    it (``error``: what the handler raised)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _BadResult(Exception):
    """Raised inside an async handler's transaction to roll it back: its
    return value cannot be kept (duebox.reads.results)."""

    def __init__(self, error: ValidationError) -> None:
        super().__init__(str(error))
        self.error = error


class RunStatus(StrEnum):
    """What became of one execution."""

    SUCCEEDED = "succeeded"
    DUPLICATE = "duplicate"  # its effects were already committed (dedupe): not run twice
    RETRIED = "retried"
    DEAD = "dead"
    LEASE_LOST = "lease_lost"  # another process took the job over: nothing recorded
    CANCELLED = "cancelled"  # seen before it ran (a job held ahead of its due time)
    RELEASED = "released"  # the worker is stopping: given back, never started
    HANDED_BACK = "handed_back"  # every thread ran a long handler: given back, for others
    # Its own transaction was cut (the database connection lost: a failover),
    # nothing of it committed: back to SCHEDULED at once, its attempt lost.
    INTERRUPTED = "interrupted"


@dataclass
class Outcome:
    """What became of one execution, for the worker's counters."""

    status: RunStatus
    failure_class: FailureClass | None = None


class Execution:
    """One attempt of one job.  Also the handler's :class:`JobControl`."""

    def __init__(self, app: Duebox, task: Task, rec: jobstore.JobRecord, worker: str,
                 dedupe: SQLDedupeStore, pools: Pools | None = None,
                 check_first: bool = False) -> None:
        self.pools = pools or Pools()
        # Handed over a moment before its due time (a sync handler, a clock
        # that follows real time): the executor thread reads the lease again,
        # waits for the due time itself, then runs the handler — one thread
        # hand-off instead of three, and a start to the tenth of a millisecond.
        self.check_first = check_first
        self.started: datetime | None = None
        # When the handler was called (monotonic): the runner's watchdog
        # tells a straggler by it.
        self.began: float | None = None
        # How long the handler itself ran (its commit not included).
        self.handler_seconds: float | None = None
        self.app = app
        self.task = task
        self.rec = rec
        self.worker = worker
        self.dedupe = dedupe
        self.lease = task.lease_seconds or app.settings.lease_seconds
        self.cancelled = False
        self._lock = threading.Lock()
        # Whether duebox's own statements after an async handler (its
        # completion) are under way: a lost connection there cut the job's
        # transaction, not the handler (_cut).
        self.completing = False
        # When the lease runs out (time.monotonic()), as last renewed: how
        # long a write that found no server is tried again (settling.py).
        self.held_until = time.monotonic() + self.lease

    # --- JobControl ------------------------------------------------------------

    def heartbeat(self) -> bool:
        if self.cancelled:
            return False
        with self._lock, db_errors("heartbeat"), self.app.engine.begin() as conn:
            now = self.app.clock.now()
            until = now + timedelta(seconds=self.lease)
            ok = conn.execute(jobstore.heartbeat_stmt(self.rec, now, until)).rowcount == 1
        if not ok:
            self.cancelled = True
        else:
            self.held_until = time.monotonic() + self.lease
        return ok

    def checkpoint(self, state: Any) -> bool:
        with self._lock, db_errors("checkpoint"), self.app.engine.begin() as conn:
            stmt = jobstore.checkpoint_stmt(self.rec, self.app.clock.now(), state)
            ok = conn.execute(stmt).rowcount == 1
        if not ok:
            self.cancelled = True
        return ok

    # --- running -----------------------------------------------------------------

    def context(self, session: Any) -> JobContext:
        return job_context(self.rec, session, self.worker, self)

    async def run(self) -> Outcome:
        stop = self.keep_leased()
        try:
            return await self._run_with_timeout()
        finally:
            await stop()

    def keep_leased(self) -> Callable[[], Awaitable[None]]:
        """Renew the lease every third of it while the handler runs; the
        returned coroutine function stops that.  The heartbeat task is
        created only once a third of the lease has passed: most handlers are
        done long before, and a task per job (created, cancelled, awaited)
        was a good part of the event loop's work per job."""
        beats: list[asyncio.Task[None]] = []
        later = asyncio.get_running_loop().call_later(
            self.lease / 3, lambda: beats.append(asyncio.create_task(self._beat())))

        async def stop() -> None:
            later.cancel()
            for beat in beats:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
        return stop

    async def _run_with_timeout(self) -> Outcome:
        work = self._run_async() if self.task.is_async else self.pools.handler(self.run_sync)
        try:
            if self.task.timeout is None:
                return await work
            try:
                async with asyncio.timeout(self.task.timeout) as scope:
                    return await work
            except TimeoutError:
                if not scope.expired():
                    raise
                # A sync handler's thread cannot be stopped: it is told through
                # ctx.cancelled, and its completion finds the lease gone.  Told
                # only once the failure is recorded (the lease moved on): told
                # first, a handler that stops when told returned and completed
                # its job — cut short, as SUCCEEDED — before the failure was
                # recorded, which then found the lease gone (issue #24).
                try:
                    return await self.pools.db(
                        self.settle, Verdict(FailureClass.TRANSIENT),
                        f"timeout: ran longer than {self.task.timeout:g} s",
                    )
                finally:
                    self.cancelled = True
        except _Duplicate:
            return await self.pools.db(self._close_duplicate)
        except _Cut as cut:
            return await self.pools.db(self.settle_cut, cut.error)
        except _BadResult as bad:  # its transaction was rolled back on the way out
            return await self.pools.db(self.settle, Verdict(FailureClass.PERMANENT),
                                       error_line(bad.error), bad.error)
        except LeaseLostError:
            log.warning("job %s: lease lost before completion; its writes were rolled back",
                        self.rec.id)
            return Outcome(RunStatus.LEASE_LOST)
        except Exception as exc:
            # Before the handler ran, or in duebox's own statements after
            # it, a lost connection cut the job's transaction, not the handler.
            if self._cut(exc, self.began is None or self.completing):
                return await self.pools.db(self.settle_cut, exc)
            verdict = self.task.classifier.classify(exc)
            return await self.pools.db(self.settle, verdict, error_line(exc), exc)

    def run_sync(self) -> Outcome:
        """A sync handler alone, in its executor thread: its transaction,
        the handler, then :meth:`finish` (its completion or its failure)."""
        engine = self.app.engine.execution_options(**{SQLITE_DEFERRED: True})
        same_transaction = engine.dialect.name == "postgresql"
        if self.check_first and not same_transaction and not still_leased(self.app, [self.rec])[0]:
            return Outcome(RunStatus.CANCELLED)
        with HandlerSession(engine) as session:
            session.begin()
            # Read committed: reading first costs the handler's transaction
            # nothing (elsewhere a snapshot taken this early could keep
            # SQLite's write lock from being granted).
            if (self.check_first and same_transaction
                    and not leases_held(session.connection(), [self.rec])[0]):
                return Outcome(RunStatus.CANCELLED)
            if self.check_first:
                wait_until(self.app.clock, self.rec.due_at)
            self.started = self.app.clock.now()
            self.began = time.monotonic()
            error, value = call_handler(self.task, self.rec.payload, self.context(session),
                                        session)
            self.handler_seconds = time.monotonic() - self.began
            return self.finish(session, error, value)

    def finish(self, session: HandlerSession, error: BaseException | None,
               value: Any = None) -> Outcome:
        """In the handler's thread, once it returned (``error``: what it
        raised, ``value``: what it returned): complete the job in the
        handler's transaction — the dedupe row, the fenced completion and
        the result its task keeps, then the commit — or roll that
        transaction back and record the failure.  Also how a handler a batch
        let go finishes (consumers/batch.py): its session then has a
        transaction of its own, or none yet."""
        own = False  # the error is of duebox's own statements, not the handler's
        if error is None:
            try:
                kept = self._kept(value)
            except ValidationError as exc:
                # Not JSON, or too large: it would be so again (a permanent failure).
                with contextlib.suppress(Exception):
                    session.rollback()
                return self.settle(Verdict(FailureClass.PERMANENT), error_line(exc), exc)
            try:
                conn = session.connection()
                session.check_rules(conn)
                # The handler's ORM writes first; then duebox's own statements
                # go through the connection: Session.execute would treat the
                # completion's SELECT as an ORM query and cost several times more.
                session.flush()
                outcome = run_steps(self._finish_steps(kept), conn.execute)
                if outcome.status is RunStatus.DUPLICATE:
                    session.rollback()  # seen before: this run's writes must not count
                    return self._close_duplicate()
                session.commit()
                return outcome
            except Exception as exc:
                error, own = exc, True
        # Asked before the rollback, which lets the connection go.
        cut = self._cut(error, own, session)
        with contextlib.suppress(Exception):  # a lost connection has nothing to roll back
            session.rollback()
        if isinstance(error, LeaseLostError):
            log.warning("job %s: lease lost before completion; its writes were rolled back",
                        self.rec.id)
            return Outcome(RunStatus.LEASE_LOST)
        if cut:
            return self.settle_cut(error)
        verdict = self.task.classifier.classify(error)
        return self.settle(verdict, error_line(error), error)

    async def _run_async(self) -> Outcome:
        engine = self.app.async_engine.execution_options(**{SQLITE_DEFERRED: True})
        async with AsyncSession(engine, sync_session_class=HandlerSession) as session, \
                session.begin():
            rules: HandlerSession = session.sync_session  # type: ignore[assignment]
            rules.handler_runs = True
            self.began = time.monotonic()
            try:
                value = await self.task.fn(self.rec.payload, self.context(session))
            except BaseException as exc:
                # Asked before the rollback on the way out, which lets the
                # connection go.
                if isinstance(exc, Exception) and unreachable(exc) and await session.run_sync(
                        lambda _: rules.connection_lost()):
                    raise _Cut(exc) from exc
                # SystemExit & co. from the handler's own code fail the attempt;
                # a cancellation (the task's timeout) is the loop's.
                if isinstance(exc, Exception | asyncio.CancelledError):
                    raise
                raise _aborted(exc) from exc
            finally:
                rules.handler_runs = False
            rules.check_rules()
            try:
                kept = self._kept(value)
            except ValidationError as exc:
                raise _BadResult(exc) from exc
            steps = self._finish_steps(kept)
            self.completing = True
            try:
                stmt, params = next(steps)
                while True:
                    stmt, params = steps.send(await session.execute(stmt, params))
            except StopIteration as done:
                return _not_duplicate(done.value)

    def _finish_steps(self, kept: results.Kept | None = None
                      ) -> Generator[tuple[Any, dict[str, Any]], Any, Outcome]:
        return finish_steps(self.app.engine.dialect.name, self.dedupe, self.rec,
                            self.app.clock.now(), kept)

    def _kept(self, value: Any) -> results.Kept | None:
        """The handler's return value as its task keeps it (None: it keeps
        none); a :class:`ValidationError` naming ``result`` if it cannot."""
        if not self.task.store_result:
            return None
        settings = self.app.settings
        return results.Kept(results.check_result(value, settings.max_result_bytes),
                            self.task.result_ttl or settings.result_ttl)

    def _close_duplicate(self) -> Outcome:
        """The job's effect was already committed under this id: finish the
        job without a second effect."""
        with db_errors("complete"), self.app.engine.begin() as conn:
            now = self.app.clock.now()
            if conn.execute(*jobstore.complete_bound(self.rec, now)).rowcount != 1:
                return Outcome(RunStatus.LEASE_LOST)
            conn.execute(jobstore.finish_attempt_stmt(self.rec, now, "duplicate"))
        return Outcome(RunStatus.DUPLICATE)

    def settle(self, verdict: Verdict, error: str, exc: BaseException | None = None) -> Outcome:
        """Record the failed attempt and move the job on: retry later, or DEAD
        — tried again while no server takes writes and the lease holds
        (consumers/settling.py)."""
        def write() -> Outcome:
            with db_errors("record failure"), self.app.engine.begin() as conn:
                return record_failure(conn, self.task, self.rec, verdict, error,
                                      self.app.clock.now(), exc)
        return until_written(write, lambda: self.held_until)

    def settle_cut(self, exc: BaseException) -> Outcome:
        """The job's own transaction was cut by a lost connection: settle it
        as soon as a server takes writes (see :func:`record_cut`), while the
        lease holds; after that it is recovery's."""
        # The first line: a statement's error goes on with its SQL.
        error = f"the job's transaction was cut: {error_line(exc).splitlines()[0]}"[:1000]

        def write() -> Outcome:
            with db_errors("settle an interrupted job"), self.app.engine.begin() as conn:
                return record_cut(conn, self.task, self.rec, error, self.app.clock.now())
        return until_written(write, lambda: self.held_until)

    @staticmethod
    def _cut(exc: BaseException, own: bool, session: HandlerSession | None = None) -> bool:
        """Whether ``exc`` means the job's own transaction was lost with its
        connection: the database out of reach, and either duebox's own
        statements failed (``own``) or the handler's ``session`` (asked
        before its rollback) lost its connection.  A handler that failed by
        itself — its session intact, whatever else it reached — is not cut:
        its failure is classified."""
        if not unreachable(exc):
            return False
        return own or (session is not None and session.connection_lost())

    async def _beat(self) -> None:
        """Renew the lease now and every third of it (started a third of the
        lease after the handler)."""
        while True:
            try:
                ok = await self.pools.db(self.heartbeat)
            except DatabaseError as exc:
                log_trouble(log, "a job's heartbeat", exc, "job %s: heartbeat failed: %s",
                            self.rec.id, exc)
                ok = True
            if not ok:
                log.warning("job %s: the lease is gone (cancelled or taken over); "
                            "ctx.cancelled is now set", self.rec.id)
                return
            await asyncio.sleep(self.lease / 3)


def finish_steps(dialect: str, dedupe: SQLDedupeStore, rec: jobstore.JobRecord,
                 now: datetime, kept: results.Kept | None = None
                 ) -> Generator[tuple[Any, dict[str, Any]], Any, Outcome]:
    """After the handler, in its transaction: the dedupe row, then the
    fenced completion, then the result its task keeps (``kept``), as
    statements to execute (each result is sent back).  The dedupe row comes
    last so that on SQLite the write lock is taken at the handler's first
    write, not before it runs."""
    if dialect == "postgresql":
        claimed, completed, _ = (yield dedupe.claim_and_complete(rec, now)).one()
        if not claimed:
            return Outcome(RunStatus.DUPLICATE)
        if not completed:
            raise LeaseLostError(f"job {rec.id}: lease lost before completion")
    else:
        first = yield dedupe.claim_bound(dialect, str(rec.id), now)
        if first.rowcount != 1:
            return Outcome(RunStatus.DUPLICATE)
        done = yield jobstore.complete_bound(rec, now)
        if done.rowcount != 1:
            raise LeaseLostError(f"job {rec.id}: lease lost before completion")
        yield jobstore.finish_attempt_bound(rec, now, "succeeded")
    if kept is not None:
        yield results.store(rec.id, kept, now)
    return Outcome(RunStatus.SUCCEEDED)


def run_steps(steps: Generator[tuple[Any, dict[str, Any]], Any, Outcome],
              execute: Callable[..., Any]) -> Outcome:
    """Execute :func:`finish_steps`' statements with ``execute``."""
    try:
        stmt, params = next(steps)
        while True:
            stmt, params = steps.send(execute(stmt, params))
    except StopIteration as done:
        outcome: Outcome = done.value
        return outcome


def call_handler(task: Task, payload: Any, ctx: JobContext,
                 session: HandlerSession) -> tuple[BaseException | None, Any]:
    """Call a sync handler with ``session`` as its ``ctx.session`` (its
    rules enforced while it runs): what it raised (or None) and what it
    returned.  A ``BaseException`` of its own (``sys.exit()``) fails the
    attempt like any error: in an executor thread it would otherwise stop
    the worker."""
    session.handler_runs = True
    try:
        return None, task.fn(payload, ctx)
    except Exception as exc:
        return exc, None
    except BaseException as exc:
        return _aborted(exc), None
    finally:
        session.handler_runs = False


def _aborted(exc: BaseException) -> HandlerAbortError:
    aborted = HandlerAbortError(f"the handler raised {type(exc).__name__}: {exc}"[:500])
    aborted.__cause__ = exc
    return aborted


def _not_duplicate(outcome: Outcome) -> Outcome:
    if outcome.status is RunStatus.DUPLICATE:
        # Seen before: this run's writes must not count twice.
        raise _Duplicate(outcome)
    return outcome


def warm_up(app: Duebox, dedupe: SQLDedupeStore, holding: threading.Barrier) -> None:
    """Before a worker takes jobs, in each of its executor threads: open a
    pooled connection, run the per-job statements on it once in a
    transaction that is rolled back, and hold it until every executor has
    one (so the pool keeps as many as run at once).  Neither a connection,
    nor a statement's compilation, nor the server's first look at the tables
    then waits for the first jobs (the first few dozen started 50 ms late)."""
    with app.engine.connect() as conn:
        now = app.clock.now()
        nobody = jobstore.JobRecord(
            id=uuid7(), task="", queue="", payload=None, headers=None, due_at=now,
            version=0, attempt=0, max_attempts=0, priority=0, tenant=None, key=None,
            expires_at=None, lease_owner="", lease_generation=0, attempt_id=uuid7())
        with conn.begin() as tx:
            leases_held(conn, [nobody])
            # Nobody holds that lease: the completion finds it lost.
            with contextlib.suppress(LeaseLostError):
                run_steps(finish_steps(conn.dialect.name, dedupe, nobody, now), conn.execute)
            tx.rollback()
        with contextlib.suppress(threading.BrokenBarrierError):
            holding.wait(5.0)


def still_leased(app: Duebox, records: list[jobstore.JobRecord]) -> list[bool]:
    """Read the jobs again: each still this lease's and this version's?"""
    with db_errors("re-read"), app.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            # One statement, atomic by itself: no BEGIN, no ROLLBACK after it.
            conn.execution_options(isolation_level="AUTOCOMMIT")
        return leases_held(conn, records)


def leases_held(conn: Connection, records: list[jobstore.JobRecord]) -> list[bool]:
    """Per job: still this lease's and this version's?"""
    held = jobstore.lease_states(conn, records)
    return [held[r.id] is LeaseVerdict.HELD for r in records]


def job_context(rec: jobstore.JobRecord, session: Any, worker: str,
                control: JobControl) -> JobContext:
    return JobContext(
        job_id=rec.id, task=rec.task, queue=rec.queue, attempt=rec.attempt,
        version=rec.version, due_at=rec.due_at, key=rec.key, tenant=rec.tenant,
        session=session, worker=worker, lease_generation=rec.lease_generation,
        checkpoint_state=rec.checkpoint, control=control,
    )


def record_cut(conn: Connection, task: Task, rec: jobstore.JobRecord, error: str,
               now: datetime) -> Outcome:
    """In ``conn``'s transaction: settle a job whose own transaction a lost
    connection cut (consumers/settling.py), fenced by its lease.  Still
    RUNNING under it: nothing of that transaction committed — the job goes
    back to SCHEDULED, due as it was, to run again at once, or DEAD if its
    attempts are used up, as recovery would put it once the lease ran out
    (its attempt closed ``lost``); on PostgreSQL a NOTIFY wakes the relays
    and ``sql://`` workers.  Not: the row says what happened — this attempt
    succeeded (the commit was in flight and went through), or the lease
    moved on — and nothing is written."""
    dead = rec.attempt >= rec.max_attempts
    if conn.execute(jobstore.interrupted_stmt(rec, now, error, dead=dead)).rowcount != 1:
        if jobstore.attempt_outcome(conn, rec) == "succeeded":
            log.info("job %s: its commit had gone through before the connection was lost",
                     rec.id)
            return Outcome(RunStatus.SUCCEEDED)
        log.warning("job %s: its transaction was cut, and the lease moved on meanwhile", rec.id)
        return Outcome(RunStatus.LEASE_LOST)
    conn.execute(jobstore.finish_attempt_stmt(rec, now, "lost", SystemFailure.LOST, error))
    if not dead and conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_notify(NOTIFY_CHANNEL, "")))
    shown = masked_text(task, rec.payload, error)
    if dead:
        log.warning("job %s dead after attempt %d (lost): %s", rec.id, rec.attempt, shown,
                    extra=job_fields(rec))
        return Outcome(RunStatus.DEAD)
    log.warning("job %s attempt %d: %s; it runs again now", rec.id, rec.attempt, shown,
                extra=job_fields(rec))
    return Outcome(RunStatus.INTERRUPTED)


def record_failure(conn: Connection, task: Task, rec: jobstore.JobRecord, verdict: Verdict,
                   error: str, now: datetime, exc: BaseException | None = None) -> Outcome:
    """In ``conn``'s transaction: record the failed attempt (with the
    traceback of ``exc``, bounded and masked like the payload) and move the
    job on, fenced by its lease: retry later with a new version, or DEAD.
    Logs the failure once, with that traceback."""
    cls = verdict.failure_class
    retry = cls != FailureClass.PERMANENT and rec.attempt < rec.max_attempts
    delay = task.retry.delay_for(rec.attempt, verdict) if retry else None
    if delay is not None:
        due = now + timedelta(seconds=delay)
        moved = conn.execute(jobstore.retry_stmt(rec, now, due, cls, error))
    else:
        moved = conn.execute(jobstore.dead_stmt(rec, now, cls, error))
    if moved.rowcount != 1:
        log.warning("job %s: failure not recorded, the lease moved on", rec.id)
        return Outcome(RunStatus.LEASE_LOST, cls)
    tb = masked_text(task, rec.payload, bounded_traceback(exc)) if exc is not None else None
    conn.execute(jobstore.finish_attempt_stmt(rec, now, "failed", cls, error, tb))
    # What people read of the error is masked; the job row keeps it whole
    # (the dashboard and the CLI mask it when they show it).
    shown = masked_text(task, rec.payload, error)
    if delay is None:
        dlq.quarantine_if_repeated(conn, rec.id, cls, error, now)
        log_traced(log, logging.WARNING, tb, "job %s dead after attempt %d (%s): %s", rec.id,
                   rec.attempt, cls, shown, extra=job_fields(rec))
        return Outcome(RunStatus.DEAD, cls)
    log_traced(log, logging.INFO, tb, "job %s attempt %d failed (%s): %s; retry in %.1fs",
               rec.id, rec.attempt, cls, shown, delay, extra=job_fields(rec))
    return Outcome(RunStatus.RETRIED, cls)
