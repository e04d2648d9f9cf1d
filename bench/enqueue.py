"""Enqueue throughput inside the caller's transaction (issue #8), against the
bare driver in the same run.

    python bench/enqueue.py                     # 20,000 jobs, batches of 1,000, 3 runs
    python bench/enqueue.py --jobs 5000 --runs 1
    python bench/enqueue.py --profile-loop 30   # duebox path only, for py-spy to attach

What is timed is what bench/peers/peer_duebox.py times for "duebox-sql
enqueue": one ``engine.begin()`` transaction, ``app.new_job("noop", {"due":
t})`` per job and ``app.schedule_many`` per 1,000, then the commit.  The
baselines insert the same rows (the same columns, a JSONB payload, one
``pg_notify`` per batch like duebox's wake-up) with psycopg alone, in one
transaction too: ``executemany`` (pipelined by psycopg 3) and ``COPY``.
The machine is shared, so the figure to compare across runs is duebox's
rate divided by a baseline's from the same run, not the rate itself; the
enqueuing process's own CPU time per job (``cpu_us``) is printed too, as it
moves less with other load than wall time does.

PostgreSQL (``--pg-url``, default ``DUEBOX_BENCH_PG`` or the local server):
the run creates its own database and drops it at the end.  ``--url`` times
the duebox path alone on another database (SQLite, MariaDB), unchanged.

One JSON line on stdout; a human summary on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

import duebox
from duebox import migrate

PG = os.environ.get("DUEBOX_BENCH_PG", "postgresql+psycopg://127.0.0.1:5432/postgres")

COLUMNS = ("id", "task", "queue", "payload", "headers", "due_at", "state", "version",
           "attempt", "max_attempts", "priority", "tenant", "key", "schedule_id",
           "nominal_fire_at", "expires_at", "lease_generation", "created_at", "updated_at",
           "shard")
INSERT = (f"INSERT INTO duebox_job ({', '.join(COLUMNS)}) "
          f"VALUES ({', '.join(['%s'] * len(COLUMNS))})")
COPY = f"COPY duebox_job ({', '.join(COLUMNS)}) FROM STDIN"


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def make_app(url: str) -> duebox.Duebox:
    app = duebox.Duebox(url)
    app.add_task("noop", lambda payload, ctx: None)
    return app


Timing = tuple[float, float]  # wall seconds, this process's CPU seconds


def duebox_run(app: duebox.Duebox, n: int, batch: int) -> Timing:
    """Seconds for n jobs, exactly as the peers' harness enqueues them."""
    dues = [time.time()] * n
    start, cpu = time.perf_counter(), time.process_time()
    with app.engine.begin() as conn:
        for i in range(0, n, batch):
            app.schedule_many(conn, [app.new_job("noop", {"due": d})
                                     for d in dues[i:i + batch]])
    return time.perf_counter() - start, time.process_time() - cpu


def _raw_rows(chunk: list[float]) -> list[tuple[Any, ...]]:
    from psycopg.types.json import Jsonb

    now = datetime.now(UTC)
    rows = []
    for d in chunk:
        jid = uuid.UUID(bytes=os.urandom(16))
        rows.append((jid, "noop", "default", Jsonb({"due": d}), None, now, "SCHEDULED", 1, 0,
                     3, 0, None, None, None, None, None, 0, now, now, jid.int % 1024))
    return rows


def raw_executemany(dsn: str, n: int, batch: int) -> Timing:
    import psycopg

    dues = [time.time()] * n
    with psycopg.connect(dsn) as conn:
        start, cpu = time.perf_counter(), time.process_time()
        with conn.transaction(), conn.cursor() as cur:
            for i in range(0, n, batch):
                cur.executemany(INSERT, _raw_rows(dues[i:i + batch]))
                cur.execute("SELECT pg_notify('duebox_jobs', '')")
        return time.perf_counter() - start, time.process_time() - cpu


def raw_copy(dsn: str, n: int, batch: int) -> Timing:
    import psycopg

    dues = [time.time()] * n
    with psycopg.connect(dsn) as conn:
        start, cpu = time.perf_counter(), time.process_time()
        with conn.transaction(), conn.cursor() as cur:
            for i in range(0, n, batch):
                with cur.copy(COPY) as copy:
                    for row in _raw_rows(dues[i:i + batch]):
                        copy.write_row(row)
                cur.execute("SELECT pg_notify('duebox_jobs', '')")
        return time.perf_counter() - start, time.process_time() - cpu


