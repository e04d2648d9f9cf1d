"""Engines, dialect differences and the edge where driver errors become ours.

One code path where SQLAlchemy allows it; the branches here are the places
where dialects really differ: SQLite's write locking, PostgreSQL's
LISTEN/NOTIFY, and insert-if-absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine, Table, create_engine, event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool, StaticPool

from .credentials import redacted
from .errors import (
    ConfigurationError,
    DatabaseError,
    MissingDependencyError,
    PermissionDeniedError,
    TablesMissingError,
)
from .message import lenient_json
from .observability.logs import CollapsedLog

log = logging.getLogger("duebox.db")

NOTIFY_CHANNEL = "duebox_jobs"


# libpq's multi-host form, ``scheme://[user[:password]@]h1[:p1],h2[:p2]/...``:
# the user and password as SQLAlchemy reads them (the user up to ':' or '/',
# the password up to the first '@'), then a host list holding a comma.
_HOST_LIST = re.compile(
    r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://(?:[^:/@]*(?::[^@]*)?@)?)"
    r"(?P<hosts>[^/?#@]*,[^/?#@]*)(?P<tail>[/?].*)?$", re.DOTALL)


def _host_list_as_query(url: str) -> str:
    """libpq's ``h1:p1,h2:p2`` host list (what PostgreSQL's documentation
    and most failover guides give) as SQLAlchemy's ``?host=h1:p1&host=h2:p2``,
    which SQLAlchemy's own URL parser reads (it takes ``p1,h2:p2`` for a
    port) and hands to psycopg as the same host list."""
    found = _HOST_LIST.match(url)
    if found is None or not url.startswith("postgres"):
        return url
    hosts = []
    for entry in found["hosts"].split(","):
        host, _, port = entry.partition(":")
        if not host or "[" in entry or (port and not port.isdigit()):
            raise ConfigurationError(
                f"database_url: {redacted(url)}: each entry of a host list must be "
                f"host or host:port with a numeric port, and no IPv6 address (got {entry!r})")
        hosts.append(f"host={entry}")
    path, _, query = (found["tail"] or "/").partition("?")
    return found["head"] + path + "?" + "&".join([*hosts, *([query] if query else [])])


def parse_database_url(url: str | URL) -> URL:
    if isinstance(url, str):
        url = _host_list_as_query(url)
    try:
        parsed = make_url(url)
    except (sa_exc.ArgumentError, ValueError) as exc:
        raise ConfigurationError(
            f"database_url: must be an SQLAlchemy URL such as sqlite:///duebox.db "
            f"or postgresql+psycopg://host/db (got {redacted(str(url))!r})"
        ) from exc
    if parsed.host is not None and "@" in parsed.host:
        # SQLAlchemy ends the password at its first '@': the rest would be
        # taken for the host, and printed by every connection error.
        raise ConfigurationError(
            f"database_url: {redacted(str(url))}: an '@' in the user or password: "
            "percent-encode it as %40")
    if parsed.drivername.split("+")[0] == "postgres":
        # What Heroku and many platforms hand out; SQLAlchemy knows only
        # "postgresql".
        driver = parsed.drivername.partition("+")[2]
        parsed = parsed.set(drivername=f"postgresql+{driver}" if driver else "postgresql")
    if parsed.drivername == "postgresql":
        # A bare postgresql:// means psycopg2 to SQLAlchemy; duebox's [postgres]
        # extra installs psycopg 3, which also serves the async engine.
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


_MYSQL = ("mysql", "mariadb")
# Every transaction duebox opens on MySQL/MariaDB, its own and its handlers',
# runs at READ COMMITTED, PostgreSQL's default.  InnoDB's default, REPEATABLE
# READ, takes next-key and gap locks: a locking read or an UPDATE keeps a lock
# on every row (and gap) its index scan passed, not only on the rows it
# changed, so transactions that touch different jobs block and deadlock each
# other — and a deadlock rolls a whole group-commit transaction back
# (consumers/batch.py).  At READ COMMITTED only the rows a statement
# changes or locks stay locked.
MYSQL_ISOLATION = "READ COMMITTED"


def create_sync_engine(url: str | URL, **kw: Any) -> Engine:
    parsed = parse_database_url(url)
    backend = parsed.get_backend_name()
    try:
        if backend == "sqlite":
            return _sqlite_engine(parsed, **kw)
        kw.setdefault("pool_size", 10)
        kw.setdefault("max_overflow", 20)
        if backend in _MYSQL:
            kw.setdefault("isolation_level", MYSQL_ISOLATION)
        # A JSON value that does not parse, or nests too deep to parse safely
        # (a row edited by hand: PostgreSQL's JSONB takes 5,000 levels), must
        # not make a claim raise (see message.lenient_json).
        kw.setdefault("json_deserializer", lenient_json)
        engine = create_engine(parsed, **kw)
        if not kw.get("pool_pre_ping"):
            ping_when_idle(engine)
        return engine
    except sa_exc.NoSuchModuleError as exc:
        raise ConfigurationError(
            f"database_url: unknown database dialect {parsed.drivername!r}"
        ) from exc
    except ModuleNotFoundError as exc:
        extra = "postgres" if backend == "postgresql" else backend
        raise MissingDependencyError(exc.name or parsed.drivername, extra) from exc


def create_async_engine_for(url: str | URL) -> AsyncEngine:
    """The async twin of the sync engine, for ``async def`` handlers' sessions."""
    parsed = parse_database_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        parsed = parsed.set(drivername="sqlite+aiosqlite")
    elif backend == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif backend in ("mysql", "mariadb"):
        parsed = parsed.set(drivername=f"{backend}+aiomysql")
    try:
        if backend == "sqlite":
            engine = create_async_engine(parsed, poolclass=NullPool,
                                         json_deserializer=lenient_json)
            event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
            event.listen(engine.sync_engine, "begin", _sqlite_on_begin)
            return engine
        async_engine = create_async_engine(
            parsed, json_deserializer=lenient_json,
            **({"isolation_level": MYSQL_ISOLATION} if backend in _MYSQL else {}))
        ping_when_idle(async_engine.sync_engine)
        return async_engine
    except ModuleNotFoundError as exc:
        raise MissingDependencyError(exc.name or str(parsed.drivername), backend) from exc


