"""Fairness figures: who gets dispatched under a flood, with and without fair shares.

    python bench/fairness.py                 # PostgreSQL (DUEBOX_BENCH_PG), ~1 minute
    python bench/fairness.py --db sqlite

An injected clock makes the figures exact and repeatable: the relay runs a
pass every 0.1 simulated seconds for ``--seconds`` (30), dispatching under a
shared limit of ``--rate`` (1000) jobs/s to a broker that records each
publish.  Load, all due at the start:

* tenant ``big``: 50,000 priority-9 jobs in queue ``default`` (the flood);
* tenants ``s1``..``s3``: 200 priority-0 jobs each in ``default``;
* queue ``pay``: 300 jobs, ``reserved={"pay": 5}`` slots per batch.

Modes: ``due-order`` (fairness off: the plain claim, due time then id, with
the same throughput), ``fair`` (weights + tenants + reserved), and
``fair+quota`` (``tenant_rates={"big": 300}``).  Then aging: one queue and
tenant, a steady stream of fresh priority-3 jobs at exactly the rate, and
five priority-0 jobs waiting from the start: their worst wait for
``aging_step`` 2, 5 and 10 s (expected: 3 x aging_step).

One JSON line on stdout; a table on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

import duebox
from duebox import FakeClock, JobMessage, migrate
from duebox.brokers.base import (
    BrokerContext,
    Delivery,
    Outgoing,
    PublishingBroker,
    PublishResult,
)
from duebox.brokers.memory import MemoryBroker
from duebox.fairness.policy import DispatchPolicy
from duebox.relay import Relay
from duebox.tables import job

PG = os.environ.get("DUEBOX_BENCH_PG", "postgresql+psycopg://127.0.0.1:5432/postgres")
T0 = datetime(2030, 1, 1, tzinfo=UTC)
STEP = 0.1


class Recording(PublishingBroker):
    capabilities = replace(MemoryBroker.capabilities, name="recording")

    def __init__(self, url: str, context: BrokerContext) -> None:
        super().__init__(url, context)
        self.log: list[tuple[datetime, JobMessage]] = []

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        now = self.context.clock.now()
        self.log.extend((now, o.message) for o in batch)
        return [PublishResult(o.message.job_id, True) for o in batch]

    def consume(self, queues: Sequence[str], prefetch: int,
                wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        raise NotImplementedError


def fresh(url: str) -> None:
    eng = sa.create_engine(url)
    with eng.begin() as conn:
        for t in (*reversed([t.name for t in duebox.metadata.sorted_tables]),
                  "duebox_alembic_version"):
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {t}"))
    migrate.upgrade(eng)
    eng.dispose()


def setup(url: str, policy: DispatchPolicy, batch: int) -> tuple[duebox.Duebox, Relay,
                                                                    Recording, FakeClock]:
    fresh(url)
    clock = FakeClock(T0)
    app = duebox.Duebox(url, "sql://", clock=clock, settings=duebox.Settings(
        batch_size=batch, poll_interval=STEP, catchup_after=1e6))
    app.add_task("work", lambda payload, ctx: None)
    app.add_task("pay", lambda payload, ctx: None, queue="pay")
    broker = Recording("recording://", BrokerContext(app.engine, clock, app.settings))
    return app, Relay(app, broker=broker, policy=policy, recover_interval=1e6), broker, clock


def add(app: duebox.Duebox, task: str, n: int, at: datetime, **kw: Any) -> set[uuid.UUID]:
    ids: set[uuid.UUID] = set()
    with app.engine.begin() as conn:
        for start in range(0, n, 5000):
            got = app.schedule_many(conn, [app.new_job(task, None, at=at, **kw)
                                           for _ in range(min(5000, n - start))])
            assert isinstance(got, list)
            ids |= set(got)
    return ids


async def flood(url: str, mode: str, rate: float, seconds: float) -> dict[str, Any]:
    per_pass = int(rate * STEP)
    if mode == "due-order":
        policy, batch = DispatchPolicy(), per_pass
    else:
        quotas = {"big": rate * 0.3} if mode == "fair+quota" else {}
        policy = DispatchPolicy(rate=rate, burst_seconds=STEP, reserved={"pay": 5},
                                tenant_rates=quotas)
        batch = 500
    app, relay, broker, clock = setup(url, policy, batch)
    add(app, "work", 50_000, T0 - timedelta(seconds=10), tenant="big", priority=9)
    for t in ("s1", "s2", "s3"):
        add(app, "work", 200, T0, tenant=t)
    add(app, "pay", 300, T0, tenant="p")
    for _ in range(round(seconds / STEP)):
        clock.advance(STEP)
        if mode == "due-order":  # one bounded batch a pass: the same throughput
            owner = f"{relay.name}#{uuid.uuid4().hex[:6]}"
            from duebox.relay import PassStats

            (pipeline,) = relay.pipelines
            await pipeline.publish(pipeline.claim(owner), owner, PassStats())
        else:
            await relay.run_pass()
    by_tenant: Counter[str] = Counter()
    done_at: dict[str, datetime] = {}
    with app.engine.connect() as conn:
        tenants = dict(conn.execute(sa.select(job.c.id, job.c.tenant)).all())
    for now, m in broker.log:
        t = tenants.get(m.job_id) or ""
        by_tenant[t] += 1
        done_at[t] = now
    app.dispose()
    total = sum(by_tenant.values())
    return {"mode": mode, "dispatched": total, "rate": round(total / seconds, 1),
            "by_tenant": dict(sorted(by_tenant.items())),
            "small_drained_s": {t: round((done_at[t] - T0).total_seconds(), 1)
                                for t in ("s1", "s2", "s3", "p")
                                if by_tenant[t] == (300 if t == "p" else 200)}}


async def aging(url: str, step: float) -> dict[str, Any]:
    policy = DispatchPolicy(rate=10.0, aging_step=step)
    app, relay, broker, clock = setup(url, policy, 50)
    low = add(app, "work", 5, T0, priority=0)
    add(app, "work", 10, T0, priority=3)
    for _ in range(round(12 * step / 0.3)):
        clock.advance(0.3)
        add(app, "work", 3, clock.now(), priority=3)
        await relay.run_pass()
    sent = {m.job_id: now for now, m in broker.log}
    app.dispose()
    waits = [(sent[i] - T0).total_seconds() for i in low if i in sent]
    return {"aging_step": step, "low_dispatched": len(waits),
            "worst_wait_s": round(max(waits), 1) if waits else None,
            "expected_s": 3 * step}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", choices=("postgresql", "sqlite"), default="postgresql")
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--pg-url", default=PG)
    args = p.parse_args(argv)
    admin = None
    if args.db == "postgresql":
        name = f"duebox_fair_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(args.pg_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        url = args.pg_url.rsplit("/", 1)[0] + "/" + name
    else:
        url = f"sqlite:///{tempfile.mkdtemp()}/fair.db"
    try:
        floods = [asyncio.run(flood(url, m, args.rate, args.seconds))
                  for m in ("due-order", "fair", "fair+quota")]
        ages = [asyncio.run(aging(url, s)) for s in (2.0, 5.0, 10.0)]
    finally:
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()
    result = {"db": args.db, "rate": args.rate, "seconds": args.seconds, "flood": floods,
              "aging": ages}
    print(json.dumps(result))
    for f in floods:
        print(f"{f['mode']:>11}: {f['dispatched']} jobs ({f['rate']}/s) {f['by_tenant']} "
              f"drained: {f['small_drained_s']}", file=sys.stderr)
    for a in ages:
        print(f"aging_step {a['aging_step']}: worst wait {a['worst_wait_s']} s "
              f"(expected 3 x step = {a['expected_s']} s, plus a pass)", file=sys.stderr)


if __name__ == "__main__":
    main()