def count_and_clear(engine: sa.Engine, expect: int) -> None:
    with engine.begin() as conn:
        got = conn.execute(sa.text("SELECT count(*) FROM duebox_job")).scalar_one()
        if got != expect:
            raise SystemExit(f"expected {expect} rows, found {got}")
        conn.execute(sa.text("DELETE FROM duebox_job"))
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM duebox_job"))


def measure(url: str, jobs: int, batch: int, runs: int) -> dict[str, Any]:
    app = make_app(url)
    migrate.upgrade(app.engine)
    pg = app.engine.dialect.name == "postgresql"
    dsn = app.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    ways: dict[str, Callable[[], Timing]] = {
        "duebox": lambda: duebox_run(app, jobs, batch)}
    if pg:
        ways["psycopg executemany"] = lambda: raw_executemany(dsn, jobs, batch)
        ways["psycopg COPY"] = lambda: raw_copy(dsn, jobs, batch)
    # Warm-up: connections, statement caches, first-call imports.
    for way in ways.values():
        way()
        count_and_clear(app.engine, jobs)
    loads = [loadavg()]
    seconds: dict[str, list[Timing]] = {name: [] for name in ways}
    for _ in range(runs):  # interleaved, so load drifts hit every way alike
        for name, way in ways.items():
            seconds[name].append(way())
            count_and_clear(app.engine, jobs)
        loads.append(loadavg())
    app.dispose()
    rates = {name: [jobs / wall for wall, _ in secs] for name, secs in seconds.items()}
    cpu_us = {name: statistics.median(c * 1e6 / jobs for _, c in secs)
              for name, secs in seconds.items()}
    median = {name: statistics.median(r) for name, r in rates.items()}
    result: dict[str, Any] = {
        "dialect": app.engine.dialect.name, "jobs": jobs, "batch": batch, "runs": runs,
        "loadavg": loads, "rates": rates, "median": median, "cpu_us": cpu_us,
        "ratio": {name: median["duebox"] / m for name, m in median.items() if name != "duebox"},
        # Per-run ratios: each pairs duebox with the baseline measured right after it.
        "run_ratios": {name: [d / b for d, b in zip(rates["duebox"], r, strict=True)]
                       for name, r in rates.items() if name != "duebox"},
    }
    return result


def scratch_pg(admin_url: str) -> tuple[str, Callable[[], None]]:
    name = f"duebox_bench_enqueue_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return admin_url.rsplit("/", 1)[0] + "/" + name, drop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pg-url", default=PG, help="admin URL; a scratch database is made")
    parser.add_argument("--url", default=None, help="time duebox alone on this database")
    parser.add_argument("--profile-loop", type=float, default=0.0, metavar="SECONDS",
                        help="only run the duebox path, over and over, for a profiler")
    args = parser.parse_args()
    drop: Callable[[], None] = lambda: None  # noqa: E731
    url = args.url
    if url is None:
        url, drop = scratch_pg(args.pg_url)
    try:
        if args.profile_loop:
            app = make_app(url)
            migrate.upgrade(app.engine)
            print(f"pid {os.getpid()}", file=sys.stderr, flush=True)
            end = time.monotonic() + args.profile_loop
            while time.monotonic() < end:
                duebox_run(app, args.jobs, args.batch)
                count_and_clear(app.engine, args.jobs)
            app.dispose()
            return
        result = measure(url, args.jobs, args.batch, args.runs)
    finally:
        drop()
    print(json.dumps(result))
    print(f"{result['dialect']}: {args.jobs:,} jobs in batches of {args.batch:,}, "
          f"{args.runs} runs, load average (1/5/15 min) {' → '.join(result['loadavg'])}",
          file=sys.stderr)
    for name, m in result["median"].items():
        spread = ", ".join(f"{r:,.0f}" for r in result["rates"][name])
        ratio = f"  duebox ÷ this {result['ratio'][name]:.2f}" if name in result["ratio"] else ""
        print(f"  {name:22} {m:9,.0f} jobs/s median ({spread}), "
              f"{result['cpu_us'][name]:.1f} CPU µs/job{ratio}", file=sys.stderr)


if __name__ == "__main__":
    main()
