"""One broker-backend benchmark trial per process; ``bench/run.py --backend``
runs these and writes RESULTS.md.

Usage (normally through run.py)::

    python bench/backends_trials.py relay    BACKEND DATABASE_URL BROKER_URL N [--raw-first]
                                             [--min-delay SECONDS]
    python bench/backends_trials.py lateness BACKEND DATABASE_URL BROKER_URL RATE SECONDS [NEAR]

BACKEND is redis, amqp, sqs or kafka; BROKER_URL a namespace of the trial's
own (``backends_services.namespace``); the trial owns DATABASE_URL's tables.
Each prints one JSON object on its last stdout line.

**relay**: N jobs in the database, timed from the first ``Relay.run_pass()``
until every job is ``ENQUEUED`` (claim, publish with the broker's confirm,
fenced mark; batches of 500).  Then, in the same process, the raw client
baseline (``backends_raw``) sends N messages of the same size to the same
server.  Due times per backend (``DUE``): what makes each backend do its
usual work.

**lateness**: relay in this process, a worker (``Worker(concurrency=8)``)
in a spawned process, and a producer process that schedules the next 0.1 s
worth of jobs every 0.1 s, due 2 s ahead and evenly spaced.  The handler
records ``time.time()`` first thing; lateness = that − ``due_at``.  NEAR
(optional) is the relay's ``near_window``: 0 hands every job to the
broker's own delay instead of publishing it just before due.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import backends_profile
import backends_raw
import trials

import duebox
from duebox.consumers import Worker
from duebox.db import check_reachable
from duebox.relay import Relay

LOAD_CHUNK = 1000
LEAD = 2.0  # seconds between scheduling a job and its due time (lateness)
WARMUP_JOBS = 5
PROFILE_ENV = backends_profile.PROFILE_ENV
FLOOR_N = 100_000  # at most this many rows for the PostgreSQL claim + mark ceiling


def due_times(backend: str, n: int, now: datetime, min_delay: float = 1.0) -> list[datetime]:
    """Due times for the relay trial.

    redis: 5 minutes ahead, so every message is parked in the sorted set
    (the ZADD path the raw baseline measures).  amqp: log-uniform from 1 s to
    30 days, so the tier topology holds delays of every magnitude (its queue
    count and memory are read afterwards); ``min_delay`` raises the low end
    (bench/amqp_delays.py: an hour, so all of them are still pending after).
    sqs and kafka: already due (kafka has no native delay; an SQS delay would
    add the broker's send-time alignment, which the raw SendMessageBatch does
    not have).
    """
    if backend == "redis":
        return [now + timedelta(minutes=5)] * n
    if backend == "amqp":
        rng = random.Random(7)
        low, high = math.log(min_delay), math.log(30 * 86400.0)
        return [now + timedelta(seconds=math.exp(rng.uniform(low, high))) for _ in range(n)]
    return [now - timedelta(seconds=1)] * n


def load(app: duebox.Duebox, dues: list[datetime]) -> None:
    with app.engine.begin() as conn:
        for start in range(0, len(dues), LOAD_CHUNK):
            app.schedule_many(conn, [
                app.new_job("noop", {"i": i}, at=due)
                for i, due in enumerate(dues[start:start + LOAD_CHUNK], start=start)])
    trials.settle(app)


async def time_relay(app: duebox.Duebox, backend: str, n: int,
                     min_delay: float) -> dict[str, Any]:
    """One job through a first pass (queue/topic declared, first-use
    reconciliation done, connections up), then ``n`` jobs timed."""
    # The broker is the trial's: this harness also runs the relay of another
    # tree (bench/relay_ab.py).
    broker = app.broker("bench-relay")
    relay = Relay(app, broker=broker, batch_size=trials.BATCH)
    await broker.open()
    load(app, due_times(backend, 1, datetime.now(UTC), min_delay))
    await relay.run_pass()
    assert relay.totals.marked == 1, f"warm-up pass: {relay.totals}"
    load(app, due_times(backend, n, datetime.now(UTC), min_delay))
    check_reachable(app.engine)
    with backends_profile.sampling(os.environ.get(PROFILE_ENV)):
        cpu, t0 = time.process_time(), time.perf_counter()
        while relay.totals.marked < n + 1:
            if (await relay.run_pass()).claimed == 0:
                break
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu
    await broker.close()
    got = trials.counts(app)
    assert got == {"ENQUEUED": n + 1}, f"relay left {got}"
    assert relay.totals.lost_marks == 0
    return {"seconds": elapsed, "rate": n / elapsed, "passes": relay.totals.passes - 1,
            "cpu_ms_per_job": cpu / n * 1000.0}


def relay_trial(backend: str, db_url: str, broker_url: str, n: int,
                raw_first: bool, min_delay: float = 1.0) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n}

    def run_relay() -> None:
        trials.fresh_schema(db_url)
        app = trials.make_app(db_url, broker_url)
        # Already-due jobs stay due-now jobs however long loading takes: on a
        # loaded machine the load outlasted catchup_after (60 s), the jobs
        # became a backlog released at catchup_rate, and the trial timed the
        # catch-up limit (or stopped at its first empty pass).
        app.settings = app.settings.with_(catchup_after=86400.0)
        out["relay"] = asyncio.run(time_relay(app, backend, n, min_delay))
        app.dispose()

    def run_raw() -> None:
        out["raw"] = backends_raw.run(backend, broker_url, n)

    def run_floor() -> None:
        # The relay's own SQL on bare psycopg: no relay can beat this.  As
        # many rows as the relay had: a claim costs more on a bigger table.
        trials.fresh_schema(db_url)
        app = trials.make_app(db_url)
        m = min(n, FLOOR_N)
        trials.load_due(app, m, trials.due_now())
        out["pg_floor"] = {"n": m, **trials.raw_pg(db_url, m)}
        app.dispose()

    if os.environ.get(PROFILE_ENV):  # a profiling run: the relay alone
        run_relay()
        return out
    for step in ((run_raw, run_relay) if raw_first else (run_relay, run_raw)):
        step()
    out["ratio"] = out["relay"]["rate"] / out["raw"]["rate"]
    if trials.is_pg(db_url):
        run_floor()
    return out


# --- lateness --------------------------------------------------------------------


def work(db_url: str, broker_url: str, total: int, warm: Any, done: Any, stop: Any,
         pipe: Any) -> None:
    """The worker process: runs until ``stop``; sets ``done`` once ``total``
    measured jobs ran; sends ``[(job id, started, due), ...]`` and its CPU time."""
    logging.basicConfig(level=logging.WARNING)
    app = duebox.Duebox(db_url, broker_url)
    samples: list[tuple[str, float, float]] = []
    warmed: list[str] = []
    lock = threading.Lock()

    def record(payload: Any, ctx: duebox.JobContext) -> None:
        started = time.time()
        with lock:
            samples.append((str(ctx.job_id), started, ctx.due_at.timestamp()))
            if len(samples) == total:
                done.set()

    def warm_up(payload: Any, ctx: duebox.JobContext) -> None:
        with lock:
            warmed.append(str(ctx.job_id))
            if len(warmed) == WARMUP_JOBS:
                warm.set()

    app.task("noop")(record)
    app.task("warm")(warm_up)

    async def main() -> None:
        halt = asyncio.Event()
        worker = Worker(app, concurrency=8)
        running = asyncio.create_task(worker.run(halt))
        await asyncio.to_thread(stop.wait)
        halt.set()
        await running

    cpu = time.process_time()
    asyncio.run(main())
    pipe.send({"samples": samples, "cpu": time.process_time() - cpu})
    app.dispose()


async def _wait(flag: Any, limit: float, what: str) -> None:
    if not await asyncio.to_thread(flag.wait, limit):
        raise TimeoutError(f"{what} did not happen within {limit:g} s")


async def run_lateness(app: duebox.Duebox, db_url: str, broker_url: str, rate: float,
                       seconds: float, relay_kw: dict[str, Any]) -> dict[str, Any]:
    total = int(rate * seconds)
    ctx = multiprocessing.get_context("spawn")
    warm, done, stop = ctx.Event(), ctx.Event(), ctx.Event()
    receive, send = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=work, args=(db_url, broker_url, total, warm, done, stop, send))
    worker.start()
    halt = asyncio.Event()
    relay = Relay(app, **relay_kw)
    relaying = asyncio.create_task(relay.run(halt))
    producer = None
    cpu = time.process_time()
    try:
        # Relay and worker up (Kafka: consumer group joined) before measuring.
        with app.engine.begin() as conn:
            app.schedule_many(conn, [app.new_job("warm") for _ in range(WARMUP_JOBS)])
        await _wait(warm, 90, f"warm-up ({WARMUP_JOBS} jobs running)")
        cpu = time.process_time()
        t0 = time.time() + LEAD + 1.0
        producer = ctx.Process(target=trials.produce, args=(db_url, rate, seconds, t0, LEAD, 0.1))
        producer.start()
        await _wait(done, seconds + LEAD + 60, f"{total} jobs running")
    finally:
        relay_cpu = time.process_time() - cpu
        stop.set()
        result = await asyncio.to_thread(receive.recv) if worker.is_alive() else None
        await asyncio.to_thread(worker.join, 30)
        halt.set()
        await relaying
        if producer is not None:
            await asyncio.to_thread(producer.join, 30)
    assert result is not None, f"the worker process exited with {worker.exitcode}"
    assert producer.exitcode == 0, f"producer exited with {producer.exitcode}"
    got = trials.counts(app)
    assert got == {"SUCCEEDED": total + WARMUP_JOBS}, f"lateness run left {got}"
    ids = {s[0] for s in result["samples"]}
    assert len(ids) == total, f"{len(result['samples'])} runs of {len(ids)} jobs, {total} due"
    late = sorted((started - due) * 1000.0 for _, started, due in result["samples"])
    by_due = sorted(result["samples"], key=lambda x: x[2])
    worst = sorted(range(len(by_due)), key=lambda i: by_due[i][1] - by_due[i][2])[-10:]
    return {
        # The ten latest starts, as (position in due order, ms late): a
        # warm-up shows as small positions, a stall as neighbours.
        "worst_at": [(i, round((by_due[i][1] - by_due[i][2]) * 1000.0, 1)) for i in sorted(worst)],
        "jobs": total, "rate": rate, "seconds": seconds,
        "p50_ms": trials._pct(late, 0.50), "p99_ms": trials._pct(late, 0.99),
        "max_ms": late[-1], "min_ms": late[0], "mean_ms": statistics.fmean(late),
        "early": sum(1 for x in late if x < 0),
        "worker_cpu_ms_per_job": result["cpu"] / (total + WARMUP_JOBS) * 1000.0,
        "relay_cpu_ms_per_job": relay_cpu / total * 1000.0,
    }


def lateness_trial(db_url: str, broker_url: str, rate: float, seconds: float,
                   relay_kw: dict[str, Any]) -> dict[str, Any]:
    trials.fresh_schema(db_url)
    app = trials.make_app(db_url, broker_url)
    app.task("warm")(trials.noop)
    check_reachable(app.engine)
    result = asyncio.run(run_lateness(app, db_url, broker_url, rate, seconds, relay_kw))
    app.dispose()
    return result


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING)
    kind, backend, db_url, broker_url, *rest = argv
    if kind == "relay":
        min_delay = float(rest[rest.index("--min-delay") + 1]) if "--min-delay" in rest else 1.0
        result = relay_trial(backend, db_url, broker_url, int(rest[0]),
                             raw_first="--raw-first" in rest, min_delay=min_delay)
    elif kind == "lateness":
        relay_kw = {"near_window": float(rest[2])} if len(rest) > 2 else {}
        result = lateness_trial(db_url, broker_url, float(rest[0]), float(rest[1]), relay_kw)
    else:
        raise SystemExit(f"unknown trial {kind!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
