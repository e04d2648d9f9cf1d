"""pgqueuer on PostgreSQL (BENCH_PG_URL), with its asyncpg driver.

Worker: ``PgQueuer.run()`` with the defaults of ``pgq run`` (batch size 10,
dequeue timeout 30 s); BENCH_AGGRESSIVE=1: dequeue timeout 0.1 s.
Delayed jobs: ``execute_after=timedelta``.  Batch API: ``Queries.enqueue``
with lists, 1,000 jobs a call.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from datetime import timedelta

import asyncpg
from peer_cli import aggressive, main
from pgqueuer import AsyncpgDriver, PgQueuer
from pgqueuer.models import Job
from pgqueuer.queries import Queries
from record import record

PG = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


async def create() -> PgQueuer:
    pgq = PgQueuer(AsyncpgDriver(await asyncpg.connect(PG)))

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        record(float(job.payload or b"0"))

    return pgq


async def _setup() -> None:
    conn = await asyncpg.connect(PG)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()


async def _enqueue(dues: list[float], delayed: bool) -> None:
    conn = await asyncpg.connect(PG)
    try:
        q = Queries(AsyncpgDriver(conn))
        for i in range(0, len(dues), 1000):
            chunk = dues[i:i + 1000]
            now = time.time()
            after = [timedelta(seconds=max(0.0, d - now)) if delayed else None for d in chunk]
            await q.enqueue(["noop"] * len(chunk), [repr(d).encode() for d in chunk],
                            [0] * len(chunk), after)
    finally:
        await conn.close()


def enqueue(dues: list[float], delayed: bool) -> str:
    asyncio.run(_enqueue(dues, delayed))
    return "Queries.enqueue with lists, 1,000 a call"


async def _worker() -> None:
    pgq = await create()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, pgq.shutdown.set)
    await pgq.run(dequeue_timeout=timedelta(seconds=0.1 if aggressive() else 30), batch_size=10)


def worker() -> None:
    # What ``pgq run peer_pgqueuer:create`` does, minus its logging set-up,
    # which crashes in pgqueuer 1.6.0 ('str' object has no attribute 'name').
    asyncio.run(_worker())


if __name__ == "__main__":
    main(enqueue, worker, setup=lambda: asyncio.run(_setup()))
