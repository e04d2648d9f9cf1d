"""Realistic data for the dashboard tests and screenshots: jobs that really
ran (a relay and a worker), jobs that really died, jobs still to come, a
schedule, a relay's and a worker's heartbeat rows and a named lease."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from helpers import Running, job_row, make_app, schedule_committed
from sqlalchemy.orm import Session

import duebox
from duebox import Permanent, RetryPolicy
from duebox.processes.heartbeat import beat
from duebox.tables import lease

SECRET = "4111-1111-1111-1111"


@dataclass
class Seeded:
    app: duebox.Duebox
    ok: list[uuid.UUID] = field(default_factory=list)
    dead: list[uuid.UUID] = field(default_factory=list)
    future: list[uuid.UUID] = field(default_factory=list)
    keyed: uuid.UUID | None = None
    schedule_id: uuid.UUID | None = None


def seeded_app(url: str, **settings: Any) -> duebox.Duebox:
    app = make_app(url, **settings)

    @app.task("charge", queue="payments", max_attempts=2, retry=RetryPolicy(base=0.01, cap=0.02),
              mask=lambda p: {**p, "card": "****" + str(p.get("card", ""))[-4:]})
    def charge(payload: Any, ctx: duebox.JobContext) -> None:
        # Quoting the payload, as exception messages do (the dashboard masks it).
        raise Permanent(f"card {payload['card']} declined by the provider")

    @app.task("report", queue="reports")
    def report(payload: Any, ctx: duebox.JobContext) -> None:
        pass

    @app.task("leaky", queue="reports", mask=lambda p: p["missing"])
    def leaky(payload: Any, ctx: duebox.JobContext) -> None:
        pass

    return app


def seed(app: duebox.Duebox, *, ok: int = 12, dead: int = 2, future: int = 30) -> Seeded:
    s = Seeded(app)
    s.ok = [schedule_committed(app, "report", {"n": i}, tenant=f"acme-{i % 3}")
            for i in range(ok)]
    s.dead = [schedule_committed(app, "charge", {"amount": 100 + i, "card": SECRET},
                                 key=f"order-{i}", tenant="acme-0") for i in range(dead)]
    s.keyed = s.dead[0]

    async def run() -> None:
        async with Running(app) as r:
            await r.wait(lambda: all(job_row(app.engine, i).state == "SUCCEEDED" for i in s.ok)
                         and all(job_row(app.engine, i).state == "DEAD" for i in s.dead),
                         timeout=30, what="the seeded jobs to finish")

    # Its own thread: the browser tests' Playwright already runs a loop here.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: asyncio.run(run())).result()
    s.future = [schedule_committed(app, "report", {"n": i}, delay=timedelta(minutes=5 + 7 * i),
                                   key=f"upcoming-{i}") for i in range(future)]
    schedule_committed(app, "leaky", {"x": 1}, delay=timedelta(hours=1), key="leaky-1")
    now = app.clock.now()
    with Session(app.engine) as session, session.begin():
        sid = app.schedules.add(session, "nightly-report", "report", "30 2 * * *",
                                timezone="Europe/Berlin", payload={"kind": "nightly"})
        assert isinstance(sid, uuid.UUID)
        s.schedule_id = sid
        conn = session.connection()
        beat(conn, name="relay:seed-host:1:abcd", now=now, ttl=3600,
             info={"backend": "sql", "pid": 1, "host": "seed-host"})
        beat(conn, name="worker:seed-host:2:ef01", now=now, ttl=3600,
             info={"backend": "sql", "pid": 2, "host": "seed-host", "queues": ["reports"]})
        conn.execute(lease.insert().values(name="shard:0-511", owner="relay:seed-host:1:abcd",
                                           epoch=7, expires_at=now + timedelta(seconds=30),
                                           info={"slots": "0-511"}))
    return s
