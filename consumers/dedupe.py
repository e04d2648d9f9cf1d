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
:func:`message_ref_of` for what it recognises.  Before anything else it checks
the message as duebox's worker does (core/message.py: the body's size and
depth, then its id, version and task, and the ``duebox-*`` headers against
it): anyone who can write to the queue can send anything, and what is not a
duebox message raises :class:`MessageDecodeError`, the one error a loop
acks or dead-letters and goes on after (docs/own-consumers.md).

When an :class:`SQLDedupeStore`'s engine is the job table's database, the
decorator also **completes the job** (docs/own-consumers.md): in the same
transaction as the dedupe row and the handler's writes, the job becomes
``SUCCEEDED``, fenced on the message's id, version and task
(core/leases/own_queues.py).  A copy the job has moved on from (another version, a
cancelled or finished job, a forged task, no version or task at all) is
answered :data:`DUPLICATE` without running the handler and leaves no dedupe
row; a message handed over before its due time on the database server's
clock raises :class:`NotDueError` and leaves nothing either.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import String, bindparam, delete, func, literal, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.dialects import postgresql

from duebox.clock import utcnow
from duebox.db import create_async_engine_for, insert_if_absent
from duebox.errors import NotDueError
from duebox.leases import jobstore
from duebox.leases.own_queues import Completion, Outcome, complete_steps
from duebox.message import HEADER_ID, HEADER_TASK, HEADER_VERSION, MessageRef
from duebox.producer import drive_sync
from duebox.tables import job, processed

F = TypeVar("F", bound=Callable[..., Any])


class _Duplicate:
    """Returned instead of the handler's result when the message was seen."""

    def __repr__(self) -> str:
        return "DUPLICATE"

    def __bool__(self) -> bool:
        return False


DUPLICATE: Any = _Duplicate()


class _Undo(Exception):
    """Rolls back the dedupe row of a message that must not run (stale, early)."""

    def __init__(self, outcome: Outcome, job_id: str) -> None:
        super().__init__(outcome.completion)
        self.outcome = outcome
        self.job_id = job_id


def _answer(undo: _Undo) -> Any:
    """What the handler's caller gets for a message that did not run."""
    outcome = undo.outcome
    if (outcome.completion is Completion.NOT_DUE and outcome.due_at is not None
            and outcome.now is not None):
        due = outcome.due_at
        raise NotDueError(undo.job_id, due.isoformat(), (due - outcome.now).total_seconds())
    return DUPLICATE


