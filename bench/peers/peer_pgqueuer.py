"""pgqueuer on PostgreSQL (BENCH_PG_URL), with its asyncpg driver.

Worker: ``PgQueuer.run()`` with the defaults of ``pgq run`` (batch size 10,
dequeue timeout 30 s); BENCH_AGGRESSIVE=1: dequeue timeout 0.1 s.
Delayed jobs: ``execute_after=timedelta``.  Batch API: ``Queries.enqueue``
with lists, 1,000 jobs a call.  The one entrypoint, ``noop`` (async, as
pgqueuer's are), records its start and then awaits ``asyncio.sleep`` for the
seconds its payload gives after the due time, if any (workload C's slow
jobs: a slow call awaited, as an async handler waits).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from datetime import timedelta

import asyncpg
from peer_cli import Job, aggressive, main
from pgqueuer import AsyncpgDriver, PgQueuer
from pgqueuer.models import Job as PgJob
from pgqueuer.queries import Queries
from record import record, tag_for

PG = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


async def create() -> PgQueuer:
    pgq = PgQueuer(AsyncpgDriver(await asyncpg.connect(PG)))

    @pgq.entrypoint("noop")
    async def noop(job: PgJob) -> None:
        due, *rest = (job.payload or b"0").split()  # b"due" or b"due sleep"
        sleep = float(rest[0]) if rest else 0.0
        record(float(due), tag_for(sleep))
        if sleep:
            await asyncio.sleep(sleep)

    return pgq


async def _setup() -> None:
    conn = await asyncpg.connect(PG)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()


async def _enqueue(jobs: list[Job], delayed: bool) -> None:
    conn = await asyncpg.connect(PG)
    try:
        q = Queries(AsyncpgDriver(conn))
        for i in range(0, len(jobs), 1000):
            chunk = jobs[i:i + 1000]
            now = time.time()
            after = [timedelta(seconds=max(0.0, j.due - now)) if delayed else None
                     for j in chunk]
            await q.enqueue(["noop"] * len(chunk),
                            [" ".join(map(repr, j.args)).encode() for j in chunk],
                            [0] * len(chunk), after)
    finally:
        await conn.close()


def enqueue(jobs: list[Job], delayed: bool) -> str:
    asyncio.run(_enqueue(jobs, delayed))
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
