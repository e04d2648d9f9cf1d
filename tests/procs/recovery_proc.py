"""One relay or worker process for the crash-recovery scenario
(tests/recovery_scenario.py), with production settings: the default 30 s
lease, 1 s polls, group commit on.

    python tests/procs/recovery_proc.py ROLE DATABASE_URL BROKER_URL NAME EXTERNAL_LOG

The one task, ``rec_effect``, has two effects: a row in the tests' ``effects``
table through ``ctx.session`` (the job's own transaction: must happen once)
and a line appended to EXTERNAL_LOG before the transaction commits (an
effect outside the database: may repeat after a crash, which the scenario
counts).  SIGTERM stops the process cleanly; the scenario SIGKILLs and
SIGSTOPs it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import effect_values, effects

import duebox
from duebox.consumers import Worker
from duebox.relay import Relay

# A handler's own work: long enough that a kill lands inside running groups.
WORK_SECONDS = 0.005


def build_app(database_url: str, broker_url: str, external_log: str = os.devnull
              ) -> duebox.Duebox:
    # DUEBOX_REC_SETTINGS="lease_seconds=2,poll_interval=0.1": settings the
    # scenario changes (none by default: production's).
    pairs = [p.split("=", 1) for p in os.environ.get("DUEBOX_REC_SETTINGS", "").split(",") if p]
    overrides = {k: float(v) for k, v in pairs}
    app = duebox.Duebox(database_url, broker_url, settings=duebox.Settings(**overrides))

    @app.task("rec_effect", max_attempts=5)
    def rec_effect(payload: Any, ctx: duebox.JobContext) -> None:
        with open(external_log, "a") as f:
            f.write(f"{ctx.job_id} {ctx.worker} {ctx.lease_generation}\n")
        # ``sleep``: {worker name: seconds}, a long handler in that worker,
        # for a pause or a partition to land in.
        time.sleep(float((payload or {}).get("sleep", {}).get(ctx.worker, WORK_SECONDS)))
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    return app


async def main(role: str, database_url: str, broker_url: str, name: str,
               external_log: str) -> None:
    app = build_app(database_url, broker_url, external_log)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    part: Any
    if role == "relay":
        part = Relay(app, name=name)
    elif role == "worker":
        part = Worker(app, name=name, concurrency=8)
    else:
        raise SystemExit(f"role: must be relay or worker (got {role!r})")
    try:
        await part.run(stop)
    finally:
        await app.adispose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO if os.environ.get("DUEBOX_REC_VERBOSE") else
                        logging.WARNING,
                        format=f"%(asctime)s {sys.argv[4]} %(levelname)s %(name)s %(message)s")
    asyncio.run(main(*sys.argv[1:6]))
