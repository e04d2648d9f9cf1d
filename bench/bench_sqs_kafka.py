"""Throughput and lateness of the ``sqs://`` and ``kafka://`` backends.

    python bench/bench_sqs_kafka.py [--db postgres|sqlite] [--trials 3] [--quick]

Needs LocalStack's SQS (``localstack/start.sh``; DUEBOX_TEST_SQS_ENDPOINT) and a
Kafka-protocol broker (``tests/services/kafka_mock.py start``; DUEBOX_TEST_KAFKA);
either is started here when nothing answers, and stopped again at the end.
PostgreSQL: DUEBOX_BENCH_PG (a server URL with CREATE DATABASE rights; a
scratch database is created and dropped).  Prints a markdown table.

Measured, in one run:

* **SQS relay throughput** vs **raw SendMessageBatch** to the same LocalStack:
  N jobs already due, timed from the first relay pass until all are
  ``ENQUEUED``; raw: the same number of messages of the same size in batches
  of 10 with the same number of threads, no database.
* **Kafka relay throughput**: the same with ``kafka://`` (acks=all, idempotent).
* **Lateness**: a relay and a worker run while jobs come due spread over a few
  seconds; each handler records its start time; lateness = start - due_at.
  None may be negative.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import duebox
from duebox import jobstore, migrate
from duebox.consumers import Worker
from duebox.message import JobMessage
from duebox.relay import Relay

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "services"))
SQS = os.environ.get("DUEBOX_TEST_SQS_ENDPOINT", "http://127.0.0.1:4566")
KAFKA = os.environ.get("DUEBOX_TEST_KAFKA", "127.0.0.1:19092")
PG = os.environ.get("DUEBOX_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")

meta = sa.MetaData()
effects = sa.Table("bench_effects", meta,
                   sa.Column("job_id", sa.String(64), primary_key=True),
                   sa.Column("due_us", sa.BigInteger, nullable=False),
                   sa.Column("started_us", sa.BigInteger, nullable=False))


# --- services and databases ---------------------------------------------------------


def sqs_up() -> bool:
    for _ in range(3):
        try:
            with urllib.request.urlopen(f"{SQS}/_localstack/health", timeout=5) as r:
                return json.load(r)["services"].get("sqs") in ("available", "running")
        except (OSError, ValueError, KeyError):
            time.sleep(1)
    return False


def kafka_up() -> bool:
    import socket

    host, _, port = KAFKA.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


class Services:
    def __init__(self) -> None:
        self.started: list[str] = []

    def __enter__(self) -> Services:
        if not sqs_up():
            out = subprocess.run([str(ROOT / "localstack" / "start.sh"), "start"], check=True,
                                 capture_output=True, text=True).stdout
            if "SQS ready" in out:  # not "already answers": then it is not ours to stop
                self.started.append("sqs")
        if not kafka_up():
            import kafka_mock

            kafka_mock.start_background(int(KAFKA.rsplit(":", 1)[1]))
            self.started.append("kafka")
        return self

    def __exit__(self, *exc: object) -> None:
        if "sqs" in self.started:
            subprocess.run([str(ROOT / "localstack" / "start.sh"), "stop"], check=False)
        if "kafka" in self.started:
            import kafka_mock

            kafka_mock.stop_background()


def database(kind: str, scratch: Path) -> tuple[str, Any]:
    """A fresh migrated database URL and a function that drops it."""
    if kind == "sqlite":
        url = f"sqlite:///{scratch}/bench-{uuid.uuid4().hex[:6]}.db"
        drop = lambda: None  # noqa: E731
    else:
        name = f"duebox_bench_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(PG, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(sa.text(f'CREATE DATABASE "{name}"'))
        url = PG.rsplit("/", 1)[0] + "/" + name

        def drop() -> None:
            with admin.connect() as c:
                c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()
    eng = duebox.Duebox(database_url=url).engine
    migrate.upgrade(eng)
    meta.create_all(eng)
    eng.dispose()
    return url, drop


def make_app(db: str, broker: str, **settings: Any) -> duebox.Duebox:
    values = {"poll_interval": 0.05, "batch_size": 500, "lease_seconds": 30.0,
              "concurrency": 16, **settings}
    app = duebox.Duebox(db, broker, settings=duebox.Settings(**values))

    @app.task("bench")
    def bench(payload: Any, ctx: duebox.JobContext) -> None:
        ctx.session.execute(effects.insert().values(
            job_id=str(ctx.job_id), due_us=int(ctx.due_at.timestamp() * 1e6),
            started_us=time.time_ns() // 1000))

    return app


def insert(app: duebox.Duebox, dues: list[datetime]) -> None:
    with app.engine.begin() as conn:
        for i in range(0, len(dues), 1000):
            app.schedule_many(conn, [app.new_job("bench", {"i": j}, at=d)
                                     for j, d in enumerate(dues[i:i + 1000], start=i)])


def enqueued(app: duebox.Duebox) -> int:
    with app.engine.connect() as conn:
        return jobstore.counts_by_state(conn).get("ENQUEUED", 0)


# --- measurements -------------------------------------------------------------------


async def relay_throughput(app: duebox.Duebox, n: int) -> float:
    insert(app, [datetime.now(UTC) - timedelta(seconds=1)] * n)
    relay = Relay(app, batch_size=500)
    await relay.broker.open()
    try:
        start = time.perf_counter()
        while True:
            await relay.run_pass()
            if relay.totals.marked + relay.totals.lost_marks >= n:
                break
        elapsed = time.perf_counter() - start
    finally:
        await relay.broker.close()
    assert enqueued(app) == n, "not every job was enqueued"
    return n / elapsed


def raw_sqs(n: int, threads: int) -> float:
    import boto3

    client = boto3.client("sqs", endpoint_url=SQS, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test",
                          config=__import__("botocore.config").config.Config(
                              max_pool_connections=threads + 8))
    url = client.create_queue(QueueName=f"bench-raw-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    msg = JobMessage(uuid.uuid4(), "bench", "default", 1, 0, datetime.now(UTC), {"i": 1})
    body = msg.encode().decode()
    attrs = {k: {"DataType": "String", "StringValue": v} for k, v in msg.header_map().items()}

    def send(k: int) -> None:
        entries = [{"Id": str(i), "MessageBody": body, "MessageAttributes": attrs}
                   for i in range(10)]
        reply = client.send_message_batch(QueueUrl=url, Entries=entries)
        assert not reply.get("Failed"), reply

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(send, range(n // 10)))
        return n / (time.perf_counter() - start)
    finally:
        client.delete_queue(QueueUrl=url)


async def lateness(app: duebox.Duebox, n: int, spread: float, lead: float,
                   concurrency: int) -> list[float]:
    """Run a relay and a worker; ``n`` jobs come due over ``spread`` seconds
    starting ``lead`` seconds from now.  Returns lateness in ms."""
    stop = asyncio.Event()
    relay, worker = Relay(app), Worker(app, concurrency=concurrency)
    tasks = [asyncio.create_task(relay.run(stop)), asyncio.create_task(worker.run(stop))]
    try:
        await asyncio.sleep(2.0)  # connected, group joined
        now = datetime.now(UTC)
        dues = [now + timedelta(seconds=lead + spread * i / n) for i in range(n)]
        insert(app, dues)
        deadline = time.monotonic() + lead + spread + 60
        while time.monotonic() < deadline:
            with app.engine.connect() as conn:
                done = conn.execute(sa.select(sa.func.count()).select_from(effects)).scalar_one()
            if done >= n:
                break
            for t in tasks:
                if t.done():
                    t.result()
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(effects.c.due_us, effects.c.started_us)).all()
    assert len(rows) == n, f"{len(rows)} of {n} jobs ran"
    return sorted((s - d) / 1000 for d, s in rows)


def pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument("--quick", action="store_true", help="small N: checks the harness")
    parser.add_argument("--trials", type=int, default=3, help="throughput trials (median)")
    args = parser.parse_args()
    q = args.quick
    n_sqs, n_kafka = (500, 2000) if q else (5000, 50000)
    # Lateness is measured at a rate one worker keeps up with (about 300
    # jobs/s on PostgreSQL here), so it shows the delivery path, not a backlog.
    n_late_sqs, n_late_kafka = (50, 100) if q else (300, 500)
    rows: list[tuple[str, str, str, str]] = []
    scratch = Path(tempfile.mkdtemp(prefix="duebox-bench-"))
    with Services():
        tag = uuid.uuid4().hex[:8]
        sqs_url = f"sqs://test:test@{SQS.split('://', 1)[1]}?prefix=b{tag}-&wait=1"
        kafka_url = (f"kafka://{KAFKA}?prefix=b{tag}.&group=b{tag}&fetch_max_wait_ms=5"
                     f"&partitions=4")

        trials = 1 if q else args.trials
        raws, relays, kafkas = [], [], []
        for t in range(trials):  # interleaved, so drift on a shared machine hits both
            raws.append(raw_sqs(n_sqs, 8))
            db, drop = database(args.db, scratch)
            try:
                app = make_app(db, sqs_url.replace(f"b{tag}-", f"b{tag}{t}-"))
                relays.append(await relay_throughput(app, n_sqs))
                app.dispose()
            finally:
                drop()
            db, drop = database(args.db, scratch)
            try:
                app = make_app(db, kafka_url.replace(f"b{tag}.", f"b{tag}{t}."))
                kafkas.append(await relay_throughput(app, n_kafka))
                app.dispose()
            finally:
                drop()
        raw, relay_rate = statistics.median(raws), statistics.median(relays)
        ratio = statistics.median(r / w for r, w in zip(relays, raws, strict=True))
        kafka_rate = statistics.median(kafkas)

        def spread(values: list[float]) -> str:
            return f" ({min(values):,.0f}–{max(values):,.0f})" if len(values) > 1 else ""

        rows.append(("SQS raw SendMessageBatch (10/call, 8 threads)",
                     f"{raw:,.0f} msg/s{spread(raws)}", "—", f"N={n_sqs}, {trials} trials"))
        rows.append(("SQS relay throughput", f"{relay_rate:,.0f} msg/s{spread(relays)}, "
                     f"{100 * ratio:.0f}% of raw (median of ratios)", ">= 70% of raw",
                     "PASS" if ratio >= 0.7 else "FAIL"))
        rows.append(("Kafka relay throughput", f"{kafka_rate:,.0f} msg/s{spread(kafkas)}",
                     ">= 20,000 msg/s", "PASS" if kafka_rate >= 20000 else "FAIL"))

        for name, url, n, spread, lead, target in (
                ("SQS", sqs_url.replace(f"b{tag}-", f"l{tag}-"), n_late_sqs, 10.0, 3.0, 1100.0),
                ("Kafka", kafka_url.replace(f"b{tag}.", f"l{tag}.").replace(
                    f"group=b{tag}", f"group=l{tag}"), n_late_kafka, 10.0, 2.0, 20.0)):
            db, drop = database(args.db, scratch)
            try:
                app = make_app(db, url)
                late = await lateness(app, n, spread, lead, concurrency=16)
                app.dispose()
            finally:
                drop()
            early = sum(1 for x in late if x < 0)
            rows.append((f"{name} lateness ({n} jobs over {spread:g} s)",
                         f"p50 {pct(late, 50):.1f} ms, p99 {pct(late, 99):.1f} ms, "
                         f"max {late[-1]:.1f} ms, early {early}",
                         f"p99 <= {target:g} ms, none early",
                         "PASS" if pct(late, 99) <= target and early == 0 else "FAIL"))
    print(f"\nduebox sqs/kafka benchmark — database {args.db}, "
          f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.2f}\n")
    print("| measurement | result | target | verdict |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    asyncio.run(main())
