"""Shared helpers for the producer, jobstore, invariant and process tests.

* An ``effects`` table that handlers write through ``ctx.session``: one row
  per job id (primary key), with the job's due time and the handler's start
  time in integer microseconds, so comparisons are exact.
* :func:`make_app`: a :class:`duebox.Duebox` with fast settings and the test
  tasks registered.
* :class:`Running`: a relay and workers in the test's event loop, stopped and
  checked for crashes on exit; :func:`wait_for` polls a database condition
  with a deadline instead of sleeping.
* :func:`observer`: a plain engine without duebox's SQLite ``BEGIN IMMEDIATE``
  listener, to look at committed state while another transaction is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine

import duebox
from duebox import Settings
from duebox.consumers import Worker
from duebox.leases import jobstore
from duebox.relay import Relay
from duebox.tables import attempt, job

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

effects_metadata = sa.MetaData()
effects = sa.Table(
    "effects",
    effects_metadata,
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("due_us", sa.BigInteger, nullable=False),
    sa.Column("started_us", sa.BigInteger, nullable=False),
    sa.Column("worker", sa.String(200), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("lease_generation", sa.BigInteger, nullable=False),
)


def us(dt: datetime) -> int:
    """Microseconds since the epoch, exactly (no float rounding)."""
    return (dt - EPOCH) // timedelta(microseconds=1)


def now_us() -> int:
    return time.time_ns() // 1000


def create_effects(engine: Engine) -> None:
    effects_metadata.drop_all(engine)
    effects_metadata.create_all(engine)


def effect_values(ctx: duebox.JobContext) -> dict[str, Any]:
    return {
        "job_id": str(ctx.job_id), "due_us": us(ctx.due_at), "started_us": now_us(),
        "worker": ctx.worker, "attempt": ctx.attempt, "lease_generation": ctx.lease_generation,
    }


@dataclass
class Calls:
    """Every handler invocation, committed or not (the effects table holds
    only the committed ones)."""

    log: list[tuple[str, int]] = field(default_factory=list)

    def count(self, job_id: uuid.UUID | str) -> int:
        return sum(1 for j, _ in self.log if j == str(job_id))


def make_app(
    url: str,
    broker_url: str = "sql://",
    *,
    clock: duebox.Clock | None = None,
    **settings: Any,
) -> duebox.Duebox:
    """An app with fast test settings and these tasks:

    ``effect`` (sync) and ``effect_async`` write one effects row through
    ``ctx.session``; ``noop`` does nothing.  ``app.calls`` logs every call.
    """
    values: dict[str, Any] = {
        "poll_interval": 0.05, "lease_seconds": 5.0, "clock_skew_margin": 0.2,
        "batch_size": 50,
    }
    values.update(settings)
    app = duebox.Duebox(url, broker_url, clock=clock, settings=Settings(**values))
    calls = Calls()
    app.calls = calls  # type: ignore[attr-defined]

    @app.task("effect")
    def effect(payload: Any, ctx: duebox.JobContext) -> None:
        calls.log.append((str(ctx.job_id), ctx.lease_generation))
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    @app.task("effect_async")
    async def effect_async(payload: Any, ctx: duebox.JobContext) -> None:
        calls.log.append((str(ctx.job_id), ctx.lease_generation))
        await ctx.session.execute(effects.insert().values(effect_values(ctx)))

    @app.task("noop", queue="other")
    def noop(payload: Any, ctx: duebox.JobContext) -> None:
        calls.log.append((str(ctx.job_id), ctx.lease_generation))

    create_effects(app.engine)
    return app


def observer(url: str) -> Engine:
    """A plain engine: on SQLite it reads a WAL snapshot without taking the
    write lock, so it can look while another transaction is open."""
    return sa.create_engine(url)


def schedule_committed(app: duebox.Duebox, name: str = "effect", payload: Any = None,
                       **kw: Any) -> uuid.UUID:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, name, payload, **kw)
    assert isinstance(job_id, uuid.UUID)
    return job_id


def cancel_committed(app: duebox.Duebox, job_id: uuid.UUID) -> bool:
    with app.engine.begin() as conn:
        result = app.cancel(conn, job_id)
    assert isinstance(result, bool)
    return result


def job_row(engine: Engine, job_id: uuid.UUID) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(job).where(job.c.id == job_id)).one()


def job_rows(engine: Engine) -> dict[uuid.UUID, Any]:
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(sa.select(job))}


def effect_rows(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return {r.job_id: r for r in conn.execute(sa.select(effects))}


def attempt_rows(engine: Engine, job_id: uuid.UUID | None = None) -> list[Any]:
    stmt = sa.select(attempt).order_by(attempt.c.started_at, attempt.c.number)
    if job_id is not None:
        stmt = stmt.where(attempt.c.job_id == job_id)
    with engine.connect() as conn:
        return list(conn.execute(stmt))


def count(engine: Engine, table: sa.Table | str) -> int:
    name = table if isinstance(table, str) else table.name
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {name}")).scalar_one())


def duebox_row_counts(engine: Engine) -> dict[str, int]:
    return {t.name: count(engine, t) for t in duebox.metadata.sorted_tables}


def states(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return jobstore.counts_by_state(conn)


@contextlib.contextmanager
def row_locked(engine: Engine, job_id: uuid.UUID) -> Iterator[Callable[[], None]]:
    """Another transaction holding the job's row lock (``FOR UPDATE``) until
    the function yielded is called, or the block ends."""
    conn = engine.connect()
    tx = conn.begin()
    conn.execute(sa.select(job.c.id).where(job.c.id == job_id).with_for_update())
    try:
        yield tx.rollback
    finally:
        if tx.is_active:
            tx.rollback()
        conn.close()


def all_final(engine: Engine, ids: list[uuid.UUID], state: str = "SUCCEEDED") -> bool:
    with engine.connect() as conn:
        n = conn.execute(
            sa.select(sa.func.count()).select_from(job)
            .where(job.c.id.in_(ids), job.c.state == state)
        ).scalar_one()
    return int(n) == len(ids)


def check_no_early_start(engine: Engine) -> None:
    """Invariant 1, from the handler's own clock: every committed effect
    started at or after the due time of the job row and of the record it ran."""
    rows = job_rows(engine)
    for e in effect_rows(engine).values():
        due = us(rows[uuid.UUID(e.job_id)].due_at)
        assert e.started_us >= e.due_us, f"job {e.job_id} started before its record's due_at"
        assert e.started_us >= due, f"job {e.job_id} started {due - e.started_us} us early"


async def wait_for(
    predicate: Callable[[], Any],
    *,
    timeout: float,  # noqa: ASYNC109 - a polling deadline, not a cancel scope
    what: str,
    interval: float = 0.05,
    check: Callable[[], None] | None = None,
) -> Any:
    """Poll ``predicate`` (run in a thread: it may query the database) until
    it returns something truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


