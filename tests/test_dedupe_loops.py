"""``@duebox.dedupe(store)`` around a user's own consumer loop, with each
driver's native message shape."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pika
import pytest
import redis
import redis.asyncio
import sqlalchemy as sa
from aiokafka.structs import ConsumerRecord
from conftest import service_missing
from hostile import deep_json

import duebox
from duebox import DUPLICATE, MessageDecodeError, RedisDedupeStore, SQLDedupeStore
from duebox.message import JobMessage
from duebox.tables import processed

seen_metadata = sa.MetaData()
seen = sa.Table("loop_effects", seen_metadata, sa.Column("job_id", sa.String(64),
                                                             primary_key=True))


def _message() -> JobMessage:
    return JobMessage(job_id=uuid.uuid4(), task="t", queue="q", version=1, attempt=0,
                      due_at=datetime.now(UTC), payload={"n": 1})


def _shapes(msg: JobMessage) -> dict[str, tuple[Any, ...]]:
    return {**_native(msg.header_map(), msg.encode()),
            "pika-body-only": (None, None, pika.BasicProperties(), msg.encode()),
            "redis-entry": ((b"1-0", {b"body": msg.encode()}),),
            "mapping": ({"duebox-id": str(msg.job_id), "text": "hi"},)}


def _native(headers: dict[str, str], body: bytes) -> dict[str, tuple[Any, ...]]:
    """``headers`` and ``body`` as each driver hands them over."""
    return {
        "pika": (None, None, pika.BasicProperties(headers=headers), body),
        "sqs": ({"MessageId": "m-1", "ReceiptHandle": "r", "Body": body.decode(),
                 "MessageAttributes": {k: {"DataType": "String", "StringValue": v}
                                       for k, v in headers.items()}},),
        "kafka": (ConsumerRecord(topic="q", partition=0, offset=1, timestamp=0,
                                 timestamp_type=0, key=None, value=body, checksum=None,
                                 serialized_key_size=0, serialized_value_size=len(body),
                                 headers=[(k, v.encode()) for k, v in headers.items()]),),
        "mapping": ({"headers": headers, "body": body},),
    }


def _hostile(msg: JobMessage) -> dict[str, tuple[dict[str, str], bytes, str]]:
    """Issue #36's forged messages: headers, body, and the field refused.
    The decorator used to let RecursionError, sqlalchemy's DataError and
    ValueError out of the loop (or run the handler)."""
    h, body = msg.header_map(), msg.encode()
    return {
        "no-headers-no-envelope": ({}, b'{"format": "other"}', "format"),
        "deep-body": (h, deep_json(50_000), "body"),
        "long-id": ({**h, "duebox-id": "x" * 300}, body, "duebox-id"),
        "nul-id": ({**h, "duebox-id": str(msg.job_id)[:-1] + "\x00"}, body, "duebox-id"),
        "superscript-version": ({**h, "duebox-version": "\u00b2"}, body, "duebox-version"),
        "version-0": ({}, dataclasses.replace(msg, version=0).encode(), "version"),
        "version-10**30": ({}, dataclasses.replace(msg, version=10**30).encode(), "version"),
        "nul-task": ({}, dataclasses.replace(msg, task="send\x00").encode(), "task"),
        "long-task": ({}, dataclasses.replace(msg, task="t" * 201).encode(), "task"),
        "another-job's-id": ({**h, "duebox-id": str(uuid.uuid4())}, body, "duebox-id"),
    }


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    app = duebox.Duebox(database_url=database_url)
    seen_metadata.drop_all(app.engine)
    seen_metadata.create_all(app.engine)
    yield app.engine
    app.dispose()


def _rows(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(seen.c.job_id)).scalars())


@pytest.mark.parametrize("shape", list(_shapes(_message())))
def test_sql_store_runs_each_native_message_once(engine: sa.Engine, shape: str) -> None:
    store = SQLDedupeStore(engine, consumer=f"loop-{shape}")
    calls: list[Any] = []

    @duebox.dedupe(store)
    def handle(*args: Any, session: Any) -> str:
        calls.append(args)
        session.execute(seen.insert().values(job_id=str(msg.job_id)))
        return "done"

    msg = _message()
    args = _shapes(msg)[shape]
    assert handle(*args) == "done"
    assert handle(*args) is DUPLICATE
    assert len(calls) == 1
    assert _rows(engine) == [str(msg.job_id)]


def test_sql_store_rolls_back_the_mark_with_a_failing_handler(engine: sa.Engine) -> None:
    store = SQLDedupeStore(engine, consumer="flaky")
    attempts: list[int] = []

    @duebox.dedupe(store)
    def handle(message: Any, *, session: Any) -> None:
        attempts.append(1)
        session.execute(seen.insert().values(job_id=message["duebox-id"]))
        if len(attempts) == 1:
            raise ConnectionError("downstream down")

    message = {"duebox-id": str(uuid.uuid4())}
    with pytest.raises(ConnectionError):
        handle(message)
    assert _rows(engine) == []  # the effect and the dedupe row rolled back together
    handle(message)
    assert handle(message) is DUPLICATE
    assert len(attempts) == 2
    assert _rows(engine) == [message["duebox-id"]]


async def test_sql_store_with_an_async_handler(engine: sa.Engine) -> None:
    store = SQLDedupeStore(engine, consumer="async-loop")

    @duebox.dedupe(store)
    async def handle(record: ConsumerRecord[Any, Any], *, session: Any) -> int:
        await session.execute(seen.insert().values(job_id=str(msg.job_id)))
        return 7

    msg = _message()
    (record,) = _shapes(msg)["kafka"]
    try:
        assert await handle(record) == 7
        assert await handle(record) is DUPLICATE
    finally:
        await store.aclose()
    assert _rows(engine) == [str(msg.job_id)]


def test_a_message_without_an_outbox_id_is_an_error(engine: sa.Engine) -> None:
    @duebox.dedupe(SQLDedupeStore(engine))
    def handle(message: Any, *, session: Any) -> None:  # pragma: no cover
        raise AssertionError("must not be called")

    for bad, field in (({"text": "hello"}, "duebox-id"), (b"not json", "body"),
                       (pika.BasicProperties(headers={"x": "1"}), "duebox-id"),
                       ((b"1-0", {b"id": b"x"}), "duebox-id")):
        with pytest.raises(MessageDecodeError) as err:
            handle(bad)
        assert err.value.field == field
    assert _rows(engine) == []


@pytest.mark.parametrize("shape", list(_native({}, b"")))
@pytest.mark.parametrize("case", list(_hostile(_message())))
def test_what_is_not_a_duebox_message_is_refused_naming_the_field(
        engine: sa.Engine, shape: str, case: str) -> None:
    """One error, MessageDecodeError (a DueboxError), for every forged
    message in every driver's shape, before any SQL: nothing is written."""
    calls: list[Any] = []

    @duebox.dedupe(SQLDedupeStore(engine, consumer="forged"))
    def handle(*message: Any, session: Any) -> None:  # pragma: no cover
        calls.append(message)

    headers, body, field = _hostile(_message())[case]
    with pytest.raises(MessageDecodeError) as err:
        handle(*_native(headers, body)[shape])
    assert err.value.field == field
    assert isinstance(err.value, duebox.DueboxError)
    assert calls == []
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(processed)).scalar_one() == 0


