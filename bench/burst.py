"""The burst: N jobs due in the same second, drained at the configured rate.

    python bench/burst.py --backend redis --jobs 100000 --rate 4000 --relays 2
    python bench/burst.py --backend sql --jobs 100000 --workers 2

PostgreSQL (``--pg-url``, default ``DUEBOX_BENCH_PG`` or the local server):
the run creates its own database and drops it at the end.

``redis``: N jobs of tenant ``big`` in queue ``default`` all due at T, plus
300 jobs of tenant ``small`` in queue ``mail`` due evenly over the expected
drain window.  ``--relays`` relays with ``DispatchPolicy(rate=R)`` share one
token bucket in the database and publish to Redis through a wrapper that
records, per message, the publish time, the delay given and the batch size.
Reported: the drain rate (first to last publish after T, and per 1-second
window), the largest batch, how many messages became visible before their
due time (must be 0), and the dispatch lag of the ``mail`` jobs during the
burst (they are still served).

``sql``: workers claim rows directly (no relay publish); rate limits are a
relay feature and do not apply, so the figure is the unlimited drain rate,
with bounded claims (prefetch) and the start lateness (never negative).

One JSON line on stdout; a human summary on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import sqlalchemy as sa

import duebox
from duebox import migrate
from duebox.brokers.base import Outgoing, PublishResult
from duebox.brokers.redis import RedisBroker
from duebox.consumers import Worker
from duebox.fairness.policy import DispatchPolicy
from duebox.relay import Relay
from duebox.tables import job

PG = os.environ.get("DUEBOX_BENCH_PG", "postgresql+psycopg://127.0.0.1:5432/postgres")
REDIS = os.environ.get("DUEBOX_BENCH_REDIS", "redis://127.0.0.1:6379/0")


class Recording(RedisBroker):
    """The real Redis broker, recording what the relay hands it."""

    log: ClassVar[list[tuple[float, float, str, float, int]]] = []  # wall, delay, queue, due, batch

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        results = await super().publish(batch)
        now = time.time()
        Recording.log.extend((now, o.delay, o.message.queue, o.message.due_at.timestamp(),
                              len(batch)) for o in batch)
        return results


def create_db(admin_url: str) -> tuple[str, sa.Engine]:
    name = f"duebox_burst_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    return admin_url.rsplit("/", 1)[0] + "/" + name, admin


def load(app: duebox.Duebox, n: int, due: datetime, window: float) -> None:
    """N burst jobs plus 300 small-tenant jobs spread over ``window`` seconds."""
    far = due
    with app.engine.begin() as conn:
        for start in range(0, n, 5000):
            app.schedule_many(conn, [app.new_job("burst", None, at=far, tenant="big")
                                     for _ in range(min(5000, n - start))])
        app.schedule_many(conn, [
            app.new_job("mail", None, at=far + timedelta(seconds=window * i / 300),
                        tenant="small") for i in range(300)])
    with app.engine.begin() as conn:
        conn.execute(sa.text("ANALYZE duebox_job"))


def shift_to_lead(app: duebox.Duebox, args: argparse.Namespace, window: float) -> datetime:
    """Load far in the future, then move everything so the burst is due
    ``--lead`` seconds from now, in one statement: loading time does not count."""
    base = datetime.now(UTC) + timedelta(days=1)
    load(app, args.jobs, base, window)
    T = datetime.now(UTC) + timedelta(seconds=args.lead)
    shift = (base - T).total_seconds()
    with app.engine.begin() as conn:
        conn.execute(sa.text("UPDATE duebox_job SET due_at = due_at - make_interval(secs => :s)"),
                     {"s": shift})
    return T


def make_app(url: str, broker_url: str, batch: int) -> duebox.Duebox:
    settings = duebox.Settings(batch_size=batch, poll_interval=0.2, catchup_after=3600.0,
                               lease_seconds=60.0, concurrency=16)
    app = duebox.Duebox(url, broker_url, settings=settings)
    app.add_task("burst", lambda payload, ctx: None)
    app.add_task("mail", lambda payload, ctx: None, queue="mail")
    return app


async def run_redis(url: str, args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"burst{uuid.uuid4().hex[:6]}"
    broker_url = f"{REDIS}?prefix={prefix}"
    app = make_app(url, broker_url, args.batch)
    window = args.jobs / args.rate
    T = shift_to_lead(app, args, window)
    policy = DispatchPolicy(rate=args.rate, burst_seconds=args.burst_seconds)
    relays = []
    for i in range(args.relays):
        from duebox.brokers.base import BrokerContext

        ctx = BrokerContext(app.engine, app.clock, app.settings, f"burst-relay-{i}")
        relays.append(Relay(app, broker=Recording(broker_url, ctx), policy=policy,
                            name=f"burst-relay-{i}"))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(r.run(stop)) for r in relays]
    total = args.jobs + 300
    deadline = time.monotonic() + args.lead + window * 3 + 60
    while len(Recording.log) < total and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.5)  # the bench's progress check, not an event wait
    stop.set()
    await asyncio.gather(*tasks)
    try:
        import redis

        client = redis.Redis.from_url(REDIS)
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
    except Exception:
        pass
    await app.adispose()
    return report(T.timestamp(), args)


def report(t0: float, args: argparse.Namespace) -> dict[str, Any]:
    log = Recording.log
    burst = sorted(w for w, _, q, _, _ in log if q == "default")
    early = sum(1 for w, d, _, due, _ in log if w + d < due - 1e-3)
    # The drain: from the first burst publish, excluding the bucket's
    # saved-up tokens at the start (burst_seconds of rate).
    span = burst[-1] - burst[0] if len(burst) > 1 else 0.0
    rate = (len(burst) - args.burst_seconds * args.rate) / span if span else 0.0
    windows: dict[int, int] = {}
    for w in burst:
        windows[int(w - burst[0])] = windows.get(int(w - burst[0]), 0) + 1
    full = [windows[k] for k in sorted(windows)[:-1]]  # the last second is partial
    mail_lag = sorted(max(0.0, w + d - due) for w, d, q, due, _ in log if q == "mail")
    return {
        "backend": "redis", "jobs": args.jobs, "relays": args.relays, "rate": args.rate,
        "burst_seconds": args.burst_seconds,
        "published": len(log), "burst_published": len(burst),
        "drain_seconds": round(span, 2), "measured_rate": round(rate, 1),
        "rate_error_pct": round(100 * (rate - args.rate) / args.rate, 2),
        "per_second_min": min(full) if full else None,
        "per_second_max": max(full) if full else None,
        "first_publish_after_due_s": round(burst[0] - t0, 3) if burst else None,
        "max_batch": max((b for *_, b in log), default=0),
        "visible_before_due": early,
        "mail_served": len(mail_lag),
        "mail_lag_p50_s": round(statistics.median(mail_lag), 3) if mail_lag else None,
        "mail_lag_max_s": round(max(mail_lag), 3) if mail_lag else None,
    }


async def run_sql(url: str, args: argparse.Namespace) -> dict[str, Any]:
    app = make_app(url, "sql://", args.batch)
    shift_to_lead(app, args, 1.0)
    workers = [Worker(app, concurrency=16, name=f"burst-worker-{i}")
               for i in range(args.workers)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]
    total = args.jobs + 300
    deadline = time.monotonic() + args.lead + 600

    def done() -> int:
        with app.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(job)
                                    .where(job.c.state == "SUCCEEDED")).scalar_one())

    while await asyncio.to_thread(done) < total and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.5)  # polls the database: there is no event to wait on
    stop.set()
    await asyncio.gather(*tasks)
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(job.c.due_at, job.c.started_at)
                            .where(job.c.started_at.is_not(None))).all()
    await app.adispose()
    starts = sorted(s.timestamp() for _, s in rows)
    early = sum(1 for d, s in rows if s < d)
    span = starts[-1] - starts[0]
    return {"backend": "sql", "jobs": args.jobs, "workers": args.workers,
            "started": len(rows), "drain_seconds": round(span, 2),
            "measured_rate": round(len(rows) / span, 1) if span else None,
            "started_before_due": early, "rate_limited": False}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("redis", "sql"), default="redis")
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--rate", type=float, default=4000.0)
    p.add_argument("--relays", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--burst-seconds", type=float, default=1.0,
                   help="how many seconds of rate the shared bucket may save up")
    p.add_argument("--lead", type=float, default=5.0, help="seconds from loading to T")
    p.add_argument("--pg-url", default=PG)
    args = p.parse_args(argv)
    url, admin = create_db(args.pg_url)
    try:
        migrate.upgrade(sa.create_engine(url))
        run = run_redis if args.backend == "redis" else run_sql
        result = asyncio.run(run(url, args))
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" '
                                 "WITH (FORCE)"))
        admin.dispose()
    print(json.dumps(result))
    print(json.dumps(result, indent=2), file=sys.stderr)


if __name__ == "__main__":
    main()
