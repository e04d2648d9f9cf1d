"""One benchmark trial per process; ``bench/run.py`` runs these and writes RESULTS.md.

Usage (normally through run.py)::

    python bench/trials.py relay     DATABASE_URL N [--raw-first]
    python bench/trials.py worker    DATABASE_URL N
    python bench/trials.py pipeline  DATABASE_URL N
    python bench/trials.py lateness  DATABASE_URL RATE SECONDS

Each prints one JSON object on its last stdout line.  DATABASE_URL is an
SQLAlchemy URL (``sqlite:////tmp/x.db`` or ``postgresql+psycopg://.../db``);
the trial owns that database: it drops and recreates duebox's tables.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import sqlite3
import statistics
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.engine import make_url

import duebox
from duebox import migrate
from duebox.consumers import Worker
from duebox.db import check_reachable
from duebox.leases import jobstore
from duebox.relay import Relay
from duebox.tables import job

BATCH = 500
LOAD_CHUNK = 1000  # jobs per app.schedule_many call while loading

# Columns the relay's claim returns (duebox.leases.records.ROW_COLUMNS), for the raw baseline.
ROW_COLUMNS = (
    "id, task, queue, payload, headers, due_at, version, attempt, max_attempts, priority, "
    "tenant, key, expires_at, lease_owner, lease_generation, checkpoint"
)


# --- setup -----------------------------------------------------------------


def noop(payload: Any, ctx: Any) -> None:
    return None


def make_app(url: str, broker_url: str = "sql://") -> duebox.Duebox:
    app = duebox.Duebox(database_url=url, broker_url=broker_url)
    app.task("noop")(noop)
    return app


def is_pg(url: str) -> bool:
    return make_url(url).get_backend_name() == "postgresql"


def fresh_schema(url: str) -> None:
    """Empty, freshly migrated tables: a new SQLite file, or dropped and
    recreated PostgreSQL tables (new relfilenodes, no dead tuples)."""
    if is_pg(url):
        app = duebox.Duebox(database_url=url)
        with app.engine.begin() as conn:
            names = [t.name for t in reversed(duebox.metadata.sorted_tables)]
            for name in [*names, "duebox_alembic_version"]:
                conn.execute(text(f"DROP TABLE IF EXISTS {name}"))
        migrate.upgrade(app.engine)
        app.dispose()
    else:
        path = make_url(url).database
        assert path, "benchmarks need a SQLite file"
        assert path != ":memory:", "benchmarks need a SQLite file"
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)
        app = duebox.Duebox(database_url=url)
        migrate.upgrade(app.engine)
        app.dispose()


def load_due(app: duebox.Duebox, n: int, first_due: datetime, spacing: float = 0.0) -> None:
    """Insert ``n`` SCHEDULED no-op jobs with ``app.schedule_many``."""
    with app.engine.begin() as conn:
        for start in range(0, n, LOAD_CHUNK):
            jobs = [
                app.new_job("noop", {"i": i}, at=first_due + timedelta(seconds=i * spacing))
                for i in range(start, min(n, start + LOAD_CHUNK))
            ]
            app.schedule_many(conn, jobs)
    settle(app)


def settle(app: duebox.Duebox) -> None:
    """Fresh statistics and a checkpoint so every timed phase starts alike."""
    if app.engine.dialect.name == "postgresql":
        with app.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE duebox_job"))
            conn.execute(text("CHECKPOINT"))
    else:
        app.engine.dispose()  # no pooled connection holds a read snapshot
        path = make_url(str(app.settings.database_url)).database
        conn = sqlite3.connect(path or "", isolation_level=None)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()


def counts(app: duebox.Duebox) -> dict[str, int]:
    with app.engine.connect() as conn:
        return jobstore.counts_by_state(conn)


def due_now() -> datetime:
    return datetime.now(UTC) - timedelta(seconds=1)


# --- 1. relay throughput -----------------------------------------------------


async def time_relay(app: duebox.Duebox, n: int) -> dict[str, Any]:
    broker = app.broker("bench-relay")
    relay = Relay(app, broker=broker, batch_size=BATCH)
    await broker.open()
    check_reachable(app.engine)
    t0 = time.perf_counter()
    while relay.totals.marked < n:
        stats = await relay.run_pass()
        if stats.claimed == 0:
            break
    elapsed = time.perf_counter() - t0
    await broker.close()
    got = counts(app)
    assert got == {"ENQUEUED": n}, f"relay left {got}"
    assert relay.totals.lost_marks == 0
    return {"seconds": elapsed, "rate": n / elapsed, "passes": relay.totals.passes}


def raw_pg(url: str, n: int) -> dict[str, Any]:
    """The relay's claim + mark, hand-written on psycopg: no duebox, no SQLAlchemy."""
    import psycopg

    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    claim = (
        "UPDATE duebox_job SET state = 'DISPATCHING', lease_owner = %(owner)s, "
        "lease_generation = lease_generation + 1, lease_until = %(lease_until)s, "
        "claimed_at = %(now)s, updated_at = %(now)s "
        "WHERE id IN (SELECT id FROM duebox_job WHERE state = 'SCHEDULED' "
        "AND due_at <= %(horizon)s ORDER BY due_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED) "
        f"RETURNING {ROW_COLUMNS}"
    )
    mark = (
        "UPDATE duebox_job SET state = 'ENQUEUED', published_at = %s, lease_owner = NULL, "
        "lease_until = NULL, updated_at = %s "
        "WHERE state = 'DISPATCHING' AND lease_owner = %s AND id IN ({})"
    )
    marked = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT 1")
        t0 = time.perf_counter()
        for seq in range(10**9):
            owner = f"raw#{seq}"
            now = datetime.now(UTC)
            with conn.transaction():
                rows = conn.execute(claim, {
                    "owner": owner, "lease_until": now + timedelta(seconds=30), "now": now,
                    "horizon": now, "limit": BATCH,
                }).fetchall()
            if rows:
                ids = [r[0] for r in rows]
                now = datetime.now(UTC)
                with conn.transaction():
                    cur = conn.execute(mark.format(", ".join(["%s"] * len(ids))),
                                       [now, now, owner, *ids])
                    marked += cur.rowcount
            if len(rows) < BATCH:
                break
        elapsed = time.perf_counter() - t0
    assert marked == n, f"raw marked {marked} of {n}"
    return {"seconds": elapsed, "rate": n / elapsed}