async def test_an_async_handler_refuses_them_too(engine: sa.Engine) -> None:
    store = SQLDedupeStore(engine, consumer="forged")

    @duebox.dedupe(store)
    async def handle(record: Any, *, session: Any) -> None:  # pragma: no cover
        raise AssertionError("must not be called")

    try:
        for headers, body, field in _hostile(_message()).values():
            (record,) = _native(headers, body)["kafka"]
            with pytest.raises(MessageDecodeError) as err:
                await handle(record)
            assert err.value.field == field
    finally:
        await store.aclose()


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        client.close()
        service_missing("Redis", exc)
    prefix = f"duebox-test:{uuid.uuid4().hex[:8]}:"
    client.prefix = prefix  # type: ignore[attr-defined]
    yield client
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)
    client.close()


def test_redis_store_with_a_real_stream_entry(redis_client: redis.Redis) -> None:
    prefix = redis_client.prefix  # type: ignore[attr-defined]
    store = RedisDedupeStore(redis_client, consumer="mail", prefix=prefix, ttl=60)
    stream = prefix + "stream"
    msg = _message()
    redis_client.xadd(stream, {"body": msg.encode()})
    ((_, entries),) = redis_client.xread({stream: "0-0"})
    (entry,) = entries
    sent: list[str] = []

    @duebox.dedupe(store)
    def handle(entry: Any) -> None:
        sent.append(entry[0].decode())
        if len(sent) == 1:
            raise TimeoutError("smtp timeout")

    with pytest.raises(TimeoutError):
        handle(entry)
    handle(entry)  # the failed run released the key
    assert handle(entry) is DUPLICATE
    assert len(sent) == 2
    key = f"{prefix}mail:{msg.job_id}"
    assert redis_client.get(key) == b"done"
    assert 0 < redis_client.ttl(key) <= 60


async def test_redis_store_async(redis_client: redis.Redis) -> None:
    prefix = redis_client.prefix  # type: ignore[attr-defined]
    client = redis.asyncio.Redis(host="127.0.0.1", port=6379)
    store = RedisDedupeStore(client, consumer="a", prefix=prefix)
    calls: list[int] = []

    @duebox.dedupe(store)
    async def handle(message: dict[str, str]) -> None:
        calls.append(1)

    try:
        message = {"duebox-id": str(uuid.uuid4())}
        await handle(message)
        assert await handle(message) is DUPLICATE
    finally:
        await client.aclose()
    assert calls == [1]
