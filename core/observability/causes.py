"""What an exception says about the process's surroundings: the database or
a broker out of reach (it comes back by itself), or refusing the connection
for good (a wrong login, an unknown vhost, database or role: a configuration
error).  duebox.observability.trouble collapses the lines of one cause across every logger,
and lets a refusal end the relay or the worker after a short grace.

Drivers are recognised without importing them (this is core's floor): a
SQLAlchemy error by its ``orig``, psycopg's by its ``sqlstate`` and words,
PyMySQL's by its error number, the brokers' by duebox's own classes
(:class:`~duebox.errors.BrokerUnreachableError`,
:class:`~duebox.errors.BrokerRefusedError`, raised where each backend
connects).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import BrokerRefusedError, BrokerUnreachableError


@dataclass(frozen=True)
class Cause:
    """One cause of trouble: ``key`` is what its lines are counted under
    (one line per key per interval), ``text`` the line's one-line words."""

    key: str
    text: str
    permanent: bool = False  # a refusal: retried only for a short grace


# libpq puts no SQLSTATE on a refused connection; its words say which.
_PG_REFUSED = re.compile(r"FATAL:\s+(password authentication failed|(?:database|role) \"[^\"]*\" "
                         r"does not exist|no pg_hba\.conf entry|.*not permitted to log in)")
_PG_REFUSED_STATES = frozenset({"28000", "28P01", "3D000"})
# Connection exceptions (class 08) and a server shutting down or starting up.
_PG_GONE_STATES = ("08", "57P01", "57P02", "57P03")
_PG_AT = re.compile(r'connection to server at "([^"]*)"(?:\s*\([^)]*\))?, port (\d+)')
# MySQL/MariaDB: access denied for the user or to the database, unknown
# database; cannot connect, server gone away, connection lost.
_MYSQL_REFUSED = frozenset({1044, 1045, 1049})
_MYSQL_GONE = frozenset({2002, 2003, 2005, 2006, 2013, 2055})


def cause_of(exc: BaseException) -> Cause | None:
    """The cause behind ``exc`` (or an exception it was raised from), or None
    when it is not about reaching the database or a broker."""
    for e in _chain(exc):
        if isinstance(e, BrokerRefusedError):
            return Cause(f"refused: {e.where}", f"{e.where} refused the connection: {e.detail}",
                         permanent=True)
        if isinstance(e, BrokerUnreachableError):
            return Cause(f"unreachable: {e.where}", f"{e.where} unreachable: {e.detail}")
        cause = _database(getattr(e, "orig", None) or e,
                          bool(getattr(e, "connection_invalidated", False)))
        if cause is not None:
            return cause
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it was raised from or while handling, a few deep."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(seen) < 8:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _database(orig: BaseException, invalidated: bool) -> Cause | None:
    name = type(orig).__name__
    module = type(orig).__module__.split(".")[0]
    if module in ("psycopg", "psycopg2"):
        return _postgres(orig, invalidated)
    if module in ("pymysql", "MySQLdb", "asyncmy", "aiomysql"):
        code = orig.args[0] if orig.args and isinstance(orig.args[0], int) else None
        words = str(orig.args[1]) if len(orig.args) > 1 else str(orig)
        if code in _MYSQL_REFUSED:
            return _refused(words)
        if code in _MYSQL_GONE or invalidated:
            return _unreachable(words, "")
        return None
    if invalidated and name != "IntegrityError":
        return _unreachable(_first_line(str(orig)), "")
    return None


def _postgres(orig: BaseException, invalidated: bool) -> Cause | None:
    text = str(orig)
    state = getattr(orig, "sqlstate", None)
    refused = _PG_REFUSED.search(text)
    if state in _PG_REFUSED_STATES or (state is None and refused):
        return _refused(refused.group(0).removeprefix("FATAL:").strip() if refused
                        else _first_line(text))
    kinds = {c.__name__ for c in type(orig).__mro__}
    if not kinds & {"OperationalError", "InterfaceError"} and not invalidated:
        return None
    if state is None or state.startswith(_PG_GONE_STATES) or invalidated:
        # "connection failed: connection to server at ... failed: <why>"
        at = _PG_AT.search(text)
        why = _first_line(text.rsplit("failed: ", 1)[-1])
        return _unreachable(" ".join(why.removeprefix("FATAL:").split()),
                            f" at {at.group(1)}:{at.group(2)}" if at else "")
    return None  # a deadlock, a lock timeout, a serialization failure: the statement's


def _unreachable(why: str, at: str) -> Cause:
    return Cause("database unreachable", f"database unreachable{at}: {why}")


def _refused(why: str) -> Cause:
    return Cause("database refused", f"the database refused the connection: {why}; check the "
                                     "database URL's user, password and database name",
                 permanent=True)


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0].strip() if lines else text


__all__ = ["Cause", "cause_of"]
