"""Deduplication on the outbox id, for duebox's worker and for your own loop.

Stores:

- :class:`SQLDedupeStore` inserts ``(consumer, message_id)`` into
  ``duebox_processed`` **inside the handler's own transaction**: the handler's
  writes and the row commit together or not at all, so a redelivery after a
  crash either finds the row (and skips) or finds nothing (and the effect
  never happened).  Local database effects happen once per job id.
- :class:`RedisDedupeStore` uses ``SET NX`` with a TTL.  Weaker, and said so:
  the mark and the handler's effects are not one transaction.  A key is set
  to ``processing`` (short TTL) before the handler and to ``done`` (long TTL)
  after it; a handler that raises deletes it.  A crash *after* the effect but
  *before* ``done`` lets a redelivery run the handler again once the
  processing TTL lapses, and a key evicted or expired before a late
  redelivery does the same.  Use it for effects that are idempotent anyway
  or outside any database you control.

``@duebox.dedupe(store)`` wraps a handler you call from your own pika, boto3,
aiokafka or redis-py loop with that driver's native message; see
:func:`outbox_id_of` for what it recognises.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import bindparam, delete, func, select

from duebox import jobstore
from duebox.clock import utcnow
from duebox.db import create_async_engine_for, insert_if_absent
from duebox.errors import MessageDecodeError
from duebox.message import HEADER_ID
from duebox.tables import processed

F = TypeVar("F", bound=Callable[..., Any])


class _Duplicate:
    """Returned instead of the handler's result when the message was seen."""

    def __repr__(self) -> str:
        return "DUPLICATE"

    def __bool__(self) -> bool:
        return False


DUPLICATE: Any = _Duplicate()


