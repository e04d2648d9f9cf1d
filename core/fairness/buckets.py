"""Token buckets in the database, shared by every claimer: the relay's fair
claim and ``sql://`` workers spend from the same rows (``duebox_rate_bucket``),
so a rate limit or tenant quota holds across any number of processes.

Rate buckets: a bucket is one ``duebox_rate_bucket`` row (``global``,
``queue:<name>``, ``tenant:<name>``) holding ``tokens`` and ``updated_at``.
A claim transaction locks the rows it needs (``SELECT ... FOR UPDATE``, in
name order so two claimers never deadlock), refills them by the time elapsed
since ``updated_at``, claims at most what they allow and writes back what it
spent, all before it commits: a token spent by one process is gone for the
others, and a claim that rolls back spends nothing.  On SQLite the claim's
``BEGIN IMMEDIATE`` already serialises writers, so the row lock is implicit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, select, update
from sqlalchemy.exc import IntegrityError

from ..tables import rate_bucket


@dataclass(frozen=True, slots=True)
class Limit:
    """``rate`` tokens (jobs) per second, at most ``burst`` saved up."""

    rate: float
    burst: float


@dataclass
class Held:
    """A bucket locked by the current transaction."""

    name: str
    limit: Limit
    tokens: float
    at: datetime  # the instant ``tokens`` is the level at
    spent: int = 0

    @property
    def available(self) -> int:
        return max(0, math.floor(self.tokens - self.spent + 1e-9))


def _stamp(conn: Connection, at: datetime) -> datetime:
    """The instant the row can store exactly.  MySQL/MariaDB ``DATETIME``
    columns (as migrated) keep whole seconds: a stored ``12:00:00.9`` read
    back as ``12:00:00`` would refill 0.9 s that already counted."""
    if conn.dialect.name in ("mysql", "mariadb"):
        return at.replace(microsecond=0)
    return at


def _ensure(conn: Connection, name: str, limit: Limit, now: datetime) -> None:
    """Create the row full on first use; a concurrent creator wins harmlessly."""
    if conn.execute(select(rate_bucket.c.name).where(rate_bucket.c.name == name)).first():
        return
    try:
        with conn.begin_nested():
            conn.execute(rate_bucket.insert().values(name=name, tokens=limit.burst,
                                                     updated_at=_stamp(conn, now)))
    except IntegrityError:
        pass


def lock_buckets(conn: Connection, limits: Mapping[str, Limit], now: datetime
                 ) -> dict[str, Held]:
    """Lock and refill these buckets for the current transaction."""
    held: dict[str, Held] = {}
    for name in sorted(limits):
        limit = limits[name]
        _ensure(conn, name, limit, now)
        tokens, at = conn.execute(
            select(rate_bucket.c.tokens, rate_bucket.c.updated_at)
            .where(rate_bucket.c.name == name).with_for_update()
        ).one()
        # A claimer whose ``now`` is older than the row's (it waited for the
        # lock, or its clock is behind) refills nothing and never moves the
        # row back in time, so no interval is counted twice.
        elapsed = max(0.0, (now - at).total_seconds())
        held[name] = Held(name, limit, min(limit.burst, float(tokens) + elapsed * limit.rate),
                          max(now, at))
    return held


def spend_buckets(conn: Connection, buckets: Iterable[Held], now: datetime) -> None:
    """Write back the refilled level minus what this transaction spent.  Where
    the row keeps a coarser time than ``now``, the level is stored as of that
    earlier instant (less what accrues until ``now``): the next refill adds
    it back, so nothing is counted twice or lost."""
    for b in buckets:
        at = max(now, b.at)
        stamp = _stamp(conn, at)
        level = b.tokens - b.spent - (at - stamp).total_seconds() * b.limit.rate
        conn.execute(update(rate_bucket).where(rate_bucket.c.name == b.name)
                     .values(tokens=level, updated_at=stamp))


def bucket_wait(buckets: Iterable[Held], n: int) -> float:
    """How long until every bucket holds ``n`` more tokens than now (0: now)."""
    wait = 0.0
    for b in buckets:
        missing = min(n, b.limit.burst) - (b.tokens - b.spent)
        if missing > 0:
            wait = max(wait, missing / b.limit.rate)
    return wait


__all__ = ["Held", "Limit", "bucket_wait", "lock_buckets", "spend_buckets"]
