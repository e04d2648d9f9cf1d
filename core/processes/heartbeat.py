"""The process registry: relays and workers heartbeat a ``duebox_lease`` row.

Each process owns one row named ``relay:<token>`` or ``worker:<token>``
(the process token is unique across restarts and hosts) with
``expires_at = now + ttl`` and an ``info`` JSON (backend, queues, pid, host,
started_at, counters).  A clean stop deletes the row; a crashed process's row
simply expires: readers ignore expired rows and the relay prunes them.  Other
uses of ``duebox_lease`` (named leases) never carry these prefixes.

Before its first row, a process takes its liveness lock (core/processes/liveness.py);
the row then carries ``info.name`` (the process name its lease owners start
with) and ``info.liveness`` (the lock was taken), which is what lets a peer
find a dead process at once (core/processes/takeover.py) rather than by lease expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, delete, or_, select, update

from ..clock import sync_clock
from ..db import db_errors
from ..errors import DatabaseError
from ..observability.trouble import log_trouble
from ..tables import lease
from .liveness import SessionLock

log = logging.getLogger("duebox.heartbeat")

ROLES = ("relay", "worker")


def row_name(role: str, name: str) -> str:
    """``relay:<token>``: a process name already carrying its role is kept."""
    return name if name.startswith(f"{role}:") else f"{role}:{name}"


def beat(conn: Connection, *, name: str, now: datetime, ttl: float,
         info: dict[str, Any]) -> None:
    """Create or renew this process's row (an update, else an insert: the
    name is this process's own, so nobody races for it)."""
    values = {"owner": name, "expires_at": now + timedelta(seconds=ttl),
              "info": {**info, "heartbeat_at": now.isoformat()}}
    if conn.execute(update(lease).where(lease.c.name == name).values(**values)).rowcount == 0:
        conn.execute(lease.insert().values(name=name, epoch=0, **values))


def remove(conn: Connection, *, name: str) -> None:
    conn.execute(delete(lease).where(lease.c.name == name))


def _ours() -> Any:
    return or_(*[lease.c.name.like(f"{role}:%") for role in ROLES])


def watched(conn: Connection, limit: int = 1000) -> dict[str, str]:
    """Registered processes that hold a liveness lock, expired rows too (a
    crashed process stops renewing): process name → row name."""
    rows = conn.execute(select(lease.c.name, lease.c.info).where(_ours()).limit(limit)).all()
    out = {}
    for row, info in rows:
        info = info if isinstance(info, dict) else {}
        name = info.get("name")
        if info.get("liveness") and isinstance(name, str) and "#" not in name:
            out[name] = row
    return out


def expired_names(conn: Connection, *, now: datetime, limit: int = 500) -> list[str]:
    ids = select(lease.c.name).where(_ours(), lease.c.expires_at < now).limit(limit)
    return list(conn.execute(ids).scalars())


def prune(conn: Connection, *, now: datetime, limit: int = 500,
          names: list[str] | None = None) -> int:
    """Delete up to ``limit`` expired process rows (``names``: those found
    expired by an earlier read)."""
    if names is None:
        names = expired_names(conn, now=now, limit=limit)
    if not names:
        return 0
    return conn.execute(
        delete(lease).where(lease.c.name.in_(names), lease.c.expires_at < now)).rowcount


@dataclass
class ProcessRow:
    """A live process's registry row (a relay or a worker)."""

    name: str
    role: str
    heartbeat_at: datetime | None
    expires_at: datetime
    info: dict[str, Any]


def alive(conn: Connection, now: datetime, limit: int = 1000) -> list[Any]:
    """Unexpired process rows (at most ``limit``), relays first."""
    rows = conn.execute(
        select(lease.c.name, lease.c.expires_at, lease.c.info)
        .where(_ours(), lease.c.expires_at >= now).order_by(lease.c.name).limit(limit)
    ).all()
    out = []
    for name, expires_at, info in rows:
        info = dict(info or {})
        at = info.get("heartbeat_at")
        out.append(ProcessRow(name=name, role=name.split(":", 1)[0],
                              heartbeat_at=datetime.fromisoformat(at) if at else None,
                              expires_at=expires_at, info=info))
    return out




