"""``Broker.locate``: where an ENQUEUED job's message is now, per backend.

Each backend answers from the job's row and its own delay mechanism (no
broker is contacted: none runs here), so shared code never switches on the
URL's scheme and ``amqps://`` and ``rediss://`` read like their plain twins.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

import duebox
from duebox.brokers.base import Broker, BrokerContext
from duebox.clock import SystemClock
from duebox.leases.recovery import EnqueuedRef
from duebox.registry import broker_class

NOW = datetime(2026, 3, 29, 12, tzinfo=UTC)


def broker(url: str) -> Broker:
    ctx = BrokerContext(sa.create_engine("sqlite://"), SystemClock(), duebox.Settings())
    return broker_class(url)(url, ctx)


def enqueued(delay_ms: int, elapsed_ms: int) -> EnqueuedRef:
    """Published ``elapsed_ms`` before NOW with a delay of ``delay_ms``."""
    published = NOW - timedelta(milliseconds=elapsed_ms)
    return EnqueuedRef(uuid.uuid4(), 1, "orders", published + timedelta(milliseconds=delay_ms),
                       published)


WAITING = enqueued(60_000, 1_000)  # due in 59 s
DUE = enqueued(1_000, 2_000)  # due a second ago


@pytest.mark.parametrize("url", ["amqp://guest:guest@127.0.0.1/", "amqps://127.0.0.1/"])
def test_rabbitmq_names_the_tier_from_the_delay_digits(url: str) -> None:
    b = broker(url)
    # 0x1a0 ms = 416 ms: 256 ms in tier 2.1, then 160 ms in tier 1.a.
    assert b.locate(enqueued(0x1A0, 100), NOW).startswith("in RabbitMQ delay tier 2.1 "
                                                          "(stop 1 of 2)")
    assert "delay tier 1.a (stop 2 of 2)" in b.locate(enqueued(0x1A0, 300), NOW)
    assert b.locate(DUE, NOW) == "in the RabbitMQ queue orders"


def test_rabbitmq_without_a_publish_time_names_the_queue() -> None:
    job = EnqueuedRef(uuid.uuid4(), 1, "orders", NOW + timedelta(seconds=5), None)
    assert broker("amqp://127.0.0.1/").locate(job, NOW) == "in the RabbitMQ queue orders"


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6380/0"])
def test_redis_index_until_due_then_the_stream(url: str) -> None:
    b = broker(url)
    assert b.locate(WAITING, NOW) == "in the Redis index (sorted set by due time)"
    assert b.locate(DUE, NOW) == "in the Redis ready stream of orders"


@pytest.mark.parametrize("url", ["sqs://127.0.0.1:4566?region=us-east-1",
                                 "sqs://127.0.0.1:4566?region=us-east-1&fifo=true"])
def test_sqs_delay_until_due_then_visible(url: str) -> None:
    b = broker(url)
    assert b.locate(WAITING, NOW) == "in SQS delay (DelaySeconds)"
    assert b.locate(DUE, NOW) == "visible in the SQS queue"


def test_kafka_names_the_topic() -> None:
    assert broker("kafka://127.0.0.1:9092").locate(DUE, NOW) == "in the Kafka topic of orders"


@pytest.mark.parametrize(("url", "name"), [("memory://", "memory"), ("sql://", "sql")])
def test_the_default_names_the_backend(url: str, name: str) -> None:
    assert broker(url).locate(DUE, NOW) == f"in the {name} broker"
