"""Time, injectable.

All scheduling decisions compare absolute UTC instants taken from one
:class:`Clock`; monotonic time is used only for durations inside a process.
Tests swap in :class:`FakeClock` so they never sleep for real days.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    DateTime,
    Interval,
    TextClause,
    bindparam,
    func,
    literal_column,
    text,
)

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection


class Clock(Protocol):
    def now(self) -> datetime:
        """The current instant, timezone-aware UTC."""

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""


class SystemClock:
    """Wall-clock UTC from the operating system."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that moves only when told to (``advance``) or when slept on."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2030, 1, 1, tzinfo=UTC)

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)

    async def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)


def utcnow() -> datetime:
    return datetime.now(UTC)


def monotonic() -> float:
    return time.monotonic()


class DatabaseClock:
    """The database server's clock, as seen from this process.

    Every process decides "is it due yet?" with its own clock, so a worker
    whose clock runs fast would start jobs early (a soak with a worker 5 s
    ahead under libfaketime started 510 of 2,400 jobs early).  The database
    is the one clock every process shares, so this clock follows it: each
    :meth:`observe` reads the server's time and keeps the offset to the local
    clock.  The offset kept is a *lower bound* (server time minus the local
    time after the read came back), so ``now()`` is never ahead of the
    server: an error can only make a job a little late, never early.  Of the
    recent readings the one with the shortest round trip is used, since its
    bound is the tightest.

    Until the first reading it is the local clock.  SQLite has no server: it
    shares the local clock and is never read.
    """

    # Readings kept; one arrives with every process heartbeat (a few seconds),
    # so a clock step is followed within this many beats.
    _KEEP = 4

    def __init__(self, base: Clock | None = None) -> None:
        self.base = base or SystemClock()
        self._offset = timedelta(0)
        self._readings: list[tuple[float, timedelta]] = []
        self._source: object = None

    @property
    def offset(self) -> timedelta:
        return self._offset

    def now(self) -> datetime:
        return self.base.now() + self._offset

    async def sleep(self, seconds: float) -> None:
        await self.base.sleep(seconds)

    def observe(self, before: datetime, server: datetime, after: datetime,
                source: object = None) -> None:
        """Record one reading: ``server`` was read between the local instants
        ``before`` and ``after``, on the server ``source`` identifies.  A
        reading from another server than the last (a standby promoted behind
        a multi-host URL) replaces the readings kept: the old server's clock
        says nothing about the new one's, and one of them with a shorter
        round trip would otherwise be followed for up to four more beats —
        early by the difference if the new server's clock is behind."""
        server = as_utc(server)
        if source != self._source:
            self._readings, self._source = [], source
        rtt = (after - before).total_seconds()
        self._readings = [*self._readings[-(self._KEEP - 1):], (rtt, server - after)]
        self._offset = min(self._readings, key=lambda r: r[0])[1]

    def sync(self, conn: Connection) -> None:
        """Read the server's clock over ``conn``."""
        server_now = server_now_sql(conn.dialect.name)
        if server_now is None:
            return
        source_sql = server_source_sql(conn.dialect.name)
        source = None if source_sql is None else conn.execute(source_sql).scalar()
        before = self.base.now()
        server = conn.execute(server_now).scalar_one()
        after = self.base.now()
        self.observe(before, server, after, source)


def as_utc(server: datetime) -> datetime:
    """A server's reading as an aware instant (MySQL/MariaDB return naive UTC)."""
    return server.replace(tzinfo=UTC) if server.tzinfo is None else server


def server_now_sql(dialect: str) -> TextClause | None:
    """The query for the database server's time now, or None (SQLite has no
    server: its clock is the machine's)."""
    if dialect == "postgresql":
        # clock_timestamp(), not now(): now() is the transaction's start.
        return text("SELECT clock_timestamp()")
    if dialect in ("mysql", "mariadb"):
        return text("SELECT UTC_TIMESTAMP(6)")
    return None


def server_source_sql(dialect: str) -> TextClause | None:
    """The query for what tells this database server from another (None
    without a server): a promoted standby, or the same server restarted,
    answers differently."""
    if dialect == "postgresql":
        return text("SELECT concat_ws(' ', pg_postmaster_start_time(), inet_server_addr(), "
                    "inet_server_port())")
    if dialect in ("mysql", "mariadb"):
        return text("SELECT CONCAT_WS(' ', @@hostname, @@port)")
    return None


def server_time_after(dialect: str, delay: timedelta
                      ) -> tuple[ColumnElement[datetime], dict[str, Any]] | None:
    """The server's time plus ``delay``: an expression the database evaluates
    in the statement that writes it (exact to the microsecond) and the
    parameters to execute it with; None without a server."""
    if dialect == "postgresql":
        return _PG_DUE, {"duebox_delay": delay}
    if dialect in ("mysql", "mariadb"):
        return _MY_DUE, {"duebox_delay_us": delay // timedelta(microseconds=1)}
    return None


# Built once, the delay a parameter: building an expression per job costs
# more than the rest of an insert's Python work.
_PG_DUE: ColumnElement[datetime] = (
    func.clock_timestamp(type_=DateTime(timezone=True))
    + bindparam("duebox_delay", type_=Interval()))
# UTC_TIMESTAMP(6) is the statement's start, after the caller's call.
_MY_DUE: ColumnElement[datetime] = func.timestampadd(
    literal_column("MICROSECOND"), bindparam("duebox_delay_us", type_=BigInteger()),
    literal_column("UTC_TIMESTAMP(6)"), type_=DateTime())


def follows_real_time(clock: Clock) -> bool:
    """Whether ``clock`` moves on by itself, so a thread can wait for it by
    sleeping (a :class:`FakeClock` moves only when told to)."""
    if isinstance(clock, DatabaseClock):
        return follows_real_time(clock.base)
    return isinstance(clock, SystemClock)


def wait_until(clock: Clock, instant: datetime) -> None:
    """Block the calling thread until ``clock`` reads ``instant`` or later
    (for a clock that :func:`follows_real_time`).  A thread's sleep wakes
    within a fraction of a millisecond; the event loop's timers only to the
    millisecond."""
    while (left := (instant - clock.now()).total_seconds()) > 0:
        time.sleep(left)


def sync_clock(clock: Clock, conn: Connection) -> None:
    """Let ``clock`` follow the database if it is a :class:`DatabaseClock`."""
    if isinstance(clock, DatabaseClock):
        clock.sync(conn)
