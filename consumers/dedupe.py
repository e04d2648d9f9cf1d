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

When an :class:`SQLDedupeStore`'s engine is the job table's database, the
decorator also **completes the job** (docs/own-consumers.md): in the same
transaction as the dedupe row and the handler's writes, the job becomes
``SUCCEEDED``, fenced on the message's id, version and task
(core/own_queues.py).  A copy the job has moved on from (another version, a
cancelled or finished job, a forged task) is answered :data:`DUPLICATE`
without running the handler and leaves no dedupe row; a message handed over
before its due time raises :class:`NotDueError` and leaves nothing either.
"""

from __future__ import annotations

import functools
import inspect
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import String, bindparam, delete, func, literal, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.dialects import postgresql

from duebox import jobstore
from duebox.clock import utcnow
from duebox.db import create_async_engine_for, insert_if_absent
from duebox.errors import MessageDecodeError, NotDueError
from duebox.message import HEADER_ID, HEADER_TASK, HEADER_VERSION
from duebox.own_queues import Completion, Outcome, complete_steps
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


def _answer(undo: _Undo, now: datetime) -> Any:
    """What the handler's caller gets for a message that did not run."""
    if undo.outcome.completion is Completion.NOT_DUE and undo.outcome.due_at is not None:
        due = undo.outcome.due_at
        raise NotDueError(undo.job_id, due.isoformat(), (due - now).total_seconds())
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

    def run(self, message_id: str, fn: Callable[..., Any], args: Any, kwargs: Any,
            ref: JobRef | None = None) -> Any:
        from sqlalchemy.orm import Session

        now = utcnow()
        try:
            with Session(self._need_engine()) as session, session.begin():
                dialect = session.get_bind().dialect.name
                first: Any = session.execute(self.claim_stmt(dialect, message_id, now))
                if first.rowcount != 1:
                    return DUPLICATE
                if ref is not None and self._completes(session.connection()):
                    self._checked(drive_sync(session, complete_steps(*ref, now)), message_id)
                return fn(*args, session=session, **kwargs)
        except _Undo as undo:
            return _answer(undo, now)

    async def arun(self, message_id: str, fn: Callable[..., Any], args: Any, kwargs: Any,
                   ref: JobRef | None = None) -> Any:
        from sqlalchemy.ext.asyncio import AsyncSession

        from duebox.producer import drive

        if self._async_engine is None:
            self._async_engine = create_async_engine_for(self._need_engine().url)
        now = utcnow()
        try:
            async with AsyncSession(self._async_engine) as session, session.begin():
                dialect = session.get_bind().dialect.name
                first: Any = await session.execute(self.claim_stmt(dialect, message_id, now))
                if first.rowcount != 1:
                    return DUPLICATE
                if ref is not None and self.complete is None:
                    conn = await session.connection()
                    await conn.run_sync(self._completes)
                if ref is not None and self.complete:
                    pending = drive(session, complete_steps(*ref, now))
                    assert not isinstance(pending, Outcome)  # an AsyncSession: a coroutine
                    self._checked(await pending, message_id)
                return await fn(*args, session=session, **kwargs)
        except _Undo as undo:
            return _answer(undo, now)

    async def aclose(self) -> None:
        if self._async_engine is not None:
            await self._async_engine.dispose()
            self._async_engine = None


# What a message says about its job: id, version and task (None where the
# message names none).
JobRef = tuple[uuid.UUID, int, "str | None"]


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

    def run(self, message_id: str, fn: Callable[..., Any], args: Any, kwargs: Any,
            ref: JobRef | None = None) -> Any:
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

    async def arun(self, message_id: str, fn: Callable[..., Any], args: Any, kwargs: Any,
                   ref: JobRef | None = None) -> Any:
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
    handler; a message with no outbox id raises :class:`MessageDecodeError`.
    With an :class:`SQLDedupeStore` on the job table's database it also
    completes the job (see the module notes)."""

    def wrap(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                found = (*args, *kwargs.values())
                message_id = outbox_id_of(*found)
                return await store.arun(message_id, fn, args, kwargs, _ref(message_id, found))

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            found = (*args, *kwargs.values())
            message_id = outbox_id_of(*found)
            return store.run(message_id, fn, args, kwargs, _ref(message_id, found))

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
        found = _field_in(candidate, 0, HEADER_ID, "id")
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


def _ref(message_id: str, candidates: Sequence[Any]) -> JobRef | None:
    """The job a message names, to complete it: its id, version and task.
    None when the id is not a job id or the message carries no version (a
    message from elsewhere: nothing to complete)."""
    try:
        job_id = uuid.UUID(message_id)
    except ValueError:
        return None
    version = task = None
    for candidate in candidates:
        version = version or _field_in(candidate, 0, HEADER_VERSION, "version")
        task = task or _field_in(candidate, 0, HEADER_TASK, "task")
    if version is None or not version.isdigit() or not 0 < int(version) < 2**31:
        return None
    return job_id, int(version), task


def _from_body(body: Any, key: str = "id") -> str | None:
    text = _text(body)
    if not text or not text.lstrip().startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, dict) and str(data.get("format", "")).startswith("duebox/"):
        value = data.get(key)
        return str(value) if isinstance(value, int) and not isinstance(value, bool) \
            else _text(value)
    return None


def _field_in(obj: Any, depth: int, header: str, key: str) -> str | None:
    """The ``header`` (``duebox-id`` ...) of a driver's message, else the
    body's ``key`` (``id`` ...)."""
    if depth > 3 or obj is None:
        return None
    if isinstance(obj, bytes | str):
        return _from_body(obj, key)
    if isinstance(obj, Mapping):
        return _field_in_mapping(obj, depth, header, key)
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], Mapping):
        return _field_in_mapping(obj[1], depth, header, key)  # a Redis stream entry
    headers = getattr(obj, "headers", None)
    if headers is not None:  # pika BasicProperties, aiokafka ConsumerRecord
        if isinstance(headers, Mapping):
            found = _text(headers.get(header))
        else:
            found = next((_text(v) for k, v in headers if _text(k) == header), None)
        if found:
            return found
    for attr in ("value", "body"):
        found = _field_in(getattr(obj, attr, None), depth + 1, header, key)
        if found:
            return found
    return None


def _field_in_mapping(m: Mapping[Any, Any], depth: int, header: str, key: str) -> str | None:
    for name in (header, header.encode()):
        found = _text(m.get(name))
        if found:
            return found
    attrs = m.get("MessageAttributes")  # SQS
    if isinstance(attrs, Mapping) and isinstance(attrs.get(header), Mapping):
        found = _text(attrs[header].get("StringValue"))
        if found:
            return found
    for name in ("headers", "Body", "body", b"body", "value"):
        if name in m:
            found = _field_in(m[name], depth + 1, header, key)
            if found:
                return found
    if str(m.get("format", "")).startswith("duebox/"):
        value = m.get(key)
        return str(value) if isinstance(value, int) and not isinstance(value, bool) \
            else _text(value)
    return None
