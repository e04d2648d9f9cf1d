""""Where it is now" for an ENQUEUED job, per backend (shared by
`duebox jobs show` and the dashboard's job page)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from duebox.cli.inspect_jobs import where_now

NOW = datetime(2026, 3, 29, 12, tzinfo=UTC)


def _enqueued(delay_ms: int, elapsed_ms: int) -> SimpleNamespace:
    published = NOW - timedelta(milliseconds=elapsed_ms)
    return SimpleNamespace(state="ENQUEUED", queue="orders", broker_message_id=None,
                           published_at=published,
                           due_at=published + timedelta(milliseconds=delay_ms))


def test_rabbitmq_tier_follows_the_delay_digits() -> None:
    # 0x1a0 ms = 416 ms: 256 ms in tier 2.1, then 160 ms in tier 1.a.
    assert "delay tier 2.1 (stop 1 of 2)" in where_now(_enqueued(0x1A0, 100), "amqp", NOW)
    assert "delay tier 1.a (stop 2 of 2)" in where_now(_enqueued(0x1A0, 300), "amqp", NOW)
    assert "in the RabbitMQ queue orders, due, waiting" in \
        where_now(_enqueued(0x1A0, 500), "amqp", NOW)


def test_each_backend_names_its_delay_mechanism() -> None:
    waiting, due = _enqueued(60_000, 1_000), _enqueued(1_000, 2_000)
    assert where_now(waiting, "sqs", NOW).startswith("in SQS delay (DelaySeconds), due in 59.0")
    assert where_now(due, "sqs", NOW).startswith("visible in the SQS queue")
    assert where_now(waiting, "redis", NOW).startswith("in the Redis index")
    assert where_now(due, "redis", NOW).startswith("in the Redis ready stream of orders")
    assert where_now(due, "kafka", NOW).startswith("in the Kafka topic of orders")
    parked = SimpleNamespace(state="SCHEDULED", due_at=NOW + timedelta(hours=2))
    assert where_now(parked, "sqs", NOW) == "parked in the database, due in 7200.0 s"
