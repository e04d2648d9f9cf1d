"""``sql://`` — the job table itself is the queue (the embedded default).

The relay publishes nothing: workers claim due rows straight from the job
table (``FOR UPDATE SKIP LOCKED`` on PostgreSQL and MySQL; on SQLite a
``BEGIN IMMEDIATE`` transaction, which serialises claims correctly).  A worker
sleeps until the earliest due time it knows of, and on PostgreSQL is woken
early by the producer's ``NOTIFY``.  Cancel and reschedule are exact: a
cancelled row can never be claimed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta

from duebox import jobstore
from duebox.db import PgWaker, db_errors, parse_database_url
from duebox.errors import BrokerError

from ._waiting import wait_any
from .base import Broker, BrokerContext, Capabilities, Delivery, Outgoing, PublishResult


class SQLBroker(Broker):
    capabilities = Capabilities(
        name="sql",
        max_delay=None,
        delay_precision=0.001,
        cancel=True,
        ordering="due time, then id, within each claim; concurrent workers interleave",
        durability="the database's: committed jobs survive any process crash",
        payload_limit=None,
        redelivers_unacked=True,
        in_flight_after_cancel="nothing is in flight: a cancelled row is never claimed",
        direct_claim=True,
    )

    def __init__(self, url: str, context: BrokerContext) -> None:
        super().__init__(url, context)
        self._in_flight = 0
        self._freed = asyncio.Event()
        self._seq = itertools.count()

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        raise BrokerError("sql:// has no publish step: workers claim rows from the job table")

    async def consume(self, queues: Sequence[str], prefetch: int) -> AsyncIterator[Delivery]:
        ctx = self.context
        waker = PgWaker(parse_database_url(ctx.settings.database_url))
        await waker.start()
        token = f"{ctx.worker_name}"
        try:
            while True:
                room = prefetch - self._in_flight
                if room <= 0:
                    await wait_any(ctx.settings.poll_interval, self._freed)
                    self._freed.clear()
                    continue
                owner = f"{token}#{next(self._seq)}"
                records, wake_in = await asyncio.to_thread(self._claim, owner, room, queues)
                for rec in records:
                    self._in_flight += 1
                    yield Delivery(message=rec.to_message(), claimed=rec)
                if len(records) == room:
                    continue
                # Fewer jobs were due than slots were free, so a slot freed now
                # changes nothing: sleep until the next due time or a NOTIFY.
                await wait_any(min(wake_in, ctx.settings.poll_interval), waker.event)
                waker.event.clear()
        finally:
            await waker.stop()

    def _claim(
        self, owner: str, limit: int, queues: Sequence[str]
    ) -> tuple[list[jobstore.JobRecord], float]:
        """Claim up to ``limit`` due jobs; with fewer, also the seconds until
        the next due time, read in the same transaction (one round trip to
        the pool instead of two per wake-up)."""
        ctx = self.context
        with db_errors("claim"), ctx.engine.begin() as conn:
            now = ctx.clock.now()
            records = jobstore.claim_for_run(
                conn, owner=owner, now=now, limit=limit,
                lease_until=now + timedelta(seconds=ctx.settings.lease_seconds),
                queues=queues or None, worker=ctx.worker_name,
            )
            if len(records) == limit:
                return records, 0.0
            due = jobstore.next_due(conn)
        if due is None:
            return records, float("inf")
        return records, max(0.0, (due - ctx.clock.now()).total_seconds())

    async def ack(self, delivery: Delivery) -> None:
        self._in_flight = max(0, self._in_flight - 1)
        self._freed.set()