# A pooled connection idle this long is pinged before use.  Not every
# checkout, as ``pool_pre_ping`` would: that is one more round trip per
# transaction, on the worker's hot path two per job.  A connection used within
# the last second that the server dropped meanwhile fails its statement
# instead; SQLAlchemy then invalidates the pool and the caller's retry (every
# relay and worker step retries on DatabaseError) gets fresh connections.
_PING_AFTER_IDLE = 1.0
_IDLE_SINCE = "duebox_idle_since"


def ping_when_idle(engine: Engine) -> None:
    def checkin(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info[_IDLE_SINCE] = time.monotonic()

    def checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.pop(_IDLE_SINCE, None)
        if since is None or time.monotonic() - since < _PING_AFTER_IDLE:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # the driver's own error: the connection is gone
            raise sa_exc.DisconnectionError(f"stale pooled connection: {exc}") from exc
        if not alive:
            raise sa_exc.DisconnectionError("stale pooled connection")

    event.listen(engine.pool, "checkin", checkin)
    event.listen(engine.pool, "checkout", checkout)


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # Let us issue BEGIN ourselves (see _sqlite_on_begin); WAL lets readers
    # run beside the one writer; busy_timeout waits for the write lock
    # instead of failing at once when relays and workers share the file.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA busy_timeout = 30000")
    cur.execute("PRAGMA journal_mode = WAL")
    cur.execute("PRAGMA synchronous = NORMAL")
    cur.close()


# Execution option for a SQLite transaction that should take the write lock
# only at its first write: a handler's own transaction, so that a handler busy
# with something else (an API call) does not hold the one write lock and
# heartbeats, cancels and claims can go on meanwhile.
SQLITE_DEFERRED = "duebox_sqlite_deferred"


def _sqlite_on_begin(conn: Connection) -> None:
    # SQLite has no SKIP LOCKED; taking the write lock at BEGIN makes every
    # claim a serialised, short transaction, which is the correct equivalent
    # and avoids the deadlock of two readers upgrading to writers.
    deferred = conn.get_execution_options().get(SQLITE_DEFERRED)
    conn.exec_driver_sql("BEGIN" if deferred else "BEGIN IMMEDIATE")


_SQLITE_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "BEGIN IMMEDIATE")
# Longer than this for the in-process writer lock, and the statement goes
# ahead to SQLite's own busy timeout (which then decides).
_WRITER_WAIT = 30.0


