"""A relay or a worker process for tests/test_hostile_processes.py.

    python tests/procs/hostile_app.py ROLE DATABASE_URL BROKER_URL NAME [WORK_SECONDS]

ROLE is ``relay`` or ``worker``.  The one task, ``proc_effect`` (queue
``default``), writes an effects row through ``ctx.session`` (primary key: the
job id, so a second run of a job fails its transaction and shows), after
WORK_SECONDS of work (default 0).  Settings are duebox's defaults but for a
short poll interval: the tests judge what a production-like process does.
SIGTERM stops it cleanly (exit status 0); it logs at WARNING to stderr, one
line per record, so a test can count what an outage writes.
"""

from __future__ import annotations

import asyncio
import logging
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


def build_app(database_url: str, broker_url: str, work: float = 0.0) -> duebox.Duebox:
    app = duebox.Duebox(database_url, broker_url,
                        settings=duebox.Settings(poll_interval=0.1))

    @app.task("proc_effect")
    def proc_effect(payload: Any, ctx: duebox.JobContext) -> None:
        if work:
            time.sleep(work)
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    return app


async def main(role: str, database_url: str, broker_url: str, name: str,
               work: str = "0") -> None:
    app = build_app(database_url, broker_url, float(work))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    part: Relay | Worker = (Relay(app, name=name) if role == "relay"
                            else Worker(app, name=name, concurrency=4))
    print(f"{name} ready", flush=True)
    try:
        await part.run(stop)
    finally:
        await app.adispose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {sys.argv[4]} %(name)s %(levelname)s %(message)s")
    asyncio.run(main(*sys.argv[1:6]))
