"""Catch-up after an outage: bounded, rate-limited, most urgent first, expired dropped.

A job is *overdue* when its due time passed more than ``catchup_after``
seconds ago without a relay claiming it — after an outage, never in steady
state (steady-state claims run ahead of due time).  Overdue jobs are released
by a separate claim:

* in bounded batches of at most ``min(batch_size, one second of tokens)``;
* under a token bucket of ``catchup_rate`` jobs per second (per relay
  process; a shared limit across relays is future work), so downstream
  systems do not get a second spike on top of whatever caused the outage;
* ordered by ``priority`` (highest first), then due time, so time-sensitive
  classes drain first;
* after a sweep that marks ``EXPIRED`` (never run) every job past its
  ``expires_at`` or its task's ``max_lateness``.

Jobs within ``catchup_after`` of their due time are claimed by the normal
path, unthrottled.  Nothing is ever published before its due time: overdue
jobs are by definition past it.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from duebox.db import SQLITE_DEFERRED, db_errors
from duebox.leases import jobstore, recovery

if TYPE_CHECKING:
    from duebox.app import Duebox


class TokenBucket:
    """``rate`` tokens per second up to ``burst``, on an injectable clock."""

    def __init__(self, rate: float, burst: float, now: datetime) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self._at = now

    def refill(self, now: datetime) -> None:
        elapsed = (now - self._at).total_seconds()
        if elapsed > 0:
            self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
            self._at = now

    def available(self, now: datetime) -> int:
        self.refill(now)
        return math.floor(self.tokens + 1e-9)

    def spend(self, n: int) -> None:
        self.tokens -= n

    def seconds_until(self, n: float, now: datetime) -> float:
        self.refill(now)
        return max(0.0, (min(n, self.burst) - self.tokens) / self.rate)


class CatchUp:
    """A pipeline's catch-up policy: which jobs count as backlog, how fast it
    may go (per pipeline: each broker's backlog under its own limit), and
    which jobs are too late to run at all."""

    def __init__(self, app: Duebox, batch_size: int) -> None:
        s = app.settings
        self.app = app
        self.batch_size = batch_size
        self.after = s.catchup_after
        self.bucket = TokenBucket(s.catchup_rate, max(1.0, s.catchup_rate), app.clock.now())
        self.chunk = max(1, min(batch_size, math.floor(self.bucket.burst)))
        # True while overdue jobs wait for tokens: the relay then sleeps until
        # the next chunk instead of spinning on an overdue due time.
        self.throttled = False

    def threshold(self, now: datetime) -> datetime:
        """Jobs due at or before this instant are backlog."""
        return now - timedelta(seconds=self.after)

    def allowance(self) -> int:
        """How many overdue jobs may be claimed now (0 until a whole chunk is
        available, so the backlog moves in bounded batches)."""
        available = self.bucket.available(self.app.clock.now())
        return min(self.batch_size, available) if available >= self.chunk else 0

    def spend(self, n: int) -> None:
        self.bucket.spend(n)

    def adjust_wait(self, due: datetime, now: datetime, wait: float) -> float:
        """The relay's sleep for its earliest due job ``due``: while that job
        is backlog waiting for tokens, until the next chunk's tokens."""
        if self.throttled and due <= self.threshold(now):
            return max(wait, self.bucket.seconds_until(self.chunk, now))
        return wait

    def too_late(self, rec: jobstore.JobRecord, now: datetime) -> bool:
        """Past ``expires_at``, or later than its task's ``max_lateness``."""
        if rec.expired(now):
            return True
        task = self.app.tasks.get(rec.task)
        late = task.max_lateness if task is not None else None
        return late is not None and rec.due_at + timedelta(seconds=late) < now


def lateness(app: Duebox) -> dict[str, float]:
    """Tasks with a ``max_lateness``, by name."""
    return {name: float(task.max_lateness) for name, task in app.tasks.items()
            if task.max_lateness is not None}


def expire_too_late(app: Duebox, limit: int) -> int:
    """SCHEDULED jobs past ``expires_at`` or their task's ``max_lateness``
    become EXPIRED, a bounded batch per call: a step of the relay itself,
    whatever its brokers (it also serves ``sql://``, where workers claim
    rows themselves).  A read first, so the common case takes no write
    lock."""
    now, late = app.clock.now(), lateness(app)
    reader = app.engine.execution_options(**{SQLITE_DEFERRED: True})
    with db_errors("expire"), reader.connect() as conn:
        if not recovery.any_too_late(conn, now=now, lateness=late):
            return 0
    with db_errors("expire"), app.engine.begin() as conn:
        return recovery.expire_overdue(conn, now=now, lateness=late, limit=limit)
