"""A ``sql://`` worker process for tests/test_sql_fairness.py.

    python tests/procs/sql_fair_worker.py DATABASE_URL NAME

Its settings come from ``Settings.from_env``, so ``DUEBOX_DISPATCH_POLICY``
reaches the worker's claim the way a user's environment would.  Task
``proc_job`` does nothing; the test reads claim times from the job table.
SIGTERM stops it cleanly.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import duebox
from duebox.consumers import Worker


async def main(database_url: str, name: str) -> None:
    settings = duebox.Settings.from_env(database_url=database_url, broker_url="sql://",
                                        poll_interval=0.1, lease_seconds=5.0,
                                        clock_skew_margin=0.3)
    app = duebox.Duebox(settings=settings)
    app.add_task("proc_job", lambda payload, ctx: None)
    worker = Worker(app, name=name, concurrency=4, heartbeat_interval=0.5)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"{name} ready", flush=True)
    try:
        await worker.run(stop)
    finally:
        await app.adispose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {sys.argv[2]} %(message)s")
    asyncio.run(main(*sys.argv[1:3]))
