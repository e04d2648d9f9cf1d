"""``sql://`` — the job table itself is the queue (the embedded default).

The relay publishes nothing: workers claim due rows straight from the job
table (``FOR UPDATE SKIP LOCKED`` on PostgreSQL and MySQL; on SQLite a
``BEGIN IMMEDIATE`` transaction, which serialises claims correctly).  A worker
sleeps until the earliest due time it knows of, and on PostgreSQL is woken
early by the producer's ``NOTIFY``.  Cancel and reschedule are exact: a
cancelled row can never be claimed.

To start jobs on time rather than a claim's round trip after it, a worker
wakes ``?lookahead=`` seconds (default 0.25) before the next due time,
claims what is due by then (``RUNNING``, leased: a crash loses nothing) and
hands each job over at its due time from an in-memory timer.  A cancel that
lands inside that window finds the job running: its handler is told
(``ctx.cancelled``) and its completion, fenced, rolls back.  ``lookahead=0``
claims only due jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timedelta

from duebox import jobstore
from duebox.db import PgWaker, db_errors, parse_database_url
from duebox.errors import BrokerError, DatabaseError

from ._common import number
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
        self.lookahead = number(self.params, "lookahead", 0.25, low=0.0, high=60.0)

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        raise BrokerError("sql:// has no publish step: workers claim rows from the job table")

    async def consume(self, queues: Sequence[str], prefetch: int) -> AsyncIterator[Delivery]:
        # Claimed jobs wait in ``held`` (due, seq, record) until their due
        # time; they count against ``prefetch`` from the claim on.  Claims run
        # in their own task: a slow claim must not hold back a job already
        # claimed and now due.
        held: list[tuple[datetime, int, jobstore.JobRecord, datetime]] = []
        fresh = asyncio.Event()
        claimer = asyncio.create_task(self._claimer(queues, prefetch, held, fresh),
                                      name="duebox-sql-claimer")
        poll = self.context.settings.poll_interval
        try:
            while True:
                now = self.context.clock.now()
                while held and held[0][0] <= now:
                    _, _, rec, claimed_at = heapq.heappop(held)
                    self._in_flight += 1
                    yield Delivery(message=rec.to_message(), claimed=rec, claimed_at=claimed_at)
                    now = self.context.clock.now()
                if claimer.done():
                    claimer.result()  # its error ends consumption (the worker retries)
                    return
                fresh.clear()
                wait = (held[0][0] - now).total_seconds() if held else poll
                await wait_any(wait, fresh)
        finally:
            claimer.cancel()
            with contextlib.suppress(asyncio.CancelledError, DatabaseError):
                await claimer
            if held:  # stopping: hand them back now, not after their lease
                with contextlib.suppress(DatabaseError):
                    self._unclaim([h[2] for h in held])

    async def _claimer(self, queues: Sequence[str], prefetch: int,
                       held: list[tuple[datetime, int, jobstore.JobRecord, datetime]],
                       fresh: asyncio.Event) -> None:
        ctx = self.context
        waker = PgWaker(parse_database_url(ctx.settings.database_url))
        await waker.start()
        try:
            while True:
                # Up to ``prefetch`` more claimed than running, topped up in
                # batches of at least half of it: a claim per freed slot
                # would cost a transaction per job.
                room = 2 * prefetch - self._in_flight - len(held)
                if room <= 0 or (held and room < max(1, prefetch // 2)):
                    await wait_any(ctx.settings.poll_interval, self._freed)
                    self._freed.clear()
                    continue
                owner = f"{ctx.worker_name}#{next(self._seq)}"
                claimed_at = ctx.clock.now()  # no later than the claim itself
                records, wake_in = await asyncio.to_thread(self._claim, owner, room, queues)
                for rec in records:
                    heapq.heappush(held, (rec.due_at, next(self._seq), rec, claimed_at))
                if records:
                    fresh.set()
                if len(records) == room:
                    continue
                # Fewer jobs were due than slots were free, so a slot freed now
                # changes nothing: sleep until the next claim (the lookahead
                # before the next due time) or a NOTIFY.
                await wait_any(min(wake_in, ctx.settings.poll_interval), waker.event)
                waker.event.clear()
        finally:
            fresh.set()  # the consumer looks at what ended this
            await waker.stop()

    def _unclaim(self, records: list[jobstore.JobRecord]) -> None:
        ctx = self.context
        with db_errors("give back"), ctx.engine.begin() as conn:
            jobstore.unclaim_run(conn, records=records, now=ctx.clock.now())

    def _claim(
        self, owner: str, limit: int, queues: Sequence[str]
    ) -> tuple[list[jobstore.JobRecord], float]:
        """Claim up to ``limit`` due jobs; with fewer, also the seconds until
        the next due time, read in the same transaction (one round trip to
        the pool instead of two per wake-up)."""
        ctx = self.context
        ahead = timedelta(seconds=self.lookahead)
        with db_errors("claim"), ctx.engine.begin() as conn:
            now = ctx.clock.now()
            records = jobstore.claim_for_run(
                conn, owner=owner, now=now, limit=limit, horizon=now + ahead,
                lease_until=now + ahead + timedelta(seconds=ctx.settings.lease_seconds),
                queues=queues or None, worker=ctx.worker_name,
            )
            if len(records) == limit:
                return records, 0.0
            due = jobstore.next_due(conn)
        if due is None:
            return records, float("inf")
        return records, max(0.0, (due - ahead - ctx.clock.now()).total_seconds())

    async def ack(self, delivery: Delivery) -> None:
        self._in_flight = max(0, self._in_flight - 1)
        self._freed.set()