def _sqlite_ts(value: datetime) -> str:
    # SQLAlchemy's SQLite DATETIME storage format (UTC, naive).
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def raw_sqlite(url: str, n: int) -> dict[str, Any]:
    """The relay's claim + mark on the stdlib sqlite3 module, with duebox's
    pragmas and ``BEGIN IMMEDIATE`` (SQLite has no SKIP LOCKED)."""
    path = make_url(url).database
    assert path
    claim = (
        "UPDATE duebox_job SET state = 'DISPATCHING', lease_owner = :owner, "
        "lease_generation = lease_generation + 1, lease_until = :lease_until, "
        "claimed_at = :now, updated_at = :now "
        "WHERE id IN (SELECT id FROM duebox_job WHERE state = 'SCHEDULED' "
        "AND due_at <= :horizon ORDER BY due_at LIMIT :limit) "
        f"RETURNING {ROW_COLUMNS}"
    )
    mark = (
        "UPDATE duebox_job SET state = 'ENQUEUED', published_at = ?, lease_owner = NULL, "
        "lease_until = NULL, updated_at = ? "
        "WHERE state = 'DISPATCHING' AND lease_owner = ? AND id IN ({})"
    )
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    for pragma in ("busy_timeout = 30000", "journal_mode = WAL", "synchronous = NORMAL"):
        conn.execute(f"PRAGMA {pragma}")
    marked = 0
    t0 = time.perf_counter()
    for seq in range(10**9):
        owner = f"raw#{seq}"
        now = datetime.now(UTC)
        conn.execute("BEGIN IMMEDIATE")
        rows = conn.execute(claim, {
            "owner": owner, "lease_until": _sqlite_ts(now + timedelta(seconds=30)),
            "now": _sqlite_ts(now), "horizon": _sqlite_ts(now), "limit": BATCH,
        }).fetchall()
        conn.execute("COMMIT")
        if rows:
            ids = [r[0] for r in rows]
            stamp = _sqlite_ts(datetime.now(UTC))
            conn.execute("BEGIN IMMEDIATE")
            cur = conn.execute(mark.format(", ".join(["?"] * len(ids))),
                               [stamp, stamp, owner, *ids])
            marked += cur.rowcount
            conn.execute("COMMIT")
        if len(rows) < BATCH:
            break
    elapsed = time.perf_counter() - t0
    conn.close()
    assert marked == n, f"raw marked {marked} of {n}"
    return {"seconds": elapsed, "rate": n / elapsed}


