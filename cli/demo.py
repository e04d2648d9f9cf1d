"""``duebox demo``: schedule a few hundred jobs, run a relay and a worker, and
report what happened — on SQLite, with no services."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import click
from sqlalchemy import Column, Double, MetaData, String, Table, func, inspect, select
from sqlalchemy.orm import Session

from duebox import Duebox, JobContext, migrate
from duebox.consumers import Worker

from .background import Background

demo_metadata = MetaData()
effect = Table(
    "duebox_demo_effect",
    demo_metadata,
    Column("job_id", String(36), primary_key=True),
    Column("run_id", String(32), nullable=False, index=True),
    # Epoch seconds: Double, since Float is MySQL's 4-byte FLOAT there,
    # whose 24-bit mantissa rounds today's instants to 128 s, so due and
    # start read back equal and an early start could not show.
    Column("due", Double, nullable=False),
    Column("started", Double, nullable=False),
)


def create_effect_table(app: Duebox) -> None:
    """The demo's own table.  On MySQL/MariaDB one an earlier version made
    with FLOAT columns (above) is dropped first: it holds demo rows only."""
    found = inspect(app.engine)
    if app.engine.dialect.name in ("mysql", "mariadb") and found.has_table(effect.name):
        due = next(c["type"] for c in found.get_columns(effect.name) if c["name"] == "due")
        if not isinstance(due, Double):
            effect.drop(app.engine)
    demo_metadata.create_all(app.engine)


@dataclass
class DemoResult:
    scheduled: int
    ran: int
    early: int
    duplicates: int
    cancelled_ran: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    seconds: float


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


# The first job is due this long after it is scheduled: the relay and the
# worker start after the jobs are written (connections, the broker's
# topology: 0.6 s on MariaDB with RabbitMQ), and a job due before they run
# measures their start-up, not duebox's punctuality.  Scheduled first, every
# job is in the relay's first look (NEAR_WINDOW_SECONDS): scheduled after the start,
# those due within a poll interval would wait for its next look on a
# database without LISTEN/NOTIFY (SQLite, MySQL, MariaDB).
START_LEAD = 2.0


def run_demo(app: Duebox, jobs: int, spread: float, cancels: int,
             lead: float = START_LEAD) -> DemoResult:
    migrate.upgrade(app.engine)
    create_effect_table(app)
    run_id = uuid.uuid4().hex
    calls: dict[uuid.UUID, int] = {}

    @app.task("demo.hello", queue="demo")
    def hello(payload: dict[str, int], ctx: JobContext) -> None:
        started = time.time()
        calls[ctx.job_id] = calls.get(ctx.job_id, 0) + 1
        ctx.session.execute(effect.insert().values(
            job_id=str(ctx.job_id), run_id=run_id, due=ctx.due_at.timestamp(), started=started))

    t0 = time.monotonic()
    with Session(app.engine) as session, session.begin():
        new = [app.new_job("demo.hello", {"n": i}, delay=lead + spread * i / max(1, jobs - 1))
               for i in range(jobs)]
        ids = app.schedule_many(session, new)
    assert isinstance(ids, list)
    cancelled = set(ids[1::max(1, jobs // max(1, cancels))][:cancels]) if cancels else set()
    with Session(app.engine) as session, session.begin():
        for job_id in cancelled:
            app.cancel(session, job_id)
    expected = jobs - len(cancelled)

    async def main() -> None:
        deadline = time.monotonic() + lead + spread + 20
        async with Background(app, worker=Worker(app, queues=["demo"])):
            with click.progressbar(length=expected, label="jobs run", file=None) as bar:
                done = 0
                while done < expected and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    now_done = await asyncio.to_thread(_count, app, run_id)
                    bar.update(now_done - done)
                    done = now_done

    asyncio.run(main())
    with app.engine.connect() as conn:
        rows = conn.execute(select(effect.c.job_id, effect.c.due, effect.c.started)
                            .where(effect.c.run_id == run_id)).all()
    lateness = sorted((started - due) * 1000 for _, due, started in rows)
    ran_ids = {uuid.UUID(j) for j, _, _ in rows}
    return DemoResult(
        scheduled=jobs,
        ran=len(rows),
        early=sum(1 for ms in lateness if ms < 0),
        duplicates=sum(n - 1 for n in calls.values() if n > 1),
        cancelled_ran=len(ran_ids & cancelled),
        p50_ms=_percentile(lateness, 0.50),
        p99_ms=_percentile(lateness, 0.99),
        max_ms=lateness[-1] if lateness else float("nan"),
        seconds=time.monotonic() - t0,
    )


def _count(app: Duebox, run_id: str) -> int:
    with app.engine.connect() as conn:
        return int(conn.execute(
            select(func.count()).select_from(effect).where(effect.c.run_id == run_id)
        ).scalar_one())
