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

A worker's batch lane (consumers/runner.py) may claim the due jobs itself, in
the transaction that runs them, with no claim written (:meth:`lane_claims`,
core/leases/batch_sql.py ``lock_due``): while it leads, this claimer takes only
jobs due later (the hand-over above) and wakes the lane when due rows wait.
Not with a dispatch policy, whose fair claim decides the order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from duebox.db import PgWaker, db_errors, parse_database_url
from duebox.errors import ConfigurationError, DatabaseError
from duebox.fairness.claim import DispatchPolicy, FairPicker
from duebox.leases import claims, jobstore
from duebox.leases.holding import Hold
from duebox.timing import HANDOVER_GATHER, SQL_HANDOVER_LEAD
from duebox.wait_any import wait_any

from ._common import number
from .base import (
    Broker,
    BrokerContext,
    Capabilities,
    Delivery,
    Durability,
    LaneClaims,
    Ordering,
    parse_params,
)

# Claimed jobs a worker may hold (due or not): a lookahead's worth at the rate
# a worker runs them, few enough that one worker does not hoard what an idle
# one could start.
_HOLD_LIMIT = 1_024
# A held claimed job goes to the worker this long before its due time, with
# those due within HANDOVER_GATHER after it (one batch of the worker's lane).
_HAND_OVER = SQL_HANDOVER_LEAD + HANDOVER_GATHER
# Rows per claim at most: turning a claim's rows into records holds the GIL,
# and a claim of hundreds kept due jobs waiting for the event loop for tens
# of milliseconds; several smaller claims interleave with the hand-offs.
_CLAIM_MOST = 64


@dataclass(frozen=True)
class SQLSettings:
    """What an ``sql://`` URL says: ``lookahead``, seconds before a due time
    a worker claims the job (0: only due jobs)."""

    lookahead: float = 0.25

    @classmethod
    def from_url(cls, url: str) -> SQLSettings:
        return cls(lookahead=number(parse_params(url), "lookahead", 0.25, low=0.0, high=60.0))


@dataclass(frozen=True)
class _Claimed:
    record: jobstore.JobRecord
    at: datetime  # when it was leased: no later than the claim itself


class _LaneSide(LaneClaims):
    """The lane's claims on this backend: see the module notes."""

    def __init__(self, broker: SQLBroker) -> None:
        super().__init__()
        self.broker = broker

    def changed(self) -> None:
        self.broker.relook.set()
        if self.broker.registry_changed is not None:  # the worker's row says who claims
            self.broker.registry_changed()

    def adopt(self, records: Sequence[jobstore.JobRecord], claimed_at: datetime) -> None:
        self.broker.adopt(records, claimed_at)


