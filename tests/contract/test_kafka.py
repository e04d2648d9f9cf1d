"""The backend contract on ``kafka://`` against a Kafka-protocol broker (the
mock cluster of tests/services/kafka_mock.py unless DUEBOX_TEST_KAFKA names
another), with a topic prefix and consumer group of the test's own.  A
restart is the mock SIGKILLed and an empty one started at the same address
(harsher than a Kafka restart, which keeps its log).

Kafka's ceiling is 0: nothing is in the broker before a job's due time, so
the cancel and reschedule clauses, whose first step publishes ahead of time,
are asserted here in the form that applies: the relay holds the jobs in
memory, and the old version it publishes at the old due time is discarded.

The duplicate clause runs its copies through one worker with three slots
instead of two workers: librdkafka's mock group coordinator answers a
follower's SyncGroup with INVALID_REQUEST when the leader's SyncGroup came
first (it marks the group up as soon as every assignment is in), so two
members of one group on the mock keep failing to join.  Real Kafka has no
such race.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import pytest
from backends import KafkaNames, kafka_server
from conftest import service_missing
from helpers import (
    Running,
    cancel_committed,
    check_no_early_start,
    effect_rows,
    job_row,
    schedule_committed,
    us,
)

import duebox
from duebox.brokers.base import Capabilities, Outgoing

from .base import BackendContract, all_in, calls, message_of, relay_pass, state

pytestmark = [pytest.mark.contract, pytest.mark.backend_kafka, pytest.mark.postgres]


def held(r: Running) -> int:
    return sum(len(p.held) for x in r.relays for p in x.pipelines)


class TestKafkaContract(BackendContract):
    @pytest.fixture
    def broker_url(self, kafka_bootstrap: str) -> str:
        self.bootstrap = kafka_bootstrap
        return KafkaNames(kafka_bootstrap).url()

    @contextlib.asynccontextmanager
    async def broker_outage(self, app: duebox.Duebox,
                            running: Running) -> AsyncIterator[None]:
        server = kafka_server()
        port = int(self.bootstrap.rsplit(":", 1)[1])
        if not await asyncio.to_thread(server.stop_background, server.pidfile_for(port),
                                       signal.SIGKILL):
            service_missing("a Kafka this suite can kill (tests/services/kafka_mock.py or "
                            "tansu.py start)", RuntimeError(str(server.pidfile_for(port))))
        try:
            yield
        finally:
            await asyncio.to_thread(server.start_background, port)

    async def test_cancel_before_delivery_is_honoured(self, app: duebox.Duebox,
                                                      caps: Capabilities) -> None:
        assert caps.max_delay == 0
        assert not caps.cancel
        gone, stale, kept = (schedule_committed(app, delay=1.5) for _ in range(3))
        broker = app.broker()
        try:
            assert await broker.cancel([gone]) == 0  # nothing in Kafka yet, nothing to drop
        finally:
            await broker.close()
        async with Running(app, relays=1, workers=1) as r:
            await r.wait(lambda: held(r) == 3, timeout=10, what="the relay holding all three")
            assert cancel_committed(app, gone)
            assert cancel_committed(app, stale)
            await r.wait(lambda: all_in(app, [kept]) and r.discarded.get("cancelled", 0) >= 2,
                         timeout=15, what="the kept job ran and the held ones were discarded")
        assert dict(r.discarded) == {"cancelled": 2}
        assert list(effect_rows(app.engine)) == [str(kept)]
        for j in (gone, stale):
            assert calls(app, j) == 0
            assert state(app, j) == "CANCELLED"
        check_no_early_start(app.engine)

    async def test_reschedule_runs_once_at_the_new_time(self, app: duebox.Duebox,
                                                        caps: Capabilities) -> None:
        job_id = schedule_committed(app, delay=0.8)
        async with Running(app, relays=1, workers=1) as r:
            await r.wait(lambda: held(r) == 1, timeout=10, what="the relay holding the job")
            old_due = us(job_row(app.engine, job_id).due_at)
            with app.engine.begin() as conn:
                app.reschedule(conn, job_id, delay=2.0)
            new_due = us(job_row(app.engine, job_id).due_at)
            assert new_due > old_due
            await r.wait(lambda: all_in(app, [job_id]), timeout=15, what="the job ran")
            await r.wait(lambda: r.discarded.get("stale_version"), timeout=5,
                         what="the held old version published and discarded")
        assert calls(app, job_id) == 1
        [e] = effect_rows(app.engine).values()
        assert e.started_us >= new_due, "ran at the old time"
        assert set(r.discarded) <= {"stale_version"}, r.discarded
        check_no_early_start(app.engine)

    async def test_duplicate_publish_is_dropped(self, app: duebox.Duebox,
                                                caps: Capabilities) -> None:
        job_id = schedule_committed(app, delay=0.0)
        assert (await relay_pass(app)).published == 1
        extra = app.broker("duplicator")
        try:
            msg = message_of(app, job_id)
            for _ in range(2):
                [res] = await extra.publish([Outgoing(msg, 0.0)])
                assert res.ok, res
            async with Running(app, relays=0, workers=1, concurrency=3) as r:
                await r.wait(lambda: all_in(app, [job_id])
                             and r.worker_total("received") >= 3, timeout=15,
                             what="the job ran and both copies were delivered")
                await r.wait(lambda: sum(r.discarded.values())
                             + r.worker_total("duplicates") >= 2, timeout=5,
                             what="both copies counted as duplicates")
        finally:
            await extra.close()
        assert set(r.discarded) <= {"already_running", "already_succeeded"}, r.discarded
        assert list(effect_rows(app.engine)) == [str(job_id)]
        assert calls(app, job_id) == 1
        check_no_early_start(app.engine)
