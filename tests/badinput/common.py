"""What every bad-input test needs: a well-formed message body to spoil,
and the check that a rejected call wrote nothing."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MYSQL_ADMIN_URL, PG_ADMIN_URL, service_missing
from helpers import duebox_row_counts
from sqlalchemy import Engine

from duebox import JobMessage, MessageDecodeError

# For checks that refuse before any SQL is sent, where a second database
# would only add minutes: the tests that do write run on PostgreSQL too.
SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

GOOD: dict[str, Any] = {
    "format": "duebox/1", "id": str(uuid.uuid4()), "task": "effect", "queue": "default",
    "version": 1, "attempt": 0, "due_at": "2030-01-01T09:00:00+00:00", "payload": None,
    "headers": {},
}


def body(**changes: Any) -> bytes:
    """GOOD with ``changes``; a value of ``...`` leaves the field out."""
    data = {**GOOD, **changes}
    return json.dumps({k: v for k, v in data.items() if v is not ...}).encode()


def nothing_written(engine: Engine) -> None:
    counts = duebox_row_counts(engine)
    assert set(counts.values()) == {0}, counts


def snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every duebox table, to compare before and after a refusal."""
    import duebox

    with engine.connect() as conn:
        return {t.name: sorted(tuple(map(repr, r)) for r in conn.execute(t.select()))
                for t in duebox.metadata.sorted_tables}


@contextlib.contextmanager
def _created(admin_url: str, service: str, name: str, drop: str, *,
             before: Sequence[str] = (), after: Sequence[str] = ()) -> Iterator[str]:
    """Database ``name`` (quoted as its server quotes) created on the server
    of ``admin_url``, then the statements ``before``; at the end ``drop``
    (which drops it), then ``after``.  Yields its URL; a server that cannot
    be reached is :func:`service_missing`."""
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        service_missing(service, exc)
    try:
        with admin.connect() as conn:
            for statement in before:
                conn.execute(sa.text(statement))
        yield sa.make_url(admin_url).set(database=name.strip('"`')).render_as_string(
            hide_password=False)
    finally:
        with admin.connect() as conn:
            for statement in (drop, *after):
                conn.execute(sa.text(statement))
        admin.dispose()


@contextlib.contextmanager
def scratch_database(prefix: str, roles: Sequence[str] = ()) -> Iterator[str]:
    """A PostgreSQL database of the caller's own and ``roles`` that may log
    in (and nothing else yet), all dropped at the end.  Yields its URL."""
    db = f'"{prefix}_{uuid.uuid4().hex[:8]}"'
    with _created(PG_ADMIN_URL, "PostgreSQL", db, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)",
                  before=[f'CREATE ROLE "{role}" LOGIN' for role in roles],
                  after=[f'DROP ROLE IF EXISTS "{role}"' for role in roles]) as url:
        yield url


@contextlib.contextmanager
def scratch_mariadb(prefix: str) -> Iterator[str]:
    """A MariaDB database of the caller's own, dropped at the end.  Yields its URL."""
    db = f"`{prefix}_{uuid.uuid4().hex[:8]}`"
    with _created(MYSQL_ADMIN_URL, "MariaDB", db, f"DROP DATABASE IF EXISTS {db}") as url:
        yield url


def decode_or_field(raw: bytes) -> JobMessage | str:
    """The message, or the name of the field decode refused."""
    try:
        return JobMessage.decode(raw)
    except MessageDecodeError as exc:
        return exc.field