def relay_trial(url: str, n: int, raw_first: bool) -> dict[str, Any]:
    """Relay and raw baseline in one process, each on a freshly loaded table;
    ``raw_first`` alternates the order between trials."""
    out: dict[str, Any] = {}

    def run_relay() -> None:
        fresh_schema(url)
        app = make_app(url, f"memory://relay-{uuid.uuid4().hex[:8]}")
        load_due(app, n, due_now())
        out["relay"] = asyncio.run(time_relay(app, n))
        app.dispose()

    def run_raw() -> None:
        fresh_schema(url)
        app = make_app(url)
        load_due(app, n, due_now())
        out["raw"] = raw_pg(url, n) if is_pg(url) else raw_sqlite(url, n)
        got = counts(app)
        assert got == {"ENQUEUED": n}, f"raw baseline left {got}"
        app.dispose()

    for step in ((run_raw, run_relay) if raw_first else (run_relay, run_raw)):
        step()
    out["ratio"] = out["relay"]["rate"] / out["raw"]["rate"]
    return out


# --- 2. worker throughput ------------------------------------------------------


async def _until(pred: Any, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark did not finish in time")
        await asyncio.sleep(0.002)


async def time_worker(app: duebox.Duebox, n: int, with_relay: bool,
                      group_commit: int | None = None) -> dict[str, Any]:
    stop = asyncio.Event()
    worker = Worker(app, concurrency=8, group_commit=group_commit)
    check_reachable(app.engine)
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(worker.run(stop))]
    relay = None
    if with_relay:
        relay = Relay(app, broker=worker.broker, batch_size=BATCH)
        tasks.append(asyncio.create_task(relay.run(stop)))
    try:
        await _until(lambda: worker.stats.succeeded >= n, limit=300)
    finally:
        elapsed = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*tasks)
    got = counts(app)
    assert got == {"SUCCEEDED": n}, f"worker left {got}"
    out: dict[str, Any] = {"seconds": elapsed, "rate": n / elapsed,
                           "discarded": dict(worker.stats.discarded),
                           "grouped": worker.stats.grouped}
    if relay is not None:
        out["relay_passes"] = relay.totals.passes
    return out


# The sql:// worker's per-job SQL, for the raw baseline: a claim of up to 8
# due rows (plus their attempt rows), then per job one transaction with the
# dedupe row, the fenced completion and the attempt's outcome.
WORKER_CLAIM = (
    "UPDATE duebox_job SET state = 'RUNNING', attempt = attempt + 1, lease_owner = {owner}, "
    "lease_until = {until}, lease_generation = lease_generation + 1, claimed_at = {now}, "
    "started_at = {now}, updated_at = {now} "
    "WHERE id IN (SELECT id FROM duebox_job WHERE state = 'SCHEDULED' AND due_at <= {now} "
    "AND queue IN ('default') ORDER BY due_at LIMIT {limit}{lock}) "
    f"RETURNING {ROW_COLUMNS}"
)
WORKER_ATTEMPT = (
    "INSERT INTO duebox_attempt (id, job_id, number, worker, lease_generation, started_at) "
    "VALUES ({p}, {p}, {p}, {p}, {p}, {p})"
)
WORKER_DEDUPE = (
    "INSERT INTO duebox_processed (consumer, message_id, processed_at) VALUES ('duebox', {p}, {p}) "
    "ON CONFLICT (consumer, message_id) DO NOTHING"
)
WORKER_COMPLETE = (
    "UPDATE duebox_job SET state = 'SUCCEEDED', finished_at = {p}, lease_owner = NULL, "
    "lease_until = NULL, updated_at = {p} WHERE id = {p} AND state = 'RUNNING' "
    "AND lease_owner = {p} AND lease_generation = {p}"
)
WORKER_FINISH = (
    "UPDATE duebox_attempt SET outcome = 'succeeded', finished_at = {p} "
    "WHERE id = {p} AND outcome IS NULL"
)


def raw_worker(url: str, n: int, limit: int = 8) -> dict[str, Any]:
    """The worker's statements for ``n`` jobs on the bare driver: no duebox,
    no SQLAlchemy, no asyncio.  PostgreSQL: 8 threads, one connection each
    (psycopg releases the GIL while it waits), like the worker's 8 slots.
    SQLite: one connection, since its writers serialise anyway."""
    pg = is_pg(url)
    threads = 8 if pg else 1
    done: list[int] = []
    errors: list[BaseException] = []

    def loop(index: int) -> None:
        try:
            done.append(_raw_worker_loop(url, pg, f"raw{index}", limit))
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    assert sum(done) == n, f"raw worker finished {sum(done)} of {n}"
    return {"seconds": elapsed, "rate": n / elapsed, "threads": threads}


