"""Process liveness from the database session: who is dead, at once.

Each relay and worker, before it leases anything, takes a lock on its own
process name and holds it for life on one dedicated connection:

* PostgreSQL: a session-level ``pg_advisory_lock`` on a 64-bit hash of the name;
* MySQL/MariaDB: ``GET_LOCK('duebox:<hash>')``;
* SQLite: an exclusive ``flock`` on ``<database file>.procs/<hash>.lock``.

When the process dies (SIGKILL, OOM, a crash) the server ends its session
(the kernel closes its files) and the lock is free at once.  Its registry row
(core/processes/heartbeat.py) is written only once the lock is held and says so
(``info.liveness``), and every lease it takes is owned by ``<name>#<n>``.
A peer (the relay's recovery pass) that finds a registered process's lock
free twice, at least :data:`CONFIRM_AFTER` apart, knows it is gone and
returns its leased jobs at once (core/leases/recovery.py ``recover_owned``),
instead of waiting for their leases to expire.

Why this is safe even when the verdict is wrong (docs/design.md, "Liveness"):
a process wrongly found dead (its lock connection dropped and did not come
back in time) is treated exactly like one paused past its lease: its jobs
run elsewhere, and every write it makes afterwards is fenced by
``lease_owner`` + ``lease_generation`` and matches nothing.  The lock only
decides *when* a lease may be taken over, never whether a write is accepted.
Reading a peer's lock (``pg_locks``, ``IS_FREE_LOCK``) takes nothing, so a
probe never makes a live process's lock look taken or free.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.pool import NullPool

from ..clock import server_source_sql
from ..observability.trouble import log_trouble

log = logging.getLogger("duebox.liveness")

# A peer declares a process dead when it finds its lock free on two looks at
# least this many seconds apart: a live process whose lock connection
# dropped (a database restart, pg_terminate_backend) has this long to take
# its lock again before its jobs are run elsewhere.
CONFIRM_AFTER = 1.0
# How often a process checks its own lock connection and, if it dropped,
# takes the lock again.
KEEP_INTERVAL = 0.25
# TCP keepalive on the lock connection (PostgreSQL, both ends): a host that
# vanished without closing its socket (power-off, partition) loses its
# session after about idle + interval * count seconds.
KEEPALIVE = {"idle": 5, "interval": 2, "count": 3}
# How long the lock connection waits for one host of the database URL: with
# a multi-host URL, a host that vanished without a word (a primary's machine
# powered off) costs this much before the next host is tried.
CONNECT_TIMEOUT = 5
# After the database server changed under a peer (a standby promoted behind
# a multi-host URL, or the server restarted: core/clock.server_source_sql
# answers differently), every session ended at once and every lock is free
# until its process connects again — which, when the old primary's host
# does not answer, first waits CONNECT_TIMEOUT on it.  So no verdict for
# this long after the change was seen: long enough for two hosts that do
# not answer, then the second look.
AFTER_SERVER_CHANGE = 2 * CONNECT_TIMEOUT + CONFIRM_AFTER


def lock_key(name: str) -> int:
    """The signed 64-bit advisory-lock key of a process name."""
    digest = hashlib.blake2b(name.encode(), digest_size=8, person=b"duebox-live").digest()
    return int.from_bytes(digest, "big", signed=True)


def _mysql_name(name: str) -> str:
    return f"duebox:{lock_key(name) & 0xFFFFFFFFFFFFFFFF:016x}"


def supported(engine: Engine) -> bool:
    """Whether processes on this database can tell each other's death: not
    for an in-memory SQLite database (one process anyway)."""
    if engine.dialect.name == "sqlite":
        return _sqlite_dir(engine) is not None
    return engine.dialect.name in ("postgresql", "mysql", "mariadb")


def _sqlite_dir(engine: Engine) -> Path | None:
    db = engine.url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db + ".procs")


def _sqlite_file(engine: Engine, name: str) -> Path:
    folder = _sqlite_dir(engine)
    assert folder is not None
    return folder / f"{lock_key(name) & 0xFFFFFFFFFFFFFFFF:016x}.lock"


class SessionLock:
    """This process's liveness lock (see the module docstring).

    :meth:`acquire` takes it on a connection of its own (or the SQLite lock
    file) and starts a thread that checks that connection every
    :data:`KEEP_INTERVAL` and takes the lock again if it dropped.
    :attr:`held` says whether the lock is held right now."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.dialect = engine.dialect.name
        self.held = False
        self.ever_held = False
        self.retaken = 0  # times the lock was taken again after its connection dropped
        self._conn: Connection | None = None
        self._fd: int | None = None
        self._lock_engine: Engine | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    # --- taking and keeping -------------------------------------------------

    def acquire(self) -> bool:
        """Take the lock now (no wait) and keep it; False if it could not be
        taken yet (database unreachable, or another session holds it): the
        keeper thread goes on trying."""
        if not supported(self.engine):
            return False
        self._try_take()
        if self._thread is None:
            self._thread = threading.Thread(target=self._keep, name="duebox-liveness",
                                            daemon=True)
            self._thread.start()
        return self.held

    def _try_take(self) -> None:
        try:
            took = self._take()
        except Exception as exc:  # the database is down: the keeper retries
            self._drop()
            if not self._warned:
                log_trouble(log, "liveness lock", exc,
                            "%s: cannot take the liveness lock yet (%s); until it is held, a "
                            "crash of this process is noticed by lease expiry only",
                            self.name, exc)
                self._warned = True
            return
        if took:
            if self.ever_held and not self.held:
                self.retaken += 1
                # The end of a trouble already said: news, not a problem.
                log.info("%s: liveness lock taken again after its connection dropped",
                         self.name)
            self.held = self.ever_held = True
            self._warned = False
        elif not self._warned:
            log.warning("%s: another session holds this process's liveness lock (a second "
                        "process with this name, or this one's previous connection, which "
                        "the server has not closed yet); retrying", self.name)
            self._warned = True

    def _take(self) -> bool:
        if self.dialect == "sqlite":
            return self._take_file()
        if self._conn is None:
            self._conn = self._engine().connect()
        if self.dialect == "postgresql":
            for setting, value in KEEPALIVE.items():  # the server's side of the socket
                self._conn.exec_driver_sql(f"SET tcp_keepalives_{setting} = {int(value)}")
            took = self._conn.execute(text("SELECT pg_try_advisory_lock(:k)"),
                                      {"k": lock_key(self.name)}).scalar()
        else:
            took = self._conn.execute(text("SELECT GET_LOCK(:n, 0)"),
                                      {"n": _mysql_name(self.name)}).scalar()
        if not took:
            self._drop()
        return bool(took)

    def _take_file(self) -> bool:
        path = _sqlite_file(self.engine, self.name)
        path.parent.mkdir(exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def _engine(self) -> Engine:
        if self._lock_engine is None:
            args: dict[str, Any] = {}
            if self.dialect == "postgresql":
                args = {"keepalives": 1, "keepalives_idle": KEEPALIVE["idle"],
                        "keepalives_interval": KEEPALIVE["interval"],
                        "keepalives_count": KEEPALIVE["count"],
                        "connect_timeout": CONNECT_TIMEOUT}
            else:
                args = {"connect_timeout": CONNECT_TIMEOUT}
            self._lock_engine = create_engine(self.engine.url, poolclass=NullPool,
                                              isolation_level="AUTOCOMMIT", connect_args=args)
        return self._lock_engine

    def _keep(self) -> None:
        while not self._stop.wait(KEEP_INTERVAL):
            if self.dialect == "sqlite" and self.held:
                continue  # a file lock ends only with this process
            lost = self._lost() if self.held else None
            if self.held and lost is None:
                continue
            if lost is not None:
                log_trouble(log, "liveness lock", lost,
                            "%s: the liveness lock's connection dropped (%s); taking it again",
                            self.name, lost)
            self.held = False
            self._drop()
            self._try_take()

    def _lost(self) -> Exception | None:
        """Why the lock's connection no longer answers; None while it does."""
        assert self._conn is not None
        try:
            self._conn.exec_driver_sql("SELECT 1").scalar()
        except Exception as exc:
            return exc
        return None

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.invalidate()
                self._conn.close()
            self._conn = None

    def release(self) -> None:
        """On a clean stop, after the registry row is gone."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        held, self.held = self.held, False
        if self._fd is not None:
            with contextlib.suppress(OSError):
                _sqlite_file(self.engine, self.name).unlink()
            os.close(self._fd)
            self._fd = None
        if self._conn is not None:
            with contextlib.suppress(Exception):
                # Let go now: the server ends a closed session's locks a moment
                # after the close returns, and a look in that moment (another
                # process of this name, or the relay's liveness check) would
                # still see this process alive.
                if held and self.dialect == "postgresql":
                    self._conn.execute(text("SELECT pg_advisory_unlock(:k)"),
                                       {"k": lock_key(self.name)})
                elif held:
                    self._conn.execute(text("SELECT RELEASE_LOCK(:n)"),
                                       {"n": _mysql_name(self.name)})
            with contextlib.suppress(Exception):
                self._conn.close()  # ends the session: the lock goes with it
            self._conn = None
        if self._lock_engine is not None:
            self._lock_engine.dispose()
            self._lock_engine = None


# --- looking at others' locks ---------------------------------------------------


def free_names(conn: Connection, names: Sequence[str]) -> set[str]:
    """Of these process names, those whose liveness lock nobody holds now
    (one statement for all of them; a read that takes nothing)."""
    if not names:
        return set()
    dialect = conn.dialect.name
    if dialect == "postgresql":
        # A bigint key shows as classid (high 32 bits) and objid (low), objsubid 1.
        held = {(int(hi) << 32) | int(lo) for hi, lo in conn.execute(text(
            "SELECT classid::bigint, objid::bigint FROM pg_locks "
            "WHERE locktype = 'advisory' AND objsubid = 1 AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ))}
        return {n for n in names if lock_key(n) & 0xFFFFFFFFFFFFFFFF not in held}
    if dialect in ("mysql", "mariadb"):
        params = {f"n{i}": _mysql_name(n) for i, n in enumerate(names)}
        cols = ", ".join(f"IS_FREE_LOCK(:n{i})" for i in range(len(names)))
        row = conn.execute(text(f"SELECT {cols}"), params).one()
        return {n for n, free in zip(names, row, strict=True) if free == 1}
    if dialect == "sqlite" and supported(conn.engine):
        return {n for n in names if _file_free(_sqlite_file(conn.engine, n))}
    return set()


def _file_free(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # taken before the row was written; gone: its owner is gone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's lock too
    return True


def forget(engine: Engine, name: str) -> None:
    """A dead process's leftovers outside the database: its SQLite lock file."""
    if engine.dialect.name == "sqlite" and supported(engine):
        with contextlib.suppress(OSError):
            _sqlite_file(engine, name).unlink()


class DeathWatch:
    """A peer's view of which registered processes are dead: a lock found
    free is a suspicion; found free again :data:`CONFIRM_AFTER` later (by
    this same watcher's monotonic clock: no clock skew enters), a verdict —
    but none within :data:`AFTER_SERVER_CHANGE` of seeing the database
    server change (a failover, a restart), which freed every lock at once."""

    def __init__(self, confirm_after: float = CONFIRM_AFTER,
                 after_server_change: float = AFTER_SERVER_CHANGE) -> None:
        self.confirm_after = confirm_after
        self.after_server_change = after_server_change
        self._suspected: dict[str, float] = {}
        self._server: object = None
        self._quiet_until = -math.inf

    def dead(self, conn: Connection, names: Sequence[str]) -> list[str]:
        """Of the registered ``names``, the confirmed dead."""
        sql = server_source_sql(conn.dialect.name)
        server = None if sql is None else conn.execute(sql).scalar()
        return self.verdict(free_names(conn, names), server, time.monotonic())

    def verdict(self, free: set[str], server: object, now: float) -> list[str]:
        """The confirmed dead, given the names whose lock is ``free`` now, on
        the database server ``server`` identifies, at monotonic ``now``."""
        if server != self._server:
            if self._server is not None:
                self._quiet_until = now + self.after_server_change
                log.warning("the database server changed (a failover or a restart): every "
                            "liveness lock went with it; no process is taken for dead for "
                            "the next %g s, while each takes its lock again",
                            self.after_server_change)
            self._server = server
        self._suspected = {n: self._suspected.get(n, now) for n in free}
        if now < self._quiet_until:
            return []
        return [n for n, since in self._suspected.items() if now - since >= self.confirm_after]

    def next_look(self) -> float | None:
        """Seconds until a suspicion can be confirmed (None: no suspect)."""
        if not self._suspected:
            return None
        now = time.monotonic()
        return max(0.0, self._quiet_until - now,
                   min(since + self.confirm_after - now for since in self._suspected.values()))


__all__ = ["AFTER_SERVER_CHANGE", "CONFIRM_AFTER", "DeathWatch", "SessionLock", "forget",
           "free_names", "lock_key", "supported"]
