"""The consumer loops of docs/own-consumers.md, taken from the page and run
as written: by tests/test_own_consumer_loops.py in threads and tasks, and by
tests/procs/own_loop.py as a process of its own.

A loop needs what the page says it needs: ``app``, ``send_email(payload,
session)`` (``send_email_async`` for aiokafka) and the driver's client or
address.  The user's handler here records each e-mail it sends, with the
time on the database server's clock (the clock the due time is kept on),
and ends the loop on :data:`STOP`: the loops run until told otherwise, as
the page's do, so a test stops one with a message whose handler raises
:class:`StopLoop` (a ``BaseException``: no loop catches it).
"""

from __future__ import annotations

import ast
import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import duebox
from duebox.clock import as_utc, server_now_sql
from duebox.message import JobMessage

DOC = Path(__file__).resolve().parents[1] / "docs" / "own-consumers.md"
QUEUE = "emails"  # the page's queue; a test's own prefix keeps the broker's name its own
STOP = {"stop": True}

metadata = sa.MetaData()
sent = sa.Table("own_loop_sent", metadata,
                sa.Column("n", sa.Integer, primary_key=True, autoincrement=True),
                sa.Column("to", sa.String(200), nullable=False),
                sa.Column("sent_at_us", sa.BigInteger, nullable=False))


class StopLoop(BaseException):
    """Raised by the handler for the :data:`STOP` message: ends the loop."""


def doc_loop(heading: str) -> str:
    """The Python block under ``### heading`` in docs/own-consumers.md."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split(f"\n### {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


def compiled(heading: str) -> Any:
    """The loop's code, compiled; top-level ``await`` allowed (aiokafka's),
    where ``eval`` then returns a coroutine."""
    return compile(doc_loop(heading), f"<docs/own-consumers.md: {heading}>", "exec",
                   flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def _us(t: datetime) -> int:
    return int(t.timestamp() * 1_000_000)


def _server_now(dialect: str, read: Any) -> datetime:
    sql = server_now_sql(dialect)
    return datetime.now(UTC) if sql is None else as_utc(read(sql))


def send_email(payload: Any, session: Any) -> None:
    """The user's handler, as the page's loops call it."""
    if payload == STOP:
        raise StopLoop
    now = _server_now(session.get_bind().dialect.name,
                      lambda sql: session.execute(sql).scalar_one())
    session.execute(sent.insert().values(to=payload["to"], sent_at_us=_us(now)))


async def send_email_async(payload: Any, session: Any) -> None:
    """:func:`send_email` for an ``AsyncSession``."""
    if payload == STOP:
        raise StopLoop
    sql = server_now_sql(session.get_bind().dialect.name)
    now = datetime.now(UTC) if sql is None else as_utc(
        (await session.execute(sql)).scalar_one())
    await session.execute(sent.insert().values(to=payload["to"], sent_at_us=_us(now)))


def namespace(app: duebox.Duebox, **driver: Any) -> dict[str, Any]:
    """What a loop of the page runs with."""
    return {"__name__": "own_loop", "app": app, "send_email": send_email,
            "send_email_async": send_email_async, **driver}


def stop_message() -> JobMessage:
    """The message that ends a loop: a job of no database's, whose handler
    therefore runs (and raises :class:`StopLoop`)."""
    return JobMessage(uuid.uuid4(), "send_email", QUEUE, 1, 0, datetime.now(UTC), STOP)


def sent_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(sent).order_by(sent.c.n)))


@contextmanager
def refusals() -> Iterator[list[duebox.MessageDecodeError]]:
    """The :class:`duebox.MessageDecodeError` each loop logs on ``mailer``'s
    logger as it acks or dead-letters a message that is not duebox's."""
    found: list[duebox.MessageDecodeError] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found.extend(a for a in (record.args or ())
                         if isinstance(a, duebox.MessageDecodeError))

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("mailer")
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
