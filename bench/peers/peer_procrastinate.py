"""procrastinate on PostgreSQL (BENCH_PG_URL).

Worker: ``app.run_worker()`` with its defaults (concurrency 1,
``fetch_job_polling_interval`` 5 s, LISTEN/NOTIFY on); BENCH_AGGRESSIVE=1
sets the polling interval to 0.1 s.  Delayed jobs:
``configure(schedule_at=...).defer()``, one call per job (a batch shares one
``schedule_at``); jobs due now: ``batch_defer``, 1,000 a call.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

import procrastinate
from peer_cli import aggressive, main
from record import record

PG = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=PG))


@app.task(name="noop")
async def noop(due: float) -> None:
    record(due)


def setup() -> None:
    with app.open():
        app.schema_manager.apply_schema()


def enqueue(dues: list[float], delayed: bool) -> str:
    with app.open():
        if delayed:
            for due in dues:
                noop.configure(schedule_at=datetime.fromtimestamp(due, UTC)).defer(due=due)
        else:
            for i in range(0, len(dues), 1000):
                noop.batch_defer(*[{"due": d} for d in dues[i:i + 1000]])  # type: ignore[arg-type]
    return "batch_defer, 1,000 a call (delayed: defer per job)"


def worker() -> None:
    options = {"fetch_job_polling_interval": 0.1} if aggressive() else {}
    with app.open():
        app.run_worker(**options)


if __name__ == "__main__":
    main(enqueue, worker, setup=setup)
