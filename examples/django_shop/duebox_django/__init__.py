"""duebox in a Django project: schedule on Django's own connection, inside
``transaction.atomic()``, and run the relay and worker as management commands.

Copy this folder into your project and add ``"duebox_django"`` to
``INSTALLED_APPS``.  Then::

    with transaction.atomic():
        order = Order.objects.create(...)
        with duebox_django.connection() as conn:
            jobs.schedule(conn, "send-confirmation", {"order_id": order.id})

commits the job with the order, or neither; and::

    python manage.py duebox db upgrade   # duebox's tables, in Django's database
    python manage.py duebox relay
    python manage.py duebox worker

run duebox's command line with your settings (``DUEBOX_APP``, the app to load).

How: ``connection()`` is a SQLAlchemy ``Connection`` whose DB-API connection
is Django's (PostgreSQL on psycopg 3), through a dialect whose commit,
rollback and close do nothing: SQLAlchemy runs statements on it and never
ends it, so Django's ``atomic()`` alone commits or rolls back, and Django
closes the connection when it does.  The relay and the worker use ordinary connections of their own
(``database_url()``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.db import connections
from sqlalchemy import URL, Connection, Engine, create_engine
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.pool import NullPool

_engines: dict[str, Engine] = {}


def database_url(using: str = "default") -> str:
    """Django's database ``using`` as a SQLAlchemy URL (for duebox's own engines)."""
    return _url(using).render_as_string(hide_password=False)


def _url(using: str) -> URL:
    db = settings.DATABASES[using]
    if db["ENGINE"] != "django.db.backends.postgresql":
        raise ValueError(f"duebox_django: DATABASES[{using!r}] must be PostgreSQL "
                         f"(django.db.backends.postgresql), not {db['ENGINE']}")
    return URL.create("postgresql+psycopg", username=db.get("USER") or None,
                      password=db.get("PASSWORD") or None, host=db.get("HOST") or None,
                      port=int(db["PORT"]) if db.get("PORT") else None, database=db["NAME"])


class BorrowedPostgreSQL(PGDialect_psycopg):
    """PostgreSQL on psycopg 3, on a connection Django owns: SQLAlchemy runs
    statements on it but never commits, rolls back or closes it (the pool and
    ``Connection.close()`` end in these three methods), nor sets it up."""

    supports_statement_cache = True  # compiles exactly as its parent does

    def on_connect(self) -> None:
        return None  # Django has set the connection up

    def do_commit(self, dbapi_connection: Any) -> None:
        pass

    def do_rollback(self, dbapi_connection: Any) -> None:
        pass

    def do_close(self, dbapi_connection: Any) -> None:
        pass


registry.register("postgresql.duebox_django", __name__, "BorrowedPostgreSQL")


def _engine(using: str) -> Engine:
    if using not in _engines:
        def borrow() -> Any:
            return connections[using].connection  # this thread's connection

        _engines[using] = create_engine("postgresql+duebox_django://", creator=borrow,
                                        poolclass=NullPool, pool_reset_on_return=None)
    return _engines[using]


@contextlib.contextmanager
def connection(using: str = "default") -> Iterator[Connection]:
    """A SQLAlchemy ``Connection`` on Django's connection ``using``, inside its
    current ``transaction.atomic()`` block (required: outside one, Django
    commits every statement on its own)."""
    django_connection = connections[using]
    if not django_connection.in_atomic_block:
        raise RuntimeError("duebox_django.connection(): call it inside transaction.atomic(), "
                           "so the job commits with your writes or not at all")
    django_connection.ensure_connection()
    with _engine(using).connect() as conn:
        yield conn
