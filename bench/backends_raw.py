"""Raw client baselines: what the bare client library does against the same
server, with no duebox and no database, for the relay trial to be read against.

Every message is the size of a relay message (an encoded ``JobMessage`` with a
small payload) and carries the same headers/attributes; durability settings
match the backend's (persistent + confirms, ``acks=all`` + idempotence).
Each function returns ``{"rate": msgs/s, "seconds": ..., "n": ...}`` for its
headline figure, plus any secondary figures.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from duebox.message import JobMessage

BATCH = 500  # the relay's batch size, used wherever a baseline batches


def sample(i: int = 0) -> JobMessage:
    return JobMessage(uuid.uuid4(), "noop", "default", 1, 0, datetime.now(UTC), {"i": i})


def timed(n: int, started: float) -> dict[str, Any]:
    elapsed = time.perf_counter() - started
    return {"n": n, "seconds": elapsed, "rate": n / elapsed}


# --- Redis: pipelined ZADD ------------------------------------------------------------


def redis_zadd(url: str, n: int) -> dict[str, Any]:
    """One ZADD per message (member = job id, score = due ms), ``BATCH`` per
    non-transactional pipeline round trip: the sorted-set write at the heart of
    the relay's publish, without its message and reconciliation hashes."""
    import redis

    from duebox.brokers.redis_settings import RedisSettings

    settings = RedisSettings.from_url(url)
    key = f"{settings.prefix}:raw:due"
    score = (time.time() + 300) * 1000
    members = [str(uuid.uuid4()) for _ in range(n)]
    with redis.Redis.from_url(settings.client_url) as client:
        client.ping()
        started = time.perf_counter()
        for i in range(0, n, BATCH):
            pipe = client.pipeline(transaction=False)
            for member in members[i:i + BATCH]:
                pipe.zadd(key, {member: score})
            pipe.execute()
        result = timed(n, started)
        assert client.zcard(key) == n
        client.delete(key)
    return result


# --- RabbitMQ: pika, persistent messages ---------------------------------------------


def amqp_pika(url: str, n: int) -> dict[str, Any]:
    """Two blocking-pika baselines into a durable queue of the run's vhost:
    transactions of ``BATCH`` messages (the headline) and a publisher confirm
    awaited per message (slow: measured on at most 2,000)."""
    import pika

    base = url.split("?", 1)[0]
    msg = sample()
    body = msg.encode()
    props = pika.BasicProperties(delivery_mode=2, content_type="application/json",
                                 message_id=str(msg.job_id), headers=msg.header_map())
    queue = "bench.raw"
    conn = pika.BlockingConnection(pika.URLParameters(base))
    try:
        ch = conn.channel()
        ch.queue_declare(queue, durable=True)
        n_tx = min(n, 20_000)
        ch.tx_select()
        started = time.perf_counter()
        for i in range(0, n_tx, BATCH):
            for _ in range(min(BATCH, n_tx - i)):
                ch.basic_publish("", queue, body, props, mandatory=True)
            ch.tx_commit()
        result = timed(n_tx, started)
        confirms = conn.channel()
        confirms.confirm_delivery()
        n_c = min(n, 2_000)
        started = time.perf_counter()
        for _ in range(n_c):
            confirms.basic_publish("", queue, body, props, mandatory=True)
        result["confirm_each"] = timed(n_c, started)
        assert ch.queue_declare(queue, durable=True, passive=True).method.message_count \
            == n_tx + n_c
        ch.queue_delete(queue)
    finally:
        conn.close()
    return result


# --- SQS: SendMessageBatch -------------------------------------------------------------


def sqs_batch(url: str, n: int, threads: int = 8) -> dict[str, Any]:
    """``SendMessageBatch`` of 10 from ``threads`` threads (the sqs:// broker's
    default pool) into a queue under the run's prefix (deleted with it)."""
    import boto3
    import botocore.config

    from duebox.brokers.sqs_settings import SQSSettings

    settings = SQSSettings.from_url(url)
    client = boto3.client("sqs", endpoint_url=settings.endpoint, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test",
                          config=botocore.config.Config(max_pool_connections=threads + 8))
    queue = client.create_queue(QueueName=f"{settings.prefix}raw")["QueueUrl"]
    msg = sample()
    body = msg.encode().decode()
    attrs = {k: {"DataType": "String", "StringValue": v} for k, v in msg.header_map().items()}

    def send(_: int) -> None:
        entries = [{"Id": str(i), "MessageBody": body, "MessageAttributes": attrs}
                   for i in range(10)]
        reply = client.send_message_batch(QueueUrl=queue, Entries=entries)
        assert not reply.get("Failed"), reply

    client.get_queue_attributes(QueueUrl=queue)  # connection up before the clock starts
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(send, range(n // 10)))
    return timed(n // 10 * 10, started)


# --- Kafka: aiokafka and librdkafka producers ---------------------------------------------


async def _aiokafka(bootstrap: list[str], topic: str, n: int) -> dict[str, Any]:
    from aiokafka import AIOKafkaProducer

    msgs = [sample(i) for i in range(n)]
    records = [(str(m.job_id).encode(), m.encode(),
                [(k, v.encode()) for k, v in m.header_map().items()]) for m in msgs]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all",
                                enable_idempotence=True)
    await producer.start()
    try:
        partitions = len(await producer.partitions_for(topic))
        started = time.perf_counter()
        futures = [await producer.send(topic, value, key=key, headers=headers)
                   for key, value, headers in records]
        await asyncio.gather(*futures)
        return {**timed(n, started), "partitions": partitions}
    finally:
        await producer.stop()


def _librdkafka(bootstrap: list[str], topic: str, n: int) -> dict[str, Any]:
    from confluent_kafka import Producer

    msgs = [sample(i) for i in range(n)]
    producer = Producer({"bootstrap.servers": ",".join(bootstrap), "acks": "all",
                         "enable.idempotence": True, "linger.ms": 5})
    failed: list[str] = []

    def report(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(str(err))

    producer.list_topics(topic, timeout=10)
    started = time.perf_counter()
    for m in msgs:
        while True:
            try:
                producer.produce(topic, m.encode(), str(m.job_id).encode(),
                                 headers=m.header_map(), on_delivery=report)
                break
            except BufferError:  # local queue full: let deliveries drain
                producer.poll(0.05)
        producer.poll(0)
    remaining = producer.flush(60)
    result = timed(n, started)
    assert remaining == 0, f"{remaining} messages undelivered"
    assert not failed, f"delivery errors: {failed[:3]}"
    return result


def kafka_producers(url: str, n: int) -> dict[str, Any]:
    """aiokafka (duebox's client: ``send()`` per record, ``acks=all``,
    idempotent; the headline) and librdkafka through confluent-kafka (the
    same settings: what a C client gets from the same broker), each into its
    own topic, created the way the relay's is on a broker without CreateTopics
    (the mock): by auto-creation on first metadata request."""
    from duebox.brokers.kafka_settings import KafkaSettings

    settings = KafkaSettings.from_url(url)
    bootstrap = list(settings.bootstrap)
    result = asyncio.run(_aiokafka(bootstrap, settings.prefix + "raw", n))
    result["librdkafka"] = _librdkafka(bootstrap, settings.prefix + "raw_c", n)
    return result


def run(backend: str, url: str, n: int) -> dict[str, Any]:
    if backend == "redis":
        return redis_zadd(url, n)
    if backend == "amqp":
        return amqp_pika(url, n)
    if backend == "sqs":
        return sqs_batch(url, n)
    if backend == "kafka":
        return kafka_producers(url, n)
    raise ValueError(f"no raw baseline for backend {backend!r}")