class SQLBroker(Broker):
    capabilities = Capabilities(
        name="sql",
        max_delay=None,
        delay_precision=0.001,
        cancel=True,
        ordering=Ordering.DUE,
        ordering_note="due time, then id, within each claim; concurrent workers interleave",
        durability=Durability.DATABASE,
        durability_note="the database's: committed jobs survive any process crash",
        payload_limit=None,
        redelivers_unacked=True,
        prompt_redelivery=True,
        in_flight_after_cancel="nothing is in flight: a cancelled row is never claimed",
        direct_claim=True,
    )

    def __init__(self, url: str, context: BrokerContext) -> None:
        super().__init__(url, context)
        self._in_flight = 0
        self._freed = asyncio.Event()
        self._seq = itertools.count()
        self.settings = SQLSettings.from_url(url)
        self.lookahead = self.settings.lookahead
        # Workers claim rows themselves here, so the dispatch policy (the
        # relay's on other backends) shapes their claim: priority, fair
        # shares, aging, quotas and rate limits, shared through the database.
        policy = DispatchPolicy.configured(context.settings)
        self.fair = FairPicker(policy) if policy.enabled else None
        # Claimed jobs waiting for their due time, and the event that tells
        # the consumer there are new ones: set while consume() runs.
        self._held: Hold[_Claimed] | None = None
        self._fresh: asyncio.Event | None = None
        # Set when the claimer should look at the table again now (the lane
        # stopped leading, say) instead of at its next wake-up.
        self.relook = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._giving_back: set[asyncio.Task[None]] = set()
        self._lane = _LaneSide(self) if self.fair is None else None
        shards = os.environ.get("DUEBOX_SHARDS", "").strip()
        if shards not in ("", "0"):
            raise ConfigurationError(
                f"DUEBOX_SHARDS={shards!r}: sharding fences a relay's claim for a broker; "
                "on sql:// workers claim rows from the job table themselves and are not "
                "sharded (SKIP LOCKED partitions the rows between them): unset DUEBOX_SHARDS")

    async def consume(self, queues: Sequence[str], prefetch: int,
                      wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        # Claimed jobs wait in ``held`` until their due time; they count
        # against ``wanted`` from the claim on.  Claims run in their own
        # task: a slow claim must not hold back a job already claimed and now
        # due.
        held: Hold[_Claimed] = Hold()
        fresh = asyncio.Event()
        self._held, self._fresh = held, fresh
        self._loop = asyncio.get_running_loop()
        claimer = asyncio.create_task(self._claimer(queues, prefetch, wanted, held, fresh),
                                      name="duebox-sql-claimer")
        poll = self.context.settings.poll_interval
        try:
            while True:
                if wanted is not None and held and wanted() == 0:
                    # Every thread of the worker runs a long handler: what it
                    # claimed ahead goes back now, for other workers to claim
                    # ahead in time (a NOTIFY wakes them), not at its due time.
                    with contextlib.suppress(DatabaseError):
                        await asyncio.to_thread(self._unclaim,
                                                [c.record for c in held.drain()])
                # Handed over a moment before the due time: the worker reads
                # the job again (a cancel must win) and holds the handler to
                # the due time itself, so the round trip is done by then.
                # With the jobs due just after it (core/timing.py, HANDOVER_GATHER).
                while (c := held.take(self.context.clock.now() + _HAND_OVER)) is not None:
                    self._in_flight += 1
                    yield Delivery(message=c.record.to_message(), claimed=c.record,
                                   claimed_at=c.at)
                if claimer.done():
                    claimer.result()  # its error ends consumption (the worker retries)
                    return
                fresh.clear()
                earliest = held.earliest()
                now = self.context.clock.now() + SQL_HANDOVER_LEAD
                wait = (earliest - now).total_seconds() if earliest is not None else poll
                await wait_any(wait, fresh)
        finally:
            self._held = self._fresh = None
            claimer.cancel()
            with contextlib.suppress(asyncio.CancelledError, DatabaseError):
                await claimer
            if held:  # stopping: hand them back now, not after their lease
                with contextlib.suppress(DatabaseError):
                    self._unclaim([c.record for c in held.drain()])

    async def _claimer(self, queues: Sequence[str], prefetch: int,
                       wanted: Callable[[], int] | None, held: Hold[_Claimed],
                       fresh: asyncio.Event) -> None:
        ctx = self.context
        waker = PgWaker(parse_database_url(ctx.settings.database_url))
        await waker.start()
        try:
            while True:
                # Up to what the worker wants in hand (default: ``prefetch``
                # more due-and-claimed than running), topped up in batches of
                # at least a quarter of it: a claim per freed slot would cost
                # a transaction per job.  Jobs claimed ahead of their due time
                # wait on the timer, not for a slot, so they count only
                # against the hold limit: at 2,000 jobs/s a 0.25 s lookahead
                # holds 500 of them.
                cap = wanted() if wanted is not None else 2 * prefetch
                ready = held.count_due(ctx.clock.now())
                room = min(cap - self._in_flight - ready, _HOLD_LIMIT - len(held))
                if room <= 0 or (held and room < max(1, cap // 4)):
                    await wait_any(ctx.settings.poll_interval, self._freed, self.relook)
                    self._freed.clear()
                    self.relook.clear()
                    continue
                owner = f"{ctx.worker_name}#{next(self._seq)}"
                claimed_at = ctx.clock.now()  # no later than the claim itself
                limit = min(room, _CLAIM_MOST)
                records, wake_in = await asyncio.to_thread(self._claim, owner, limit, queues)
                for rec in records:
                    held.push(rec.due_at, _Claimed(rec, claimed_at))
                if records:
                    fresh.set()
                if len(records) == limit:
                    continue
                # Fewer jobs were due than slots were free, so a slot freed now
                # changes nothing: sleep until the next claim (the lookahead
                # before the next due time) or a NOTIFY.
                await wait_any(min(wake_in, ctx.settings.poll_interval), waker.event,
                               self.relook)
                waker.event.clear()
                self.relook.clear()
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
        lane = self._lane is not None and self._lane.leading
        with db_errors("claim"), ctx.engine.begin() as conn:
            now = ctx.clock.now()
            ids = None
            if self.fair is not None:
                ids = self.fair.pick(conn, horizon=now + ahead, after=None, now=now,
                                     limit=limit, queues=queues or None)
            records = claims.claim_for_run(
                conn, owner=owner, now=now, limit=limit, horizon=now + ahead,
                lease_until=now + ahead + timedelta(seconds=ctx.settings.lease_seconds),
                queues=queues or None, worker=ctx.worker_name, ids=ids,
                after=now if lane else None,
            )
            if len(records) == limit:
                return records, 0.0
            if self.fair is not None and self.fair.last.throttled:
                # Due jobs wait for tokens: sleep until a bucket refills, not
                # a busy loop on the next due time (already past).
                return records, self.fair.last.wait
            due = claims.next_due(conn)
            if lane and due is not None and due <= now:
                # Due rows are the lane's; this claimer waits for the next
                # one it takes (due later).
                self._wake_lane()
                due = claims.next_due(conn, after=now)
        if due is None:
            return records, float("inf")
        # Woken when the next due time is half a lookahead away, not a whole
        # one: the claim then takes every job due in the next half window at
        # once (at 500 jobs/s about 60), where waking at the edge of the
        # window claimed them one transaction each.  Each is still claimed at
        # least half a lookahead before its due time.
        wait = max(0.0, (due - ahead / 2 - ctx.clock.now()).total_seconds())
        if wait == 0.0:
            # Due, yet not claimed: rows another claim held locked, a queue
            # this worker does not consume, or (fair claim) a class newer
            # than the last walk (rediscovered every class_refresh).  Look
            # again in 50 ms rather than spin; a NOTIFY still wakes it.
            wait = 0.05
        return records, wait

    async def close(self) -> None:
        """Jobs the lane leased after consumption ended are given back
        before the worker goes (else their leases, or the worker's death,
        would have to return them)."""
        if self._giving_back:
            await asyncio.wait(set(self._giving_back), timeout=10.0)

    def wanted_changed(self) -> None:
        """The worker wants fewer or more in hand: look at the held claims
        and the claimer's room again now."""
        if self._fresh is not None:
            self._fresh.set()
        self._freed.set()

    def lane_claims(self) -> LaneClaims | None:
        return self._lane

    def _wake_lane(self) -> None:
        """From the claimer's thread: due rows wait for the lane."""
        lane, loop = self._lane, self._loop
        if lane is not None and loop is not None:
            loop.call_soon_threadsafe(lane.wake.set)

    def adopt(self, records: Sequence[jobstore.JobRecord], claimed_at: datetime) -> None:
        """Jobs the lane leased and will not run: held and delivered like
        this claimer's (stopped: given back at once)."""
        held, fresh = self._held, self._fresh
        if held is None or fresh is None:
            self._unclaim_later(list(records))
            return
        for rec in records:
            held.push(rec.due_at, _Claimed(rec, claimed_at))
        fresh.set()

    def _unclaim_later(self, records: list[jobstore.JobRecord]) -> None:
        async def give_back() -> None:
            with contextlib.suppress(DatabaseError):
                await asyncio.to_thread(self._unclaim, records)
        task = asyncio.get_running_loop().create_task(give_back())
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def hand_back(self, delivery: Delivery) -> bool:
        """Another worker should have it: the claimed job goes back to
        ``SCHEDULED`` (as if never claimed, fenced by its lease, with a
        NOTIFY), for any worker's claim."""
        if delivery.claimed is None:
            return False
        await asyncio.to_thread(self._unclaim, [delivery.claimed])
        await self.ack(delivery)
        return True

    async def ack(self, delivery: Delivery) -> None:
        self._in_flight = max(0, self._in_flight - 1)
        self._freed.set()
