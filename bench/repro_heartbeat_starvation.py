"""Repro: a Worker whose concurrency exceeds asyncio's default thread pool
loses leases of healthy jobs.

Sync handlers, heartbeats, claims and settles all go through
``asyncio.to_thread``, i.e. the loop's default executor, which has
``min(32, os.cpu_count() + 4)`` threads (6 on a 2-CPU machine).  With
``concurrency=8`` and 8 handlers that outlive the lease, two jobs are claimed
(RUNNING, leased) but wait for a thread, and so do the heartbeats that should
renew their leases: the leases expire, the relay's recovery hands the jobs out
again, and the first completions find their lease gone.

    python bench/repro_heartbeat_starvation.py            # default executor
    python bench/repro_heartbeat_starvation.py --big-pool # 16 threads: no loss

Timing-dependent: on a 2-CPU machine the default run lost a lease in 3 of 5
runs, the --big-pool run in none of 3.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import tempfile
import time
from typing import Any

import duebox
from duebox import migrate
from duebox.consumers import Worker
from duebox.relay import Relay


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    big_pool = "--big-pool" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        app = duebox.Duebox(
            database_url=f"sqlite:///{tmp}/repro.db",
            settings=duebox.Settings(lease_seconds=2.0, clock_skew_margin=0.2),
        )
        migrate.upgrade(app.engine)

        @app.task("slow")
        def slow(payload: Any, ctx: Any) -> None:
            time.sleep(5.0)  # longer than the lease: the heartbeat must renew it

        with app.engine.begin() as conn:
            app.schedule_many(conn, [app.new_job("slow", {"i": i}) for i in range(8)])

        async def run() -> None:
            if big_pool:
                asyncio.get_running_loop().set_default_executor(
                    concurrent.futures.ThreadPoolExecutor(16))
            stop = asyncio.Event()
            worker, relay = Worker(app, concurrency=8), Relay(app)
            tasks = [asyncio.create_task(worker.run(stop)), asyncio.create_task(relay.run(stop))]
            await asyncio.sleep(12)
            stop.set()
            await asyncio.gather(*tasks)
            print(f"cpus={os.cpu_count()} big_pool={big_pool} received={worker.stats.received} "
                  f"succeeded={worker.stats.succeeded} lease_lost={worker.stats.lease_lost} "
                  f"recovered_by_relay={relay.totals.recovered}")

        asyncio.run(run())
        app.dispose()


if __name__ == "__main__":
    main()
