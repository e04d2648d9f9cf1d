"""Jobs the relay holds in memory until their release time.

A claimed job the broker cannot delay precisely enough (Kafka: not at all,
RabbitMQ's TTL tiers are coarse) or long enough is kept here, still leased
in the database, and published at its release time: ``publish_lead``
before due for near-due jobs (``Capabilities.publish_lead``, on the relay's
precise timer), ``max_delay`` before due for the others.  The lease covers
the wait, so a crashed relay's held jobs are recovered; on shutdown they go
back to ``SCHEDULED`` at once.  Jobs published ahead carry the broker's
delay for the rest (:meth:`HeldJobs.delay`).

Which backends hold near-due jobs, and how long before due they publish
them, is the broker's ``Capabilities.publish_lead`` (Kafka has no delay,
RabbitMQ's TTL tiers are coarse).  Redis's own timer (the consumer's mover,
woken at the earliest score) is as precise and keeps the relay off the
critical path; memory:// is exact; sqs:// delays are whole seconds
(core/timing.py ``NEAR_WINDOW_SECONDS``: how near).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from duebox.leases.holding import Hold
from duebox.leases.records import JobRecord
from duebox.timing import HANDOVER_GATHER

# At most this many held jobs (per relay): beyond it, the broker's delay.
_HOLD_LIMIT = 20_000


@dataclass(frozen=True)
class _Held:
    record: JobRecord
    owner: str


class HeldJobs:
    """Held jobs by release time (the near-due :class:`~duebox.leases.holding.Hold`
    sql:// workers use too); ``changed`` is set when a job
    is held earlier than every other (the timer sleeps until the earliest)."""

    def __init__(self, *, lead: float, max_delay: float | None, precision: float) -> None:
        self.lead = lead
        # A release also takes what is due just after it (core/timing.py);
        # only where jobs are handed over ahead at all.
        self.gather = HANDOVER_GATHER if lead > 0 else timedelta(0)
        self.max_delay = max_delay
        self.precision = precision
        self._heap: Hold[_Held] = Hold()
        self.changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._heap)

    def ids(self) -> list[uuid.UUID]:
        return [h.record.id for h in self._heap]

    def next_release(self) -> datetime | None:
        return self._heap.earliest()

    def release_time(self, rec: JobRecord, now: datetime, near: float) -> datetime:
        """When to publish ``rec``: near-due jobs (due within ``near``
        seconds) just before their due time, while held jobs fit in memory;
        others as soon as the broker can delay them long enough."""
        if (rec.due_at - now).total_seconds() <= near and len(self._heap) < _HOLD_LIMIT:
            return rec.due_at - timedelta(seconds=self.lead)
        if self.max_delay is None:
            return rec.due_at - timedelta(days=36500)
        return rec.due_at - timedelta(seconds=self.max_delay)

    def delay(self, rec: JobRecord, now: datetime) -> float:
        """The broker's delay for ``rec`` published at ``now``."""
        # Released by the timer (compared in whole microseconds: 0.030 +
        # 0.005 as floats is less than 0.035): the worker holds the rest.
        if rec.due_at - now <= timedelta(seconds=self.lead) + self.gather:
            return 0.0
        remaining = (rec.due_at - now).total_seconds()
        if self.max_delay is not None:
            remaining = min(remaining, self.max_delay)
        # Round up to the broker's precision: late by a tick, never early.
        ticks = math.ceil(remaining / self.precision - 1e-9)
        return ticks * self.precision

    def hold(self, rec: JobRecord, owner: str, release_at: datetime) -> None:
        if self._heap.push(release_at, _Held(rec, owner)):
            self.changed.set()

    def take_due(self, now: datetime) -> list[tuple[str, list[JobRecord]]]:
        """Remove the jobs whose release time has come, and those due within
        ``gather`` after them: in runs of one claim (owner), in release order
        (grouping a claim's jobs together would send a later claim's earlier
        jobs after them)."""
        runs: list[tuple[str, list[JobRecord]]] = []
        for item in self._heap.take_all(now + self.gather):
            if runs and runs[-1][0] == item.owner:
                runs[-1][1].append(item.record)
            else:
                runs.append((item.owner, [item.record]))
        return runs

    def take_all(self) -> dict[str, list[uuid.UUID]]:
        """Remove every held job (shutdown): their ids by claim owner."""
        by_owner: dict[str, list[uuid.UUID]] = {}
        for item in self._heap.drain():
            by_owner.setdefault(item.owner, []).append(item.record.id)
        return by_owner


__all__ = ["HeldJobs"]