def _raw_worker_loop(url: str, pg: bool, name: str, limit: int) -> int:
    if pg:
        import psycopg

        dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        conn: Any = psycopg.connect(dsn)
        p, named = "%s", {"owner": "%(owner)s", "until": "%(until)s", "now": "%(now)s",
                          "limit": "%(limit)s", "lock": " FOR UPDATE SKIP LOCKED"}

        def stamp(value: datetime) -> Any:
            return value

        def new_id() -> Any:
            return uuid.uuid4()
    else:
        conn = sqlite3.connect(make_url(url).database or "", isolation_level=None, timeout=30)
        for pragma in ("busy_timeout = 30000", "journal_mode = WAL", "synchronous = NORMAL"):
            conn.execute(f"PRAGMA {pragma}")
        p, named = "?", {"owner": ":owner", "until": ":until", "now": ":now",
                         "limit": ":limit", "lock": ""}
        stamp = _sqlite_ts

        def new_id() -> Any:
            return uuid.uuid4().hex

    claim = WORKER_CLAIM.format(**named)
    attempt_sql, dedupe, complete, finish = (
        q.format(p=p) for q in (WORKER_ATTEMPT, WORKER_DEDUPE, WORKER_COMPLETE, WORKER_FINISH))

    def begin() -> None:
        if not pg:
            conn.execute("BEGIN IMMEDIATE")

    def commit() -> None:
        if pg:
            conn.commit()
        else:
            conn.execute("COMMIT")

    done = 0
    for seq in range(10**9):
        owner = f"{name}#{seq}"
        now = datetime.now(UTC)
        begin()
        rows = conn.execute(claim, {"owner": owner, "until": stamp(now + timedelta(seconds=30)),
                                    "now": stamp(now), "limit": limit}).fetchall()
        # RETURNING gives the new attempt (r[7]) and lease_generation (r[14]).
        attempts = [(new_id(), r[0], r[7], name, r[14], stamp(now)) for r in rows]
        if attempts:
            conn.cursor().executemany(attempt_sql, attempts)
        commit()
        if not rows:
            break
        for row, att in zip(rows, attempts, strict=True):
            when = stamp(datetime.now(UTC))
            begin()
            conn.execute(dedupe, [str(row[0]), when])
            cur = conn.execute(complete, [when, when, row[0], owner, row[14]])
            assert cur.rowcount == 1, "raw completion matched no row"
            conn.execute(finish, [when, att[0]])
            commit()
            done += 1
    conn.close()
    return done


def worker_trial(url: str, n: int, pipeline: bool) -> dict[str, Any]:
    fresh_schema(url)
    broker_url = f"memory://pipe-{uuid.uuid4().hex[:8]}" if pipeline else "sql://"
    app = make_app(url, broker_url)
    load_due(app, n, due_now())
    cpu = time.process_time()
    result = asyncio.run(time_worker(app, n, with_relay=pipeline))
    result["cpu_ms_per_job"] = (time.process_time() - cpu) / n * 1000.0
    app.dispose()
    # The same with group commit off: every job a transaction of its own.
    fresh_schema(url)
    app = make_app(url, broker_url.replace("pipe-", "alone-"))
    load_due(app, n, due_now())
    cpu = time.process_time()
    result["alone"] = asyncio.run(time_worker(app, n, with_relay=pipeline, group_commit=1))
    result["alone"]["cpu_ms_per_job"] = (time.process_time() - cpu) / n * 1000.0
    app.dispose()
    if not pipeline:
        fresh_schema(url)
        app = make_app(url)
        load_due(app, n, due_now())
        cpu = time.process_time()
        result["raw"] = raw_worker(url, n)
        result["raw"]["cpu_ms_per_job"] = (time.process_time() - cpu) / n * 1000.0
        got = counts(app)
        assert got == {"SUCCEEDED": n}, f"raw worker left {got}"
        app.dispose()
        result["ratio"] = result["rate"] / result["raw"]["rate"]
    return result


# --- 3. lateness ---------------------------------------------------------------


def produce(url: str, rate: float, seconds: float, t0: float, lead: float,
            tick: float) -> None:
    """A separate producer process: every ``tick`` it schedules the next
    ``rate * tick`` jobs, due ``lead`` seconds ahead, spaced 1/rate apart."""
    logging.basicConfig(level=logging.WARNING)
    app = make_app(url)
    total = int(rate * seconds)
    per_tick = max(1, round(rate * tick))
    i = 0
    while i < total:
        batch_due = t0 + i / rate
        wait = batch_due - lead - time.time()
        if wait > 0:
            time.sleep(wait)
        jobs = [
            app.new_job("noop", None, at=datetime.fromtimestamp(t0 + k / rate, UTC))
            for k in range(i, min(total, i + per_tick))
        ]
        with app.engine.begin() as conn:
            app.schedule_many(conn, jobs)
        i += len(jobs)
    app.dispose()