class _SQLiteWriters:
    """One writing transaction at a time per engine, waited for in order.

    SQLite lets one connection write at a time; the others poll for the lock
    with the library's back-off, whose sleeps grow to 100 ms — with a dozen
    threads of one worker writing, a transaction could lose the race for
    half a second (jobs started 230-630 ms late at 500 jobs/s).  Within a
    process the writers instead queue on this lock, taken when a transaction
    takes SQLite's (``BEGIN IMMEDIATE`` or its first write) and released when
    it ends, so the lock only mirrors what SQLite would block on anyway.
    Other processes still meet SQLite's own busy wait."""

    def __init__(self, engine: Engine) -> None:
        self.lock = threading.Lock()
        self.holder: Any = None
        dialect = engine.dialect
        commit, rollback = dialect.do_commit, dialect.do_rollback

        def do_commit(dbapi_conn: Any) -> None:
            try:
                commit(dbapi_conn)
            finally:
                self.release(dbapi_conn)

        def do_rollback(dbapi_conn: Any) -> None:
            try:
                rollback(dbapi_conn)
            finally:
                self.release(dbapi_conn)

        dialect.do_commit = do_commit  # type: ignore[method-assign,assignment]
        dialect.do_rollback = do_rollback  # type: ignore[method-assign,assignment]
        event.listen(engine, "before_cursor_execute", self.before_execute)
        # However a connection leaves (returned, invalidated, closed), its
        # transaction is over: never let the lock outlive it.
        event.listen(engine.pool, "checkin", lambda dbapi_conn, _rec: self.release(dbapi_conn))
        for leaving in ("invalidate", "soft_invalidate"):
            event.listen(engine.pool, leaving,
                         lambda dbapi_conn, _rec, _exc: self.release(dbapi_conn))
        event.listen(engine.pool, "close", lambda dbapi_conn, _rec: self.release(dbapi_conn))

    def before_execute(self, conn: Connection, _cursor: Any, statement: str, *_: Any) -> None:
        dbapi_conn = conn.connection.dbapi_connection
        if self.holder is dbapi_conn or not statement.lstrip().upper().startswith(_SQLITE_WRITES):
            return
        if self.lock.acquire(timeout=_WRITER_WAIT):
            self.holder = dbapi_conn

    def release(self, dbapi_conn: Any) -> None:
        # Commit and rollback get the pool's proxy; the events, the driver's.
        dbapi_conn = getattr(dbapi_conn, "dbapi_connection", dbapi_conn)
        if dbapi_conn is not None and self.holder is dbapi_conn:
            self.holder = None
            self.lock.release()


def _sqlite_engine(parsed: URL, **kw: Any) -> Engine:
    memory = parsed.database in (None, "", ":memory:")
    if memory:
        kw.setdefault("poolclass", StaticPool)
        kw.setdefault("connect_args", {"check_same_thread": False})
    else:
        kw.setdefault("connect_args", {"check_same_thread": False, "timeout": 30})
    # SQLite stores JSON as unchecked text: a bad row must not break a claim.
    kw.setdefault("json_deserializer", lenient_json)
    engine = create_engine(parsed, **kw)
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    if not memory:  # one shared connection (StaticPool): nobody to queue behind
        _SQLiteWriters(engine)
    return engine


@contextlib.contextmanager
def db_errors(action: str) -> Iterator[None]:
    """Convert a driver's error that is about the database, not the statement,
    into :class:`DatabaseError` saying what to do: a missing privilege, a
    missing table, an unreachable server."""
    try:
        yield
    except sa_exc.DBAPIError as exc:
        # First: MySQL reports a missing privilege as an OperationalError.
        if _permission_denied(exc.orig):
            raise PermissionDeniedError(action, _first_line(exc.orig)) from exc
        if _schema_missing(exc.orig):
            raise DatabaseError(
                f"{action}: duebox's tables are missing or older than this duebox "
                f"({_first_line(exc.orig)}): run `duebox db upgrade` against this database, "
                "or check the database URL") from exc
        if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
            raise DatabaseError(
                f"{action}: database unavailable: {_first_line(exc.orig)}; check that the "
                "server is running and that the database URL points at it") from exc
        if exc.connection_invalidated:
            raise DatabaseError(f"{action}: database connection lost: {exc.orig}") from exc
        raise


