"""Dispatch-path benchmarks per backend: start lateness and throughput.

    python bench/lateness.py lateness   --backends sql,redis,amqp,kafka [--repeats 3]
    python bench/lateness.py throughput --backends sql,redis,amqp,kafka [--n 20000]

``lateness``: ``--n`` (500) no-op jobs due at distinct times spread evenly
over ``--spread`` (10) seconds, starting a second after one relay (this
process) and one worker process are up.  Lateness is the handler's start
(``time.time()`` in the worker process) minus the job's ``due_at``; a
negative value is an early start and is counted separately.

``throughput``: ``--n`` (20,000) no-op jobs due now.  The relay (this
process) publishes them all first (its rate is reported), then one worker
process with the default concurrency completes them; the worker rate is
``n`` over first handler start to last completion.  ``sql://`` has no relay
step: its worker claims the rows.

Every run uses a fresh PostgreSQL database (``--pg``, a server URL for
CREATE/DROP DATABASE), its own Redis prefix, RabbitMQ vhost and Kafka topic
prefix; the Kafka-protocol mock (tests/services/kafka_mock.py) is started
for the run when nothing listens on ``--kafka``.  Figures are per trial;
the summary line is the median over ``--repeats``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing
import multiprocessing.synchronize
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import duebox
from duebox import Settings, migrate
from duebox.consumers import Worker
from duebox.leases import jobstore
from duebox.relay import Relay

ROOT = Path(__file__).resolve().parents[1]
PG = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
AMQP = "amqp://guest:guest@127.0.0.1:5672"
KAFKA = "127.0.0.1:19192"


# --- services ----------------------------------------------------------------------


@contextlib.contextmanager
def pg_database(admin_url: str) -> Iterator[str]:
    name = f"duebox_lat_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextlib.contextmanager
def broker_url(backend: str, kafka: str, lookahead: float | None) -> Iterator[str]:
    tag = uuid.uuid4().hex[:8]
    if backend == "sql":
        yield "sql://" if lookahead is None else f"sql://?lookahead={lookahead}"
    elif backend == "redis":
        import redis

        yield f"{REDIS}?prefix=lat{tag}"
        client = redis.Redis.from_url(REDIS)
        keys = list(client.scan_iter(f"lat{tag}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
    elif backend == "amqp":
        from backends_services import test_backends

        with test_backends().scratch_vhost(f"duebox_lat_{tag}") as vhost:
            yield f"{AMQP}/{vhost}?delay_mode=tiers"
    elif backend == "kafka":
        yield f"kafka://{kafka}?prefix=lat{tag}.&fetch_max_wait_ms=5"
    else:
        raise SystemExit(f"--backends: unknown backend {backend!r}")


@contextlib.contextmanager
def kafka_running(address: str) -> Iterator[str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from backends import kafka_reachable

    if kafka_reachable(address):
        yield address
        return
    sys.path.insert(0, str(ROOT / "tests" / "services"))
    import kafka_mock

    pidfile = Path("/tmp/duebox-bench-kafka/kafka_mock.pid")
    started = kafka_mock.start_background(int(address.rsplit(":", 1)[1]), pidfile=pidfile)
    try:
        yield started
    finally:
        kafka_mock.stop_background(pidfile)


# --- the worker process -------------------------------------------------------------


def make_app(db: str, broker: str, register: bool = True) -> duebox.Duebox:
    app = duebox.Duebox(db, broker, settings=Settings())
    if register:  # the producer side only needs the name
        app.task("noop")(_noop)
    return app


def _noop(payload: Any, ctx: duebox.JobContext) -> None:
    return None


def worker_main(db: str, broker: str, n: int, out: str,
                ready: multiprocessing.synchronize.Event) -> None:
    logging.basicConfig(level=logging.WARNING)
    app = make_app(db, broker, register=False)
    starts: list[tuple[float, float]] = []

    @app.task("noop")
    def noop(payload: Any, ctx: duebox.JobContext) -> None:
        starts.append((time.time(), ctx.due_at.timestamp()))

    async def main() -> dict[str, Any]:
        stop = asyncio.Event()
        worker = Worker(app)
        run = asyncio.create_task(worker.run(stop))
        ready.set()
        cpu = time.process_time()
        while worker.stats.succeeded + worker.stats.failed < n and not run.done():  # noqa: ASYNC110 - polls counters
            await asyncio.sleep(0.01)
        done = time.time()
        cpu = time.process_time() - cpu
        stop.set()
        await run
        return {"done": done, "cpu": cpu, "discarded": dict(worker.stats.discarded),
                "failed": worker.stats.failed, "deferred": worker.stats.deferred}

    result = asyncio.run(main())
    result["starts"] = starts
    Path(out).write_text(json.dumps(result))
    app.dispose()


def spawn_worker(db: str, broker: str, n: int, out: str) -> multiprocessing.Process:
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=worker_main, args=(db, broker, n, out, ready))
    proc.start()
    if not ready.wait(60):
        proc.kill()
        raise RuntimeError("the worker process did not start")
    return proc


# --- trials --------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    k = min(len(values) - 1, max(0, round(q * len(values)) - 1))
    return sorted(values)[k]


def schedule(app: duebox.Duebox, dues: list[datetime]) -> None:
    with app.engine.begin() as conn:
        for i in range(0, len(dues), 1000):
            app.schedule_many(conn, [app.new_job("noop", None, at=d) for d in dues[i:i + 1000]])


RELAY_KW: dict[str, Any] = {}


async def relay_until(app: duebox.Duebox, stop: asyncio.Event) -> Relay:
    relay = Relay(app, **RELAY_KW)
    await relay.run(stop)
    return relay


def finish(app: duebox.Duebox, proc: multiprocessing.Process, out: Path, n: int,
           timeout: float) -> dict[str, Any]:
    proc.join(timeout)
    if proc.exitcode != 0:
        proc.kill()
        raise RuntimeError(f"the worker process exited with {proc.exitcode}")
    result: dict[str, Any] = json.loads(out.read_text())
    with app.engine.connect() as conn:
        got = jobstore.counts_by_state(conn)
    if got != {"SUCCEEDED": n}:
        raise RuntimeError(f"jobs left {got}; worker {result['discarded']}")
    return result


def lateness_trial(db: str, broker: str, n: int, spread: float) -> dict[str, Any]:
    app = make_app(db, broker)
    migrate.upgrade(app.engine)
    out = Path(f"/tmp/duebox-lat-{uuid.uuid4().hex}.json")

    async def main() -> dict[str, Any]:
        stop = asyncio.Event()
        relay = asyncio.create_task(relay_until(app, stop))
        proc = await asyncio.to_thread(spawn_worker, db, broker, n, str(out))
        try:
            await asyncio.sleep(1.0)  # the worker subscribed, the relay asleep
            t0 = time.time() + 2.0  # room for a slow start on a busy machine
            dues = [datetime.fromtimestamp(t0 + i * spread / n, UTC) for i in range(n)]
            await asyncio.to_thread(schedule, app, dues)
            result = await asyncio.to_thread(finish, app, proc, out, n, spread + 60)
        finally:
            proc.kill()
            stop.set()
            await relay
        return result

    r = asyncio.run(main())
    app.dispose()
    out.unlink(missing_ok=True)
    late = [(s - d) * 1000.0 for s, d in r["starts"]]
    return {"jobs": len(late), "p50_ms": pct(late, 0.5), "p99_ms": pct(late, 0.99),
            "max_ms": max(late), "early": sum(1 for x in late if x < 0),
            "worker_cpu_ms_per_job": r["cpu"] / n * 1000.0}


def throughput_trial(db: str, broker: str, n: int) -> dict[str, Any]:
    app = make_app(db, broker)
    migrate.upgrade(app.engine)
    due = datetime.now(UTC) - timedelta(seconds=1)
    schedule(app, [due] * n)
    with app.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE duebox_job"))
    out = Path(f"/tmp/duebox-lat-{uuid.uuid4().hex}.json")
    result: dict[str, Any] = {"jobs": n}

    async def main() -> dict[str, Any]:
        stop = asyncio.Event()
        relay_task = None
        if broker != "sql://":
            relay_task = asyncio.create_task(relay_until(app, stop))
            t = time.perf_counter()
            while True:
                with app.engine.connect() as conn:
                    got = jobstore.counts_by_state(conn)
                if got.get("ENQUEUED", 0) >= n:
                    break
                if relay_task.done():
                    relay_task.result()
                await asyncio.sleep(0.01)
            result["relay_per_s"] = n / (time.perf_counter() - t)
        proc = await asyncio.to_thread(spawn_worker, db, broker, n, str(out))
        try:
            return await asyncio.to_thread(finish, app, proc, out, n, 600)
        finally:
            proc.kill()
            stop.set()
            if relay_task is not None:
                await relay_task

    r = asyncio.run(main())
    app.dispose()
    out.unlink(missing_ok=True)
    first = min(s for s, _ in r["starts"])
    result["worker_per_s"] = n / (r["done"] - first)
    result["worker_cpu_ms_per_job"] = r["cpu"] / n * 1000.0
    return result


def fmt(r: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v:,.2f}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in r.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("lateness", "throughput"))
    p.add_argument("--backends", default="sql,redis,amqp,kafka")
    p.add_argument("--n", type=int)
    p.add_argument("--spread", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--pg", default=PG)
    p.add_argument("--kafka", default=KAFKA)
    p.add_argument("--near-window", type=float, help="Relay(near_window=...)")
    p.add_argument("--lookahead", type=float, help="sql:// ?lookahead=")
    a = p.parse_args()
    if a.near_window is not None:
        RELAY_KW["near_window"] = a.near_window
    logging.basicConfig(level=logging.WARNING)
    n = a.n or (500 if a.mode == "lateness" else 20_000)
    with contextlib.ExitStack() as stack:
        kafka = a.kafka
        if "kafka" in a.backends.split(","):
            kafka = stack.enter_context(kafka_running(a.kafka))
        for backend in a.backends.split(","):
            trials = []
            for i in range(a.repeats):
                with pg_database(a.pg) as db, broker_url(backend, kafka, a.lookahead) as broker:
                    if a.mode == "lateness":
                        r = lateness_trial(db, broker, n, a.spread)
                    else:
                        r = throughput_trial(db, broker, n)
                trials.append(r)
                print(f"{a.mode} {backend} trial {i + 1}: {fmt(r)}", flush=True)
            if a.repeats > 1:
                med = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
                print(f"{a.mode} {backend} MEDIAN: {fmt(med)}", flush=True)


if __name__ == "__main__":
    main()