def _pct(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return float("nan")
    k = min(len(sorted_ms) - 1, max(0, round(q * len(sorted_ms)) - 1))
    return sorted_ms[k]


async def run_lateness(app: duebox.Duebox, url: str, rate: float, seconds: float,
                       lead: float) -> dict[str, Any]:
    total = int(rate * seconds)
    lock = threading.Lock()
    samples: list[tuple[float, float]] = []
    samples_by_id: list[tuple[uuid.UUID, float, float]] = []

    def record(payload: Any, ctx: Any) -> None:
        started = time.time()
        due = ctx.due_at.timestamp()
        with lock:
            samples.append((started, due))
            samples_by_id.append((ctx.job_id, started, due))

    app.task("noop")(record)
    stop = asyncio.Event()
    relay = Relay(app)
    worker = Worker(app, concurrency=8)
    check_reachable(app.engine)
    tasks = [asyncio.create_task(relay.run(stop)), asyncio.create_task(worker.run(stop))]
    await asyncio.sleep(0.5)  # both loops up and waiting before the first due time
    t0 = time.time() + lead + 1.0
    ctx = multiprocessing.get_context("spawn")
    producer = ctx.Process(target=produce, args=(url, rate, seconds, t0, lead, 0.1))
    producer.start()
    try:
        await _until(lambda: len(samples) >= total, limit=seconds + lead + 60)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await asyncio.to_thread(producer.join, 30)
    assert producer.exitcode == 0, f"producer exited with {producer.exitcode}"
    got = counts(app)
    assert got == {"SUCCEEDED": total}, f"lateness run left {got}"
    late = sorted((s - d) * 1000.0 for s, d in samples)
    # The ten latest starts, as (position in due order, ms late): a warm-up
    # shows as small positions, a stall as neighbours.
    by_due = sorted(samples, key=lambda x: x[1])
    worst = sorted(range(len(by_due)), key=lambda i: by_due[i][0] - by_due[i][1])[-10:]
    worst_at = [(i, round((by_due[i][0] - by_due[i][1]) * 1000.0, 1)) for i in sorted(worst)]
    # Where the time went: due -> claimed (waiting to be picked up: wake-up,
    # capacity) and claimed -> handler start (thread hand-offs, the slot).
    with app.engine.connect() as conn:
        claimed = {row[0]: row[1].timestamp() for row in conn.execute(
            select(job.c.id, job.c.claimed_at))}
    waits = sorted((claimed[j] - d) * 1000.0 for j, _, d in samples_by_id)
    hands = sorted((s - claimed[j]) * 1000.0 for j, s, _ in samples_by_id)
    return {
        "jobs": total,
        "p50_ms": _pct(late, 0.50),
        "p99_ms": _pct(late, 0.99),
        "max_ms": late[-1],
        "worst_at": worst_at,
        "mean_ms": statistics.fmean(late),
        "early": sum(1 for x in late if x < 0),
        "min_ms": late[0],
        "due_to_claim_p50_ms": _pct(waits, 0.50),
        "due_to_claim_p99_ms": _pct(waits, 0.99),
        "claim_to_start_p50_ms": _pct(hands, 0.50),
        "claim_to_start_p99_ms": _pct(hands, 0.99),
    }


def lateness_trial(url: str, rate: float, seconds: float) -> dict[str, Any]:
    fresh_schema(url)
    app = make_app(url)
    cpu = time.process_time()
    result = asyncio.run(run_lateness(app, url, rate, seconds, lead=2.0))
    # CPU of the relay + worker process (the producer is another process).
    result["cpu_ms_per_job"] = (time.process_time() - cpu) / result["jobs"] * 1000.0
    app.dispose()
    return result


# --- entry point -----------------------------------------------------------------


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING)
    kind, url, *rest = argv
    if kind == "relay":
        result = relay_trial(url, int(rest[0]), raw_first="--raw-first" in rest)
    elif kind == "worker":
        result = worker_trial(url, int(rest[0]), pipeline=False)
    elif kind == "pipeline":
        result = worker_trial(url, int(rest[0]), pipeline=True)
    elif kind == "lateness":
        result = lateness_trial(url, float(rest[0]), float(rest[1]))
    else:
        raise SystemExit(f"unknown trial {kind!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
