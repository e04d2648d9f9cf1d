"""procrastinate on PostgreSQL (BENCH_PG_URL).

Worker: ``app.run_worker()`` with its defaults (concurrency 1,
``fetch_job_polling_interval`` 5 s, LISTEN/NOTIFY on); BENCH_AGGRESSIVE=1
sets the polling interval to 0.1 s.  Delayed jobs:
``configure(schedule_at=...).defer()``, one call per job (a batch shares one
``schedule_at``); jobs due now: ``batch_defer``, 1,000 a call.  The one
task, ``noop`` (async, as the no-op always was), records its start and then
awaits ``asyncio.sleep`` for its ``sleep`` argument (workload C's slow jobs:
a slow call awaited, as an async handler waits).
"""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime

import procrastinate
from peer_cli import Job, aggressive, main
from record import record, tag_for

PG = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=PG))


@app.task(name="noop")
async def noop(due: float, sleep: float = 0.0) -> None:
    record(due, tag_for(sleep))
    if sleep:
        await asyncio.sleep(sleep)


def setup() -> None:
    with app.open():
        app.schema_manager.apply_schema()


def enqueue(jobs: list[Job], delayed: bool) -> str:
    with app.open():
        if delayed:
            for j in jobs:
                noop.configure(schedule_at=datetime.fromtimestamp(j.due, UTC)).defer(**j.kwargs)
        else:
            for i in range(0, len(jobs), 1000):
                noop.batch_defer(*[j.kwargs for j in jobs[i:i + 1000]])  # type: ignore[arg-type]
    return "batch_defer, 1,000 a call (delayed: defer per job)"


def worker() -> None:
    options = {"fetch_job_polling_interval": 0.1} if aggressive() else {}
    with app.open():
        app.run_worker(**options)


if __name__ == "__main__":
    main(enqueue, worker, setup=setup)
