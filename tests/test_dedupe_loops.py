"""``@duebox.dedupe(store)`` around a user's own consumer loop, with each
driver's native message shape."""

from __future__ import annotations

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

import duebox
from duebox import DUPLICATE, MessageDecodeError, RedisDedupeStore, SQLDedupeStore
from duebox.message import JobMessage

seen_metadata = sa.MetaData()
seen = sa.Table("loop_effects", seen_metadata, sa.Column("job_id", sa.String(64),
                                                             primary_key=True))


def _message() -> JobMessage:
    return JobMessage(job_id=uuid.uuid4(), task="t", queue="q", version=1, attempt=0,
                      due_at=datetime.now(UTC), payload={"n": 1})


def _shapes(msg: JobMessage) -> dict[str, tuple[Any, ...]]:
    body = msg.encode()
    headers = msg.header_map()
    return {
        "pika": (None, None, pika.BasicProperties(headers=headers), body),
        "pika-body-only": (None, None, pika.BasicProperties(), body),
        "sqs": ({"MessageId": "m-1", "ReceiptHandle": "r", "Body": body.decode(),
                 "MessageAttributes": {k: {"DataType": "String", "StringValue": v}
                                       for k, v in headers.items()}},),
        "kafka": (ConsumerRecord(topic="q", partition=0, offset=1, timestamp=0,
                                 timestamp_type=0, key=None, value=body, checksum=None,
                                 serialized_key_size=0, serialized_value_size=len(body),
                                 headers=[(k, v.encode()) for k, v in headers.items()]),),
        "redis-entry": ((b"1-0", {b"body": body}),),
        "mapping": ({"duebox-id": str(msg.job_id), "text": "hi"},),
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

    for bad in ({"text": "hello"}, b"not json", pika.BasicProperties(headers={"x": "1"})):
        with pytest.raises(MessageDecodeError) as err:
            handle(bad)
        assert err.value.field == "duebox-id"
    assert _rows(engine) == []


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
