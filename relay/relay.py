"""The relay loop.

Each pass:

1. **Claim** a bounded batch in a short transaction: ``SCHEDULED`` jobs due by
   ``now + max_delay (+ hold window)`` become ``DISPATCHING``, leased to a
   per-claim owner token.  The same predicate parks jobs beyond the broker's
   ceiling and picks them up as they come near.
2. **Publish** outside any transaction with delay = ``due_at - now`` clipped to
   ``[0, max_delay]`` and rounded *up* to the broker's precision.  Jobs the
   broker cannot delay long enough (Kafka: not at all) are held in a heap,
   still leased in the database, and published at ``due_at - max_delay``.
3. **Mark** ``ENQUEUED`` with a fenced update; a mark that matches nothing
   means the lease was lost and the publish was a duplicate consumers drop.
4. **Recover** expired leases (plus a clock-skew margin) back to ``SCHEDULED``.
5. **Sleep** until the earliest due time, a held job's release, the next
   recovery or the poll interval — woken early by ``NOTIFY`` on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from duebox import jobstore
from duebox.brokers.base import Broker, Outgoing
from duebox.db import PgWaker, db_errors, parse_database_url
from duebox.errors import BrokerError, DatabaseError
from duebox.ids import process_token

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.relay")


@dataclass
class PassStats:
    claimed: int = 0
    published: int = 0
    marked: int = 0
    lost_marks: int = 0
    held: int = 0
    expired: int = 0
    failed: int = 0
    recovered: int = 0


@dataclass
class RelayTotals(PassStats):
    passes: int = 0
    errors: int = 0


@dataclass(order=True)
class _Held:
    release_at: datetime
    seq: int
    record: jobstore.JobRecord = field(compare=False)
    owner: str = field(compare=False)


class Relay:
    """Moves due jobs from the database to the broker.  Run as many as you like:
    ``SKIP LOCKED`` partitions the rows between them."""

    def __init__(
        self,
        app: Duebox,
        *,
        broker: Broker | None = None,
        batch_size: int | None = None,
        name: str | None = None,
        hold_window: float | None = None,
        recover_interval: float = 1.0,
    ) -> None:
        self.app = app
        self.name = name or process_token("relay")
        self.broker = broker or app.broker(self.name)
        self.batch_size = batch_size or app.settings.batch_size
        caps = self.broker.capabilities
        max_delay = self.broker.max_delay
        # How far ahead of the broker's ceiling to claim and hold in memory.
        if hold_window is None:
            hold_window = app.settings.poll_interval + 1.0 if max_delay == 0 else 0.0
        self.hold_window = hold_window
        self.max_delay = max_delay
        self.precision = caps.delay_precision
        self.recover_interval = recover_interval
        self.totals = RelayTotals()
        self._held: list[_Held] = []
        self._seq = itertools.count()
        self._claims = itertools.count()
        self._last_recover = -math.inf

    # --- one pass ------------------------------------------------------------

    async def run_pass(self) -> PassStats:
        stats = PassStats()
        if time.monotonic() - self._last_recover >= self.recover_interval:
            self._last_recover = time.monotonic()
            stats.recovered = (await asyncio.to_thread(self._recover)).total
        if not self.broker.capabilities.direct_claim:
            while True:
                owner = f"{self.name}#{next(self._claims)}"
                records = await asyncio.to_thread(self._claim, owner)
                stats.claimed += len(records)
                await self._dispatch(records, owner, stats)
                if len(records) < self.batch_size:
                    break
            await self._release_held(stats)
        self._add(stats)
        return stats

    def _claim(self, owner: str) -> list[jobstore.JobRecord]:
        now = self.app.clock.now()
        horizon = now + timedelta(seconds=(self.max_delay or 0.0) + self.hold_window)
        if self.max_delay is None:
            horizon = datetime.max.replace(tzinfo=now.tzinfo)
        lease = self.app.settings.lease_seconds + self.hold_window
        with db_errors("claim"), self.app.engine.begin() as conn:
            return jobstore.claim_for_dispatch(
                conn, owner=owner, horizon=horizon, limit=self.batch_size, now=now,
                lease_until=now + timedelta(seconds=lease),
            )

    async def _dispatch(self, records: list[jobstore.JobRecord], owner: str,
                        stats: PassStats) -> None:
        now = self.app.clock.now()
        expired = [r.id for r in records if r.expired(now)]
        if expired:
            stats.expired += await asyncio.to_thread(self._db, jobstore.expire, owner, expired)
        ready = []
        for rec in records:
            if rec.expired(now):
                continue
            release_at = self._release_time(rec)
            if release_at > now:
                heapq.heappush(self._held, _Held(release_at, next(self._seq), rec, owner))
                stats.held += 1
            else:
                ready.append(rec)
        await self._publish(ready, owner, stats)

    def _release_time(self, rec: jobstore.JobRecord) -> datetime:
        if self.max_delay is None:
            return rec.due_at - timedelta(days=36500)
        return rec.due_at - timedelta(seconds=self.max_delay)

    async def _release_held(self, stats: PassStats) -> None:
        now = self.app.clock.now()
        by_owner: dict[str, list[jobstore.JobRecord]] = {}
        while self._held and self._held[0].release_at <= now:
            item = heapq.heappop(self._held)
            by_owner.setdefault(item.owner, []).append(item.record)
        for owner, recs in by_owner.items():
            await self._publish(recs, owner, stats)

    def _delay_for(self, rec: jobstore.JobRecord, now: datetime) -> float:
        remaining = (rec.due_at - now).total_seconds()
        if remaining <= 0:
            return 0.0
        if self.max_delay is not None:
            remaining = min(remaining, self.max_delay)
        # Round up to the broker's precision: late by a tick, never early.
        ticks = math.ceil(remaining / self.precision - 1e-9)
        return ticks * self.precision

    async def _publish(self, records: list[jobstore.JobRecord], owner: str,
                       stats: PassStats) -> None:
        if not records:
            return
        now = self.app.clock.now()
        batch = [Outgoing(r.to_message(), self._delay_for(r, now)) for r in records]
        try:
            results = await self.broker.publish(batch)
        except BrokerError as exc:
            log.warning("publish of %d jobs failed: %s", len(batch), exc)
            stats.failed += len(batch)
            await asyncio.to_thread(self._db, jobstore.release, owner, [r.id for r in records])
            raise
        ok = [r.job_id for r in results if r.ok]
        failed = [r.job_id for r in results if not r.ok]
        stats.published += len(ok)
        if failed:
            stats.failed += len(failed)
            log.warning("broker refused %d of %d messages; they go back to SCHEDULED",
                        len(failed), len(results))
            await asyncio.to_thread(self._db, jobstore.release, owner, failed)
        marked = await asyncio.to_thread(self._db, jobstore.mark_enqueued, owner, ok)
        stats.marked += marked
        stats.lost_marks += len(ok) - marked

    def _db(self, fn: object, owner: str, ids: Sequence[object]) -> int:
        with db_errors("mark"), self.app.engine.begin() as conn:
            result: int = fn(conn, owner=owner, ids=ids, now=self.app.clock.now())  # type: ignore[operator]
            return result

    def _recover(self) -> jobstore.Recovered:
        s = self.app.settings
        with db_errors("recover"), self.app.engine.begin() as conn:
            rec = jobstore.recover(
                conn, now=self.app.clock.now(), margin=s.clock_skew_margin,
                redeliver_after=s.redeliver_after, limit=self.batch_size,
            )
        if rec.total:
            log.info("recovered expired leases: %s", rec)
        return rec

    def _add(self, stats: PassStats) -> None:
        t = self.totals
        t.passes += 1
        for name in PassStats.__dataclass_fields__:
            setattr(t, name, getattr(t, name) + getattr(stats, name))

    # --- the loop --------------------------------------------------------------

    def _seconds_until_next(self) -> float:
        now = self.app.clock.now()
        waits = [self.app.settings.poll_interval,
                 self.recover_interval - (time.monotonic() - self._last_recover)]
        if self._held:
            waits.append((self._held[0].release_at - now).total_seconds())
        if not self.broker.capabilities.direct_claim and self.max_delay is not None:
            with db_errors("next due"), self.app.engine.connect() as conn:
                due = jobstore.next_due(conn)
            if due is not None:
                lead = self.max_delay + self.hold_window
                waits.append((due - now).total_seconds() - lead)
        return max(0.0, min(waits))

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Run passes until ``stop`` is set; database and broker outages are
        retried with backoff, never fatal."""
        from duebox.brokers._waiting import wait_any

        stop = stop or asyncio.Event()
        waker = PgWaker(parse_database_url(self.app.settings.database_url))
        await self.broker.open()
        await waker.start()
        backoff = 0.1
        log.info("relay %s started on %s (max_delay=%s)", self.name,
                 self.broker.capabilities.name, self.max_delay)
        try:
            while not stop.is_set():
                try:
                    await self.run_pass()
                    wait = await asyncio.to_thread(self._seconds_until_next)
                    backoff = 0.1
                except (DatabaseError, BrokerError) as exc:
                    self.totals.errors += 1
                    log.warning("relay pass failed (%s); retrying in %.1fs", exc, backoff)
                    wait = backoff
                    backoff = min(backoff * 2, 10.0)
                await wait_any(wait, waker.event, stop)
                waker.event.clear()
        finally:
            await self._give_back_held()
            await waker.stop()
            await self.broker.close()

    async def _give_back_held(self) -> None:
        """On shutdown, held jobs go back to SCHEDULED at once so another relay
        need not wait for their leases to expire."""
        by_owner: dict[str, list[object]] = {}
        for item in self._held:
            by_owner.setdefault(item.owner, []).append(item.record.id)
        self._held.clear()
        for owner, ids in by_owner.items():
            with contextlib.suppress(DatabaseError):
                await asyncio.to_thread(self._db, jobstore.release, owner, ids)
