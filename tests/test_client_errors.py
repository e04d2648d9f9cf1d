"""Relays and workers outlive what their broker and database clients raise,
and say so briefly (#17 item 8; the outages with real processes are in
tests/test_hostile_processes.py).

* aiokafka's admin client raises ``AttributeError: 'NoneType' object has no
  attribute 'nodeId'`` (from its own ``_send_to_controller``) while the
  cluster reports no controller, a real state during a controller failover;
  the relay exited on it.  Here the cluster's metadata reports no controller
  for a while (aiokafka's ``ClusterMetadata.controller`` left None, as after
  a metadata response with controller id -1) against the real Kafka mock.
"""

from __future__ import annotations

from typing import Any

import pytest
from backends import KafkaNames
from helpers import Running, all_final, effect_rows, make_app, schedule_committed

POSTGRES = pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@SQLITE
async def test_the_relay_and_worker_outlive_a_kafka_cluster_with_no_controller(
        database_url: str, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokafka.cluster import ClusterMetadata

    update = ClusterMetadata.update_metadata
    failover = True

    def no_controller(self: ClusterMetadata, metadata: Any) -> Any:
        done = update(self, metadata)
        if failover:  # as after a metadata response with controller id -1
            self.controller = None
        return done

    monkeypatch.setattr(ClusterMetadata, "update_metadata", no_controller)
    names = KafkaNames(kafka_bootstrap)
    app = make_app(database_url, names.url())
    try:
        async with Running(app) as r:
            job_id = schedule_committed(app, "effect")
            # Topic creation meets the missing controller and falls back to
            # the cluster's auto-creation; nothing ends on the error.
            await r.wait(lambda: all_final(app.engine, [job_id]), timeout=60,
                         what="the job to run while the cluster has no controller")
            failover = False
            after = schedule_committed(app, "effect")
            await r.wait(lambda: all_final(app.engine, [after]), timeout=60,
                         what="a job after the failover")
        assert set(effect_rows(app.engine)) == {str(job_id), str(after)}
    finally:
        await app.adispose()


@SQLITE
async def test_an_unexpected_exception_from_the_broker_client_does_not_end_the_relay(
        database_url: str, kafka_bootstrap: str, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever a client raises in a pass (here the admin client's
    AttributeError at every publish for a while): logged once per kind with
    its traceback, retried with backoff; the relay never exits."""
    names = KafkaNames(kafka_bootstrap)
    app = make_app(database_url, names.url())
    try:
        async with Running(app) as r:
            broker = r.relays[0].pipelines[0].broker
            publish = broker.publish
            failing = 5

            async def no_controller(batch: Any) -> Any:
                nonlocal failing
                if failing:
                    failing -= 1
                    raise AttributeError("'NoneType' object has no attribute 'nodeId'")
                return await publish(batch)

            broker.publish = no_controller  # type: ignore[method-assign]
            job_id = schedule_committed(app, "effect")
            await r.wait(lambda: all_final(app.engine, [job_id]), timeout=60,
                         what="the job to run once the client stops failing")
        assert failing == 0
        assert r.relays[0].totals.errors >= 5
        failed = [rec for rec in caplog.records if "relay pass failed" in rec.getMessage()]
        assert failed  # said, and briefly: the first with its traceback, the rest counted
        assert sum(rec.exc_info is not None for rec in failed) == 1
        assert len(failed) <= 2
    finally:
        await app.adispose()