# PostgreSQL's SQLSTATE for a missing privilege; MySQL/MariaDB's error numbers
# for a table or column privilege a user does not have.
_PG_INSUFFICIENT_PRIVILEGE = "42501"
_MYSQL_DENIED = frozenset({1142, 1143, 1044})
# A table or column that is not there: PostgreSQL's undefined_table and
# undefined_column, MySQL's "doesn't exist" and "unknown column", SQLite's words.
_PG_UNDEFINED = frozenset({"42P01", "42703"})
_MYSQL_UNDEFINED = frozenset({1146, 1054})
_SQLITE_UNDEFINED = ("no such table", "no such column")


def _permission_denied(orig: object) -> bool:
    if getattr(orig, "sqlstate", None) == _PG_INSUFFICIENT_PRIVILEGE:
        return True
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    return bool(args) and isinstance(args[0], int) and args[0] in _MYSQL_DENIED


def _schema_missing(orig: object) -> bool:
    if getattr(orig, "sqlstate", None) in _PG_UNDEFINED:
        return True
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    if bool(args) and isinstance(args[0], int) and args[0] in _MYSQL_UNDEFINED:
        return True
    return type(orig).__module__ == "sqlite3" and str(orig).startswith(_SQLITE_UNDEFINED)


def _first_line(orig: object) -> str:
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__


def missing_sqlite_file(url: str | URL) -> str | None:
    """The path of a SQLite database file that does not exist (connecting
    would create it, empty), else None."""
    parsed = parse_database_url(url)
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or path in (None, "", ":memory:") \
            or parsed.query.get("uri") or path.startswith("file:"):
        return None
    return None if os.path.exists(path) else path


def check_tables(engine: Engine, action: str) -> None:
    """Refuse early, in words saying what to do, when the database has no
    duebox tables; never create a SQLite file on the way (a read-only
    command that did left an empty ``./duebox.db`` behind)."""
    path = missing_sqlite_file(engine.url)
    if path is not None:
        raise DatabaseError(
            f"{action}: no database at {path} (the file does not exist): run `duebox db "
            "upgrade` to create it with duebox's tables, or give --database-url / "
            "DUEBOX_DATABASE_URL")
    with db_errors(action), engine.connect() as conn:
        present = tables_present(conn)
    if not present:
        raise TablesMissingError(action, engine.url.render_as_string(hide_password=True),
                                 "run `duebox db upgrade`, or give --database-url / "
                                 "DUEBOX_DATABASE_URL")


def tables_present(conn: Connection) -> bool:
    """Whether duebox's tables are where ``conn``'s statements find them (on
    PostgreSQL: on its search_path), asked without a statement that fails
    when they are not, so that a transaction ``conn`` is in stays usable
    (PostgreSQL aborts a transaction at any error)."""
    return bool(sa_inspect(conn).has_table("duebox_job"))


def check_reachable(engine: Engine) -> None:
    with db_errors("database_url"), engine.connect() as conn:
        conn.execute(text("SELECT 1"))


