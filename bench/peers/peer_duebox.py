"""duebox on any of its backends: DUEBOX_DATABASE_URL (PostgreSQL) and
DUEBOX_BROKER_URL (sql://, redis://, amqp://, kafka://, sqs://) from the
harness; every other setting is duebox's default (concurrency 8, poll
interval 1 s) unless the harness sets its DUEBOX_* variable
(BENCH_AGGRESSIVE=1: DUEBOX_POLL_INTERVAL=0.05, and for kafka://
``fetch_max_wait_ms=5`` in the URL).

Processes: ``duebox relay`` and ``duebox worker`` (the relay publishes due
jobs to the broker; on sql:// workers claim rows themselves and the relay
only recovers leases).  Enqueue: ``app.schedule_many`` inside one
transaction, 1,000 jobs a call.  The one task, ``noop``, records its start
and then sleeps for as long as its payload's ``sleep`` says (a sync
handler: in the worker's thread pool, as a user's blocking call would be).
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from typing import Any

from peer_cli import Job, main
from record import record, tag_for

import duebox
from duebox import migrate

app = duebox.Duebox.from_env()


@app.task("noop")  # type: ignore[untyped-decorator]  # mypy sees duebox untyped here
def noop(payload: Any, ctx: duebox.JobContext) -> None:
    record(payload["due"], ctx.tenant or tag_for(payload.get("sleep")))
    if "sleep" in payload:
        time.sleep(payload["sleep"])


def setup() -> None:
    migrate.upgrade(app.engine)


def enqueue(jobs: list[Job], delayed: bool) -> str:
    with app.engine.begin() as conn:  # the caller's transaction: all or nothing
        for i in range(0, len(jobs), 1000):
            app.schedule_many(conn, [
                app.new_job("noop", j.kwargs,
                            at=datetime.fromtimestamp(j.due, UTC) if delayed else None)
                for j in jobs[i:i + 1000]])
    return "app.schedule_many in one transaction, 1,000 a call"


def worker() -> None:
    from duebox.cli.main import main as duebox_main

    sys.argv = ["duebox", "--log-level", "WARNING", sys.argv[-1], "--app", "peer_duebox:app"]
    duebox_main()


if __name__ == "__main__":
    if sys.argv[1:2] in (["relay"], ["worker"]):  # python peer_duebox.py relay|worker
        sys.modules.setdefault("peer_duebox", sys.modules[__name__])
        worker()
    else:
        main(enqueue, worker, setup=setup)