class ProcessHeartbeat:
    """Keeps a process's registry row fresh while :meth:`run` runs and deletes
    it on a clean stop.  ``tick`` (optional, sync) runs every ``tick_interval``
    seconds in the same loop — the relay's database snapshot and pruning."""

    def __init__(
        self, engine: Any, clock: Any, *, role: str, name: str,
        info: Callable[[], dict[str, Any]], interval: float = 5.0, ttl_intervals: float = 3.0,
        tick: Callable[[], None] | None = None, tick_interval: float | None = None,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.process = name
        self.name = row_name(role, name)
        # Lease owners are ``<name>#<n>``: a name with a '#' would prefix
        # another's, so such a process is found dead by lease expiry only.
        self.lock = SessionLock(engine, name) if "#" not in name else None
        self.info = info
        self.interval = interval
        self.ttl = interval * ttl_intervals
        self.tick = tick
        self.tick_interval = tick_interval if tick_interval is not None else interval
        self.started_at = clock.now()
        self.beats = 0
        self._poked = False
        self._wake: asyncio.Event | None = None
        # A beat cancelled on stop goes on in its thread: without this, it
        # could write the row again after stop() deleted it.
        self._row_lock = threading.Lock()
        self._removed = False

    def beat_once(self) -> None:
        with self._row_lock:
            if not self._removed:
                self._beat()

    def _beat(self) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started_at": self.started_at.isoformat(), "name": self.process,
                "liveness": self.lock is not None and self.lock.ever_held, **self.info()}
        engine = self.engine
        if engine.dialect.name in ("mysql", "mariadb"):
            # InnoDB's REPEATABLE READ locks the gap an UPDATE finds empty, so
            # two processes' first beats (update, then insert) deadlocked
            # (error 1213) when they started together.
            engine = engine.execution_options(isolation_level="READ COMMITTED")
        with engine.begin() as conn:
            # Each beat also re-reads the database's clock, which every
            # due-time decision of this process follows (never early even
            # when this machine's clock runs ahead).
            sync_clock(self.clock, conn)
            beat(conn, name=self.name, now=self.clock.now(), ttl=self.ttl, info=info)
        self.beats += 1

    def register(self) -> None:
        """Before the first lease: take the liveness lock, then write the
        row (which says the lock is held) and read the database's clock.  A
        database that cannot be reached leaves both to the heartbeat loop
        (the lock's keeper thread retries); meanwhile a crash of this process
        is noticed by lease expiry, as before."""
        if self.lock is not None:
            self.lock.acquire()
        self._removed = False
        try:
            with db_errors("registering the process"):
                self.beat_once()
        except DatabaseError as exc:
            log_trouble(log, "registering the process", exc,
                        "cannot register this process yet: %s", exc)
            self.sync_clock_once()

    def sync_clock_once(self) -> None:
        """Read the database's clock now, before the first due-time decision
        (the first beat may come later); a database that cannot be reached
        leaves the local clock in use until a beat gets through."""
        try:
            with db_errors("reading the database's clock"), self.engine.connect() as conn:
                sync_clock(self.clock, conn)
        except DatabaseError as exc:
            log_trouble(log, "reading the database's clock", exc,
                        "cannot read the database's clock yet: %s", exc)

    def remove_once(self) -> None:
        with self._row_lock:
            self._removed = True
            with self.engine.begin() as conn:
                remove(conn, name=self.name)

    def poke(self) -> None:
        """Beat now, not at the next interval (what the row says changed).
        Called on the loop :meth:`run` runs in."""
        self._poked = True
        if self._wake is not None:
            self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        last_beat = last_tick = -math.inf
        self._wake = asyncio.Event()
        while not stop.is_set():
            now = time.monotonic()
            try:
                if now - last_beat >= self.interval or self._poked:
                    last_beat, self._poked = now, False
                    await asyncio.to_thread(self.beat_once)
                if self.tick is not None and now - last_tick >= self.tick_interval:
                    last_tick = now
                    await asyncio.to_thread(self.tick)
            except Exception as exc:  # never fatal: the next beat retries
                log_trouble(log, "heartbeat", exc, "%s: heartbeat failed: %s", self.name, exc)
            wait = min(self.interval, self.tick_interval if self.tick else self.interval)
            self._wake.clear()
            if self._poked:
                continue
            waiters = {asyncio.ensure_future(stop.wait()),
                       asyncio.ensure_future(self._wake.wait())}
            await asyncio.wait(waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()

    async def stop(self, task: asyncio.Task[None] | None) -> None:
        """Stop ``task`` (this heartbeat's :meth:`run`) and delete the row."""
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:
            await asyncio.to_thread(self.remove_once)
        except Exception as exc:  # the row expires on its own
            log_trouble(log, "removing the heartbeat row", exc,
                        "%s: could not remove the heartbeat row: %s", self.name, exc)
        if self.lock is not None:  # after the row: a row never outlives its lock
            await asyncio.to_thread(self.lock.release)


__all__ = ["ROLES", "ProcessHeartbeat", "alive", "beat", "expired_names", "prune", "remove",
           "row_name", "watched"]
