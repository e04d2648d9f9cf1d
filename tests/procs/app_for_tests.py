"""A duebox app and a tiny launcher for tests/test_processes.py.

    python tests/procs/app_for_tests.py ROLE DATABASE_URL BROKER_URL NAME

ROLE is ``relay``, ``worker`` or ``both`` (a relay and a worker in one event
loop, as ``memory://`` needs).  The one task, ``proc_effect``, writes a row to
the tests' ``effects`` table through ``ctx.session`` (primary key: the job
id), so the test can count committed effects exactly.  SIGTERM stops the
process cleanly; the tests SIGKILL it to simulate a crash.

Settings are short on purpose: a 2 s lease and small batches, so a kill lands
in the middle of claimed, published and running work.  ``DUEBOX_TEST_LEASE``
sets another lease (seconds).

A second task, ``held_effect``, writes the same row and then, on its first
attempt, holds its transaction open: a kill of the database lands inside it
(tests/test_pg_failover.py).
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
from sqlalchemy import text

import duebox
from duebox.consumers import Worker
from duebox.relay import Relay

LEASE_SECONDS = float(os.environ.get("DUEBOX_TEST_LEASE", "2.0"))


def build_app(database_url: str, broker_url: str) -> duebox.Duebox:
    settings = duebox.Settings(
        lease_seconds=LEASE_SECONDS, poll_interval=0.1, clock_skew_margin=0.3,
        batch_size=10, concurrency=4, redeliver_after=2.0,
    )
    app = duebox.Duebox(database_url, broker_url, settings=settings)

    @app.task("proc_effect", max_attempts=5)
    def proc_effect(payload: Any, ctx: duebox.JobContext) -> None:
        ctx.session.execute(effects.insert().values(effect_values(ctx)))
        time.sleep(0.004)  # a little work, so a kill can land inside a transaction

    # Alone in its transaction (no group commit, no batch lane): a job the
    # usual path started, under a lease.
    @app.task("held_effect", max_attempts=5, group_commit=False)
    def held_effect(payload: Any, ctx: duebox.JobContext) -> None:
        """The effect, then on the first attempt a file named after the job
        in ``payload["marks"]`` (the effect is written, uncommitted), and the
        transaction held open for at most ``payload["hold"]`` seconds: with
        ``payload["probe"]``, querying through ``ctx.session`` until a query
        fails (the handler itself meets the lost connection, and raises);
        without, asleep until the file ``killed`` appears there (the
        completion after it meets the lost connection)."""
        ctx.session.execute(effects.insert().values(effect_values(ctx)))
        if ctx.attempt != 1:
            return
        marks = Path(payload["marks"])
        (marks / str(ctx.job_id)).touch()
        end = time.monotonic() + payload["hold"]
        while time.monotonic() < end:
            if payload["probe"]:
                ctx.session.execute(text("SELECT 1"))
            elif (marks / "killed").exists():
                return
            time.sleep(0.02)

    return app


async def main(role: str, database_url: str, broker_url: str, name: str) -> None:
    app = build_app(database_url, broker_url)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    parts: list[Any] = []
    if role in ("relay", "both"):
        parts.append(Relay(app, name=f"{name}-relay", batch_size=10, recover_interval=0.25))
    if role in ("worker", "both"):
        parts.append(Worker(app, name=f"{name}-worker", concurrency=4))
    print(f"{name} ready", flush=True)
    try:
        await asyncio.gather(*(p.run(stop) for p in parts))
    finally:
        await app.adispose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {sys.argv[4]} %(message)s")
    asyncio.run(main(*sys.argv[1:5]))
