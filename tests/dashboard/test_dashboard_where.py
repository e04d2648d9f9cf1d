""""Where it is now" for an ENQUEUED job, per backend (shared by
`duebox jobs show` and the dashboard's job page)."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta

import pytest

import duebox
from duebox.reads.jobs import JobView, locator
from duebox.reads.jobs import where_now as where_in

NOW = datetime(2026, 3, 29, 12, tzinfo=UTC)
_BASE = JobView(id=uuid.uuid4(), task="t", queue="orders", state="ENQUEUED", version=1,
                attempt=0, max_attempts=3, priority=0, tenant=None, key=None, payload=None,
                due_at=NOW, created_at=NOW, claimed_at=None, published_at=None, started_at=None,
                finished_at=None, lease_owner=None, lease_until=None, broker_message_id=None,
                last_error=None, error_class=None)


def where_now(row: JobView, broker_url: str, now: datetime) -> str:
    """What `duebox jobs show` and the job page say, through the app's broker."""
    app = duebox.Duebox(database_url="sqlite://", broker_url=broker_url)
    try:
        return where_in(row, locator(app), now)
    finally:
        app.dispose()


def _enqueued(delay_ms: int, elapsed_ms: int) -> JobView:
    published = NOW - timedelta(milliseconds=elapsed_ms)
    return dataclasses.replace(_BASE, published_at=published,
                               due_at=published + timedelta(milliseconds=delay_ms))


@pytest.mark.parametrize("url", ["amqp://guest:guest@localhost/", "amqps://app:secret@rabbit.example/"])
def test_rabbitmq_tier_follows_the_delay_digits(url: str) -> None:
    # 0x1a0 ms = 416 ms: 256 ms in tier 2.1, then 160 ms in tier 1.a.
    assert "delay tier 2.1 (stop 1 of 2)" in where_now(_enqueued(0x1A0, 100), url, NOW)
    assert "delay tier 1.a (stop 2 of 2)" in where_now(_enqueued(0x1A0, 300), url, NOW)
    assert "in the RabbitMQ queue orders, due, waiting" in \
        where_now(_enqueued(0x1A0, 500), url, NOW)


def test_each_backend_names_its_delay_mechanism() -> None:
    waiting, due = _enqueued(60_000, 1_000), _enqueued(1_000, 2_000)
    assert where_now(waiting, "sqs://", NOW).startswith("in SQS delay (DelaySeconds), due in 59.0")
    assert where_now(due, "sqs://", NOW).startswith("visible in the SQS queue")
    for url in ("redis://localhost/0", "rediss://cache.example:6380/0"):
        assert where_now(waiting, url, NOW).startswith("in the Redis index")
        assert where_now(due, url, NOW).startswith("in the Redis ready stream of orders")
    assert where_now(due, "kafka://localhost:9092", NOW).startswith("in the Kafka topic of orders")
    parked = dataclasses.replace(_BASE, state="SCHEDULED", due_at=NOW + timedelta(hours=2))
    assert where_now(parked, "sqs://", NOW) == "parked in the database, due in 7200.0 s"