def insert_if_absent(
    table: Table, values: dict[str, Any] | list[dict[str, Any]], dialect_name: str,
    index_elements: list[str],
) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING`` in each dialect's words.

    Callers read the result's ``rowcount`` (1: inserted, 0: already there), so
    the statement asks for it to be kept: without ``preserve_rowcount``
    SQLAlchemy reports -1 for an INSERT on psycopg.
    """
    stmt: Any
    if dialect_name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        stmt = pg_insert(table).values(values).on_conflict_do_nothing(
            index_elements=index_elements
        )
    elif dialect_name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        stmt = sqlite_insert(table).values(values).on_conflict_do_nothing(
            index_elements=index_elements
        )
    elif dialect_name in ("mysql", "mariadb"):
        # Not ON DUPLICATE KEY UPDATE: SQLAlchemy's MySQL drivers count matched
        # rows, so a duplicate would report 1.  IGNORE reports 0 (it also turns
        # other errors on this one row into warnings; the rows here are ours).
        stmt = table.insert().values(values).prefix_with("IGNORE")
    else:
        raise ConfigurationError(f"database_url: dialect {dialect_name!r} is not supported")
    return stmt.execution_options(preserve_rowcount=True)


def libpq_conninfo(url: URL) -> str:
    """A PostgreSQL URL as the connection string a psycopg connection of
    duebox's own takes (the LISTEN connection): what SQLAlchemy's engine
    would pass, every host of a multi-host URL and every query parameter
    (``target_session_attrs``) included.  The URL's own text does not serve:
    SQLAlchemy's ``host=h1:p1&host=h2:p2`` is SQLAlchemy's form, and libpq
    reads ``h1:p1`` as a host name."""
    from psycopg.conninfo import make_conninfo

    url = parse_database_url(url)
    _, params = url.get_dialect()().create_connect_args(url)
    params.pop("context", None)  # psycopg's adapters: not part of the address
    return make_conninfo("", **{k: v for k, v in params.items() if v is not None})


class PgWaker:
    """Wakes a sleeper when a producer NOTIFYs (best effort; polling stays).

    Uses psycopg 3's native async connection; with any other driver it is a
    no-op and the caller relies on its poll interval.
    """

    def __init__(self, url: URL, channel: str = NOTIFY_CHANNEL, *, listen: bool = True) -> None:
        self._url = url
        self._channel = channel
        self._listens = listen
        self.event = asyncio.Event()
        self._followers: list[asyncio.Event] = []
        self._task: asyncio.Task[None] | None = None
        self._log = CollapsedLog(log)

    def follower(self) -> PgWaker:
        """A waker with an ``event`` of its own, set by this one's LISTEN
        connection: a relay's pipelines follow their relay's, so a relay
        holds one such connection however many routes it has (one each, 1,000
        routes took all of a server's connections)."""
        follower = PgWaker(self._url, self._channel, listen=False)
        self._followers.append(follower.event)
        return follower

    def _wake(self) -> None:
        self.event.set()
        for woken in self._followers:
            woken.set()

    async def start(self) -> None:
        if not self._listens or self._url.get_backend_name() != "postgresql":
            return
        self._task = asyncio.create_task(self._listen(), name="duebox-listen")

    async def _listen(self) -> None:
        try:
            import psycopg
        except ImportError:
            return
        dsn = libpq_conninfo(self._url)
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {self._channel}")
                    self._wake()  # anything may have been missed while disconnected
                    async for _ in conn.notifies():
                        self._wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log.warning("listen", "LISTEN connection lost (%s); polling until it is "
                                  "back", exc)
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None


def bound_idle_transaction(conn: Connection, seconds: float) -> None:
    """End this transaction's session if it sits idle (no statement
    running) longer than ``seconds`` — a process paused (SIGSTOP) or cut off
    while its transaction holds row locks that are its jobs' leases.  The
    server then releases the locks and lease expiry (or the next claim) hands
    the jobs over as it would from any lost worker; the paused process's
    transaction can no longer commit.  For this transaction only.

    PostgreSQL: ``SET LOCAL idle_in_transaction_session_timeout``.  MariaDB:
    ``idle_transaction_timeout`` (whole seconds), a session variable, so the
    connection's next check-in sets it back (a handler's own transaction on
    it later may sit idle as long as it needs).  MySQL has no such bound:
    there the rows wait for the paused process."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            f"SET LOCAL idle_in_transaction_session_timeout = {max(1, int(seconds * 1000))}")
    elif getattr(conn.dialect, "is_mariadb", False):
        conn.exec_driver_sql(f"SET SESSION idle_transaction_timeout = {max(1, math.ceil(seconds))}")
        conn.connection.info[_IDLE_BOUND] = True
        if not event.contains(conn.engine.pool, "checkin", _unbound_on_checkin):
            event.listen(conn.engine.pool, "checkin", _unbound_on_checkin)


_IDLE_BOUND = "duebox_idle_bound"


def _unbound_on_checkin(dbapi_conn: Any, record: Any) -> None:
    """MariaDB: a connection that had an idle-transaction bound back in the
    pool without it (bound_idle_transaction)."""
    if dbapi_conn is None or not record.info.pop(_IDLE_BOUND, False):
        return
    try:
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute("SET SESSION idle_transaction_timeout = 0")
        finally:
            cursor.close()
    except Exception:  # a connection that went away: the pool discards it anyway
        record.invalidate()