class SQLDedupeStore:
    """Seen-set in ``duebox_processed``, sharing the handler's transaction.

    Inside duebox's worker no engine is needed.  For your own loop pass the
    engine of the database your handler writes to; the handler then receives
    the open transaction as ``session=`` (a ``Session``, or an
    ``AsyncSession`` for ``async def`` handlers) and must not commit it.

    ``complete``: whether the decorator completes the message's job in that
    transaction (see the module notes).  ``None`` (the default): when the
    engine's database has duebox's job table; ``False``: never.
    """

    def __init__(self, engine: Any = None, consumer: str = "duebox",
                 complete: bool | None = None) -> None:
        if complete is not None and not isinstance(complete, bool):
            raise TypeError(f"complete: must be True, False or None (got {complete!r})")
        self.engine = engine
        self.consumer = consumer
        self.complete = complete
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
        outcome in one statement (:func:`duebox.leases.jobstore.complete_after_claim`),
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
        if dialect == "postgresql":
            # The ids as one array: one statement text whatever their number.
            return set(conn.execute(self._claim_array(), {"d_ids": list(message_ids),
                                                          "d_now": now}).scalars())
        stmt, _ = self.claim_bound(dialect, "", now)
        if dialect == "sqlite":
            rows = [{"d_message_id": m, "d_now": now} for m in message_ids]
            return set(conn.execute(stmt.returning(processed.c.message_id), rows).scalars())
        return {m for m in message_ids
                if conn.execute(stmt, {"d_message_id": m, "d_now": now}).rowcount == 1}

    def _claim_array(self) -> Any:
        """PostgreSQL: :meth:`claim_many`'s insert-if-absent of an array of
        ids, returning those it inserted; built once."""
        stmt = self._bound.get("postgresql+array")
        if stmt is None:
            ids = func.unnest(bindparam("d_ids", type_=postgresql.ARRAY(String())))
            stmt = self._bound["postgresql+array"] = (
                postgresql.insert(processed)
                .from_select(["consumer", "message_id", "processed_at"],
                             select(literal(self.consumer, String()), ids,
                                    bindparam("d_now", type_=processed.c.processed_at.type)))
                .on_conflict_do_nothing(index_elements=["consumer", "message_id"])
                .returning(processed.c.message_id))
        return stmt

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

    def _completes(self, conn: Any) -> bool:
        """Whether to complete jobs: ``complete``, or (None) whether this
        database has the job table, looked up once."""
        if self.complete is None:
            self.complete = bool(sa_inspect(conn).has_table(job.name))
        return self.complete

    @staticmethod
    def _checked(outcome: Outcome, message_id: str) -> None:
        if outcome.completion in (Completion.MOVED_ON, Completion.NOT_DUE):
            raise _Undo(outcome, message_id)

    def run(self, ref: MessageRef, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        from sqlalchemy.orm import Session

        now, message_id = utcnow(), str(ref.job_id)
        try:
            with Session(self._need_engine()) as session, session.begin():
                dialect = session.get_bind().dialect.name
                first: Any = session.execute(self.claim_stmt(dialect, message_id, now))
                if first.rowcount != 1:
                    return DUPLICATE
                if self._completes(session.connection()):
                    self._checked(drive_sync(session, complete_steps(ref, dialect, now)),
                                  message_id)
                return fn(*args, session=session, **kwargs)
        except _Undo as undo:
            return _answer(undo)

    async def arun(self, ref: MessageRef, fn: Callable[..., Any], args: Any, kwargs: Any
                   ) -> Any:
        from sqlalchemy.ext.asyncio import AsyncSession

        from duebox.producer import drive

        if self._async_engine is None:
            self._async_engine = create_async_engine_for(self._need_engine().url)
        now, message_id = utcnow(), str(ref.job_id)
        try:
            async with AsyncSession(self._async_engine) as session, session.begin():
                dialect = session.get_bind().dialect.name
                first: Any = await session.execute(self.claim_stmt(dialect, message_id, now))
                if first.rowcount != 1:
                    return DUPLICATE
                if self.complete is None:
                    conn = await session.connection()
                    await conn.run_sync(self._completes)
                if self.complete:
                    pending = drive(session, complete_steps(ref, dialect, now))
                    assert not isinstance(pending, Outcome)  # an AsyncSession: a coroutine
                    self._checked(await pending, message_id)
                return await fn(*args, session=session, **kwargs)
        except _Undo as undo:
            return _answer(undo)

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

    def run(self, ref: MessageRef, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        key = self._key(str(ref.job_id))
        if not self.client.set(key, "processing", nx=True, ex=self.processing_ttl):
            return DUPLICATE
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            self.client.delete(key)
            raise
        self.client.set(key, "done", ex=self.ttl)
        return result

    async def arun(self, ref: MessageRef, fn: Callable[..., Any], args: Any, kwargs: Any
                   ) -> Any:
        key = self._key(str(ref.job_id))
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
    handler; a message that is not a duebox message (no outbox id, a body
    that does not decode, headers that disagree with it) raises
    :class:`MessageDecodeError` and changes nothing.  With an
    :class:`SQLDedupeStore` on the job table's database it also completes the
    job (see the module notes)."""

    def wrap(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                ref = message_ref_of(*args, *kwargs.values())
                return await store.arun(ref, fn, args, kwargs)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return store.run(message_ref_of(*args, *kwargs.values()), fn, args, kwargs)

        return wrapper  # type: ignore[return-value]

    return wrap


def outbox_id_of(*candidates: Any) -> str:
    """The outbox id of the message in ``candidates`` (:func:`message_ref_of`)."""
    return str(message_ref_of(*candidates).job_id)


def message_ref_of(*candidates: Any) -> MessageRef:
    """What the message among whatever a driver handed over says about its
    job, checked as the worker checks a message (:meth:`MessageRef.of`).

    Recognised, in each argument: pika ``BasicProperties`` (``.headers``) and
    the body bytes; an SQS message dict (``MessageAttributes``, ``Body``); an
    aiokafka ``ConsumerRecord`` (``.headers`` pairs, ``.value``); a Redis
    stream entry ``(entry_id, fields)`` or its fields (``body``); a plain
    mapping with ``duebox-id`` (and ``duebox-version``, ``duebox-task``), a
    ``headers`` mapping, or a duebox message body.  The first body found is
    the message's; bytes or text among the arguments are a body.
    """
    found = _Found()
    for candidate in candidates:
        found.walk(candidate, 0)
    return MessageRef.of(found.headers, found.body)


_NAMES = (HEADER_ID, HEADER_VERSION, HEADER_TASK)
# Where a driver's message keeps its body: an SQS dict, aiokafka's record, a
# Redis entry's fields, a mapping of your own.
_BODY_KEYS = ("Body", "body", b"body", "value")


class _Found:
    """The ``duebox-*`` headers and the body gathered from a driver's message."""

    def __init__(self) -> None:
        self.headers: dict[str, object] = {}
        self.body: bytes | str | Mapping[str, Any] | None = None

    def header(self, name: str, value: object) -> None:
        if value is not None:
            self.headers.setdefault(name, value)

    def walk(self, obj: Any, depth: int) -> None:
        if depth > 3 or obj is None:
            return
        if isinstance(obj, bytes | bytearray | memoryview | str):
            if self.body is None:
                self.body = obj if isinstance(obj, str) else bytes(obj)
        elif isinstance(obj, Mapping):
            self._mapping(obj, depth)
        elif isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], Mapping):
            self._mapping(obj[1], depth)  # a Redis stream entry
        else:
            headers = getattr(obj, "headers", None)  # pika BasicProperties, aiokafka record
            if isinstance(headers, Mapping):
                self._headers(headers)
            elif headers is not None:
                self._headers(_pairs(headers))
            for attr in ("value", "body"):
                self.walk(getattr(obj, attr, None), depth + 1)

    def _headers(self, m: Mapping[Any, Any]) -> None:
        for name in _NAMES:
            self.header(name, m.get(name, m.get(name.encode())))

    def _mapping(self, m: Mapping[Any, Any], depth: int) -> None:
        self._headers(m)
        attrs = m.get("MessageAttributes")  # SQS
        if isinstance(attrs, Mapping):
            for name in _NAMES:
                attr = attrs.get(name)
                if isinstance(attr, Mapping):
                    self.header(name, attr.get("StringValue", attr.get("BinaryValue")))
        if isinstance(m.get("format"), str) and m["format"].startswith("duebox/"):
            if self.body is None:  # an envelope parsed already (its headers are the job's)
                self.body = m
            return
        headers = m.get("headers")
        if isinstance(headers, Mapping):
            self._headers(headers)
        for key in _BODY_KEYS:
            if key in m:
                self.walk(m[key], depth + 1)


def _pairs(headers: Any) -> dict[str, object]:
    """Header pairs (aiokafka's ``[(name, bytes)]``) as a mapping: the first
    value of each name."""
    found: dict[str, object] = {}
    try:
        pairs = list(headers)
    except TypeError:
        return found
    for pair in pairs:
        if isinstance(pair, tuple) and len(pair) == 2:
            name: object = pair[0]
            value: object = pair[1]
            if isinstance(name, bytes):
                name = name.decode("utf-8", "replace")
            if isinstance(name, str):
                found.setdefault(name, value)
    return found
