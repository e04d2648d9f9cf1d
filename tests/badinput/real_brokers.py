"""A corner of each real broker for one bad-input test: its URL, cleaned up
afterwards.  What to write into it is :class:`hostile.Forger`'s job."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
from backends import KafkaNames, Keys, Queues

BACKENDS = ("amqp", "kafka", "redis", "sqs")


@contextlib.asynccontextmanager
async def real_broker(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """The broker URL of a fresh prefix on the real ``backend``."""
    if backend == "redis":
        keys: Keys = request.getfixturevalue("redis_keys")  # wiped by the fixture
        yield keys.url()
    elif backend == "amqp":
        import pika

        vhost: str = request.getfixturevalue("amqp_vhost")
        prefix = f"p{uuid.uuid4().hex[:8]}"
        try:
            yield f"{vhost}?prefix={prefix}"
        finally:
            conn = pika.BlockingConnection(pika.URLParameters(vhost))
            channel = conn.channel()
            for name in ("q.default", "q.other", "dead-letter"):
                with contextlib.suppress(Exception):
                    channel.queue_delete(f"{prefix}.{name}")
            with contextlib.suppress(Exception):
                conn.close()
    elif backend == "sqs":
        queues = Queues(request.getfixturevalue("sqs_endpoint"))
        try:
            yield queues.url()
        finally:
            queues.delete_all()
    else:
        yield KafkaNames(request.getfixturevalue("kafka_bootstrap")).url()