class Running:
    """Relays and workers running in the current event loop.

    ``async with Running(app, relays=1, workers=1) as r:`` starts them; on
    exit they are stopped and any crash is re-raised.  ``r.check()`` raises at
    once if one of them died, so a wait fails fast instead of timing out.
    """

    def __init__(self, app: duebox.Duebox, *, relays: int = 1, workers: int = 1,
                 concurrency: int = 4, relay_kw: dict[str, Any] | None = None,
                 worker_kw: dict[str, Any] | None = None) -> None:
        self.app = app
        self.relays = [Relay(app, recover_interval=0.1, **(relay_kw or {}))
                       for _ in range(relays)]
        self.workers = [Worker(app, concurrency=concurrency, **(worker_kw or {}))
                        for _ in range(workers)]
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Running:
        for part in (*self.relays, *self.workers):
            self.tasks.append(asyncio.create_task(part.run(self.stop)))
        return self

    def check(self) -> None:
        for t in self.tasks:
            if t.done():
                t.result()  # raises the crash
                raise AssertionError("a relay or worker stopped on its own")

    async def wait(
        self, predicate: Callable[[], Any], *, timeout: float, what: str  # noqa: ASYNC109
    ) -> Any:
        return await wait_for(predicate, timeout=timeout, what=what, check=self.check)

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        _, pending = await asyncio.wait(self.tasks, timeout=20)
        if pending:
            # A stop that hangs is a bug to find, not to wait out: show where
            # every task and thread is before the timeout below fails the test.
            for t in asyncio.all_tasks():
                print("still running:", t, file=sys.stderr)
                t.print_stack(file=sys.stderr)
            faulthandler.dump_traceback(file=sys.stderr)
        results = await asyncio.wait_for(
            asyncio.gather(*self.tasks, return_exceptions=True), timeout=30
        )
        for r in results:
            if isinstance(r, BaseException) and exc[0] is None:
                raise r

    @property
    def discarded(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for w in self.workers:
            for reason, n in w.stats.discarded.items():
                total[reason] = total.get(reason, 0) + n
        return total

    def worker_total(self, stat: str) -> int:
        return sum(int(getattr(w.stats, stat)) for w in self.workers)


def memory_url() -> str:
    """A fresh in-process hub per test (hubs are keyed by name)."""
    return f"memory://t{uuid.uuid4().hex[:12]}"


class ShiftedClock:
    """The system clock moved by a fixed offset (``start`` is "now" at
    creation): real time passes, but at another date, e.g. the last day a
    due time may have (duebox.validation.LATEST)."""

    def __init__(self, start: datetime) -> None:
        self.offset = start - datetime.now(UTC)

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


def column_names(engine: Engine, table: str) -> set[str]:
    return {c["name"] for c in sa.inspect(engine).get_columns(table)}


def schema_diffs(engine: Engine, table: str) -> list[Any]:
    """What alembic's autogenerate finds between ``duebox.metadata`` and the
    database for ``table``: empty when a migration's head matches the code."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from duebox import migrate

    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={
            "version_table": migrate.VERSION_TABLE,
            "include_name": lambda name, type_, parent: (
                type_ != "table" or (name or "").startswith("duebox_"))})
        return [d for d in compare_metadata(ctx, duebox.metadata) if table in repr(d)]