class SQLDedupeStore:
    """Seen-set in ``duebox_processed``, sharing the handler's transaction.

    Inside duebox's worker no engine is needed.  For your own loop pass the
    engine of the database your handler writes to; the handler then receives
    the open transaction as ``session=`` (a ``Session``, or an
    ``AsyncSession`` for ``async def`` handlers) and must not commit it.
    """

    def __init__(self, engine: Any = None, consumer: str = "duebox") -> None:
        self.engine = engine
        self.consumer = consumer
        self._async_engine: Any = None
        self._bound: dict[str, Any] = {}

    def claim_bound(self, dialect: str, message_id: str, now: Any) -> tuple[Any, dict[str, Any]]:
        """:meth:`claim_stmt` built once per dialect with bound parameters (the
        worker's hot path: building it per message cost more than running it)."""
        stmt = self._bound.get(dialect)
        if stmt is None:
            stmt = self._bound[dialect] = insert_if_absent(
                processed,
                {"consumer": self.consumer,
                 "message_id": bindparam("d_message_id", type_=processed.c.message_id.type),
                 "processed_at": bindparam("d_now", type_=processed.c.processed_at.type)},
                dialect,
                ["consumer", "message_id"],
            )
        return stmt, {"d_message_id": message_id, "d_now": now}

    def claim_and_complete(self, rec: Any, now: Any) -> tuple[Any, dict[str, Any]]:
        """PostgreSQL: the dedupe row, the fenced completion and the attempt's
        outcome in one statement (:func:`duebox.jobstore.complete_after_claim`),
        built once; its row is ``(claimed, completed, closed)``."""
        stmt = self._bound.get("postgresql+complete")
        if stmt is None:
            claim, _ = self.claim_bound("postgresql", "", now)
            stmt = self._bound["postgresql+complete"] = jobstore.complete_after_claim(claim)
        _, complete = jobstore.complete_bound(rec, now)
        _, close = jobstore.finish_attempt_bound(rec, now, "succeeded")
        return stmt, {"d_message_id": str(rec.id), "d_now": now, **complete, **close}

    def claim_many(self, conn: Any, message_ids: Sequence[str], now: Any) -> set[str]:
        """Insert-if-absent several ids in ``conn``'s transaction (one
        statement where the dialect returns what it inserted); the ids
        inserted now, i.e. not seen before."""
        dialect = conn.dialect.name
        stmt, _ = self.claim_bound(dialect, "", now)
        if dialect in ("postgresql", "sqlite"):
            rows = [{"d_message_id": m, "d_now": now} for m in message_ids]
            return set(conn.execute(stmt.returning(processed.c.message_id), rows).scalars())
        return {m for m in message_ids
                if conn.execute(stmt, {"d_message_id": m, "d_now": now}).rowcount == 1}

    def still_claimed(self, conn: Any, message_ids: Sequence[str]) -> bool:
        """MySQL/MariaDB: whether ``conn``'s transaction still has the seen-rows
        it inserted for ``message_ids`` (:meth:`claim_many`).  A deadlock
        rolls an InnoDB transaction back whole and the connection's next
        statement silently begins a new one; this tells.  Elsewhere a
        transaction the server rolled back refuses every further statement:
        True without a query."""
        if conn.dialect.name not in ("mysql", "mariadb") or not message_ids:
            return True
        found = conn.execute(
            select(func.count()).select_from(processed)
            .where(processed.c.consumer == self.consumer,
                   processed.c.message_id.in_(list(message_ids)))).scalar_one()
        return int(found) == len(message_ids)

    def forget_many(self, conn: Any, message_ids: Sequence[str]) -> None:
        """Drop seen-rows this transaction inserted for messages whose handler
        did not complete (failed, or given back unrun)."""
        if message_ids:
            conn.execute(delete(processed).where(processed.c.consumer == self.consumer,
                                                 processed.c.message_id.in_(list(message_ids))))

    def claim_stmt(self, dialect: str, message_id: str, now: Any) -> Any:
        """An insert-if-absent whose row count is 1 the first time only."""
        return insert_if_absent(
            processed,
            {"consumer": self.consumer, "message_id": message_id, "processed_at": now},
            dialect,
            ["consumer", "message_id"],
        )

    def _need_engine(self) -> Any:
        if self.engine is None:
            raise TypeError("SQLDedupeStore(engine=...) is required outside duebox's worker")
        return self.engine

    def run(self, message_id: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        from sqlalchemy.orm import Session

        with Session(self._need_engine()) as session, session.begin():
            dialect = session.get_bind().dialect.name
            first: Any = session.execute(self.claim_stmt(dialect, message_id, utcnow()))
            if first.rowcount != 1:
                return DUPLICATE
            return fn(*args, session=session, **kwargs)

    async def arun(self, message_id: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        from sqlalchemy.ext.asyncio import AsyncSession

        if self._async_engine is None:
            self._async_engine = create_async_engine_for(self._need_engine().url)
        async with AsyncSession(self._async_engine) as session, session.begin():
            dialect = session.get_bind().dialect.name
            first: Any = await session.execute(self.claim_stmt(dialect, message_id, utcnow()))
            if first.rowcount != 1:
                return DUPLICATE
            return await fn(*args, session=session, **kwargs)

    async def aclose(self) -> None:
        if self._async_engine is not None:
            await self._async_engine.dispose()
            self._async_engine = None


class RedisDedupeStore:
    """``SET NX`` seen-set in Redis (see the module notes for its weaker guarantee).

    ``client`` is a ``redis.Redis`` for sync handlers or a
    ``redis.asyncio.Redis`` for async ones.
    """

    def __init__(self, client: Any, consumer: str = "duebox", ttl: float = 7 * 86400,
                 processing_ttl: float = 300, prefix: str = "duebox:seen:") -> None:
        self.client = client
        self.consumer = consumer
        self.ttl = int(ttl)
        self.processing_ttl = int(processing_ttl)
        self.prefix = prefix

    def _key(self, message_id: str) -> str:
        return f"{self.prefix}{self.consumer}:{message_id}"

    def run(self, message_id: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        key = self._key(message_id)
        if not self.client.set(key, "processing", nx=True, ex=self.processing_ttl):
            return DUPLICATE
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            self.client.delete(key)
            raise
        self.client.set(key, "done", ex=self.ttl)
        return result

    async def arun(self, message_id: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        key = self._key(message_id)
        if not await self.client.set(key, "processing", nx=True, ex=self.processing_ttl):
            return DUPLICATE
        try:
            result = await fn(*args, **kwargs)
        except BaseException:
            await self.client.delete(key)
            raise
        await self.client.set(key, "done", ex=self.ttl)
        return result


def dedupe(store: SQLDedupeStore | RedisDedupeStore) -> Callable[[F], F]:
    """Skip messages whose outbox id ``store`` has seen; works for sync and
    async handlers.  A duplicate returns :data:`DUPLICATE` without calling the
    handler; a message with no outbox id raises :class:`MessageDecodeError`."""

    def wrap(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                return await store.arun(outbox_id_of(*args, *kwargs.values()), fn, args, kwargs)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return store.run(outbox_id_of(*args, *kwargs.values()), fn, args, kwargs)

        return wrapper  # type: ignore[return-value]

    return wrap


def outbox_id_of(*candidates: Any) -> str:
    """Find the outbox id in whatever a driver handed over.

    Recognised, in each argument: pika ``BasicProperties`` (``.headers``) and
    the body bytes; an SQS message dict (``MessageAttributes``, ``Body``); an
    aiokafka ``ConsumerRecord`` (``.headers`` pairs, ``.value``); a Redis
    stream entry ``(entry_id, fields)`` or its fields; a plain mapping with
    ``duebox-id``, a ``headers`` mapping, or a duebox message body.
    """
    for candidate in candidates:
        found = _id_in(candidate, depth=0)
        if found:
            return found
    raise MessageDecodeError(
        "duebox-id", "the message carries no outbox id (not a duebox message?)",
        candidates[0] if len(candidates) == 1 else candidates,
    )


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def _from_body(body: Any) -> str | None:
    text = _text(body)
    if not text or not text.lstrip().startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, dict) and str(data.get("format", "")).startswith("duebox/"):
        return _text(data.get("id"))
    return None


def _id_in(obj: Any, depth: int) -> str | None:
    if depth > 3 or obj is None:
        return None
    if isinstance(obj, bytes | str):
        return _from_body(obj)
    if isinstance(obj, Mapping):
        return _id_in_mapping(obj, depth)
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], Mapping):
        return _id_in_mapping(obj[1], depth)  # a Redis stream entry
    headers = getattr(obj, "headers", None)
    if headers is not None:  # pika BasicProperties, aiokafka ConsumerRecord
        if isinstance(headers, Mapping):
            found = _text(headers.get(HEADER_ID))
        else:
            found = next((_text(v) for k, v in headers if _text(k) == HEADER_ID), None)
        if found:
            return found
    for attr in ("value", "body"):
        found = _id_in(getattr(obj, attr, None), depth + 1)
        if found:
            return found
    return None


def _id_in_mapping(m: Mapping[Any, Any], depth: int) -> str | None:
    for key in (HEADER_ID, HEADER_ID.encode()):
        found = _text(m.get(key))
        if found:
            return found
    attrs = m.get("MessageAttributes")  # SQS
    if isinstance(attrs, Mapping) and isinstance(attrs.get(HEADER_ID), Mapping):
        found = _text(attrs[HEADER_ID].get("StringValue"))
        if found:
            return found
    for key in ("headers", "Body", "body", b"body", "value"):
        if key in m:
            found = _id_in(m[key], depth + 1)
            if found:
                return found
    if str(m.get("format", "")).startswith("duebox/"):
        return _text(m.get("id"))
    return None
