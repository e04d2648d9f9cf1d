"""The backend contract on ``amqp://`` against the real RabbitMQ, in both
delay modes: ``delay_mode=plugin`` (the ``rabbitmq_delayed_message_exchange``
plugin, which ``.ci/services`` enables) and ``delay_mode=tiers`` (TTL tier
queues).  Each test runs in the session's vhost with an object-name
``?prefix=`` of its own.  A restart is ``rabbitmqctl stop_app`` /
``start_app`` (always started again in a ``finally``), with delayed messages
pending in the broker: in the plugin's Mnesia table, or in tier queues."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import pika
import pytest
from backends import plugin_delayed, rabbitmqctl, with_params
from helpers import Running, check_no_early_start, job_row, schedule_committed, wait_for

import duebox
from duebox.brokers.amqp import AMQPBroker
from duebox.brokers.amqp_topology import LEVELS, RADIX
from duebox.brokers.base import Capabilities

from .base import BackendContract, MakeApp, all_in, calls, relay_pass, state

pytestmark = [pytest.mark.contract, pytest.mark.backend_amqp, pytest.mark.postgres]

# Jobs handed to the broker just before the restart: long enough to still be
# waiting there when it is back (on a loaded machine stop + start take ~8 s),
# short enough not to drag the clause out.
HELD_DELAY = 15.0


def _broker(app: duebox.Duebox) -> AMQPBroker:
    broker = app.broker()
    assert isinstance(broker, AMQPBroker)
    return broker


def _tier_queues(broker: AMQPBroker) -> list[str]:
    return [broker.topology.tier_queue(j, d) for j in range(LEVELS) for d in range(1, RADIX)]


def _tier_messages(broker: AMQPBroker) -> int:
    # Passive declarations on one connection: rabbitmqctl takes seconds on a
    # loaded machine, longer than a message stays in a tier queue.
    conn = pika.BlockingConnection(broker.pika_params)
    try:
        chan = conn.channel()
        return sum(int(chan.queue_declare(q, passive=True).method.message_count)
                   for q in _tier_queues(broker))
    finally:
        conn.close()


def held_in_broker(app: duebox.Duebox) -> int:
    """How many messages are waiting out a delay in the broker now."""
    broker = _broker(app)
    if broker.plugin:
        return plugin_delayed(broker.pika_params.virtual_host, broker.topology.delayed)
    return _tier_messages(broker)


def lose_delayed(app: duebox.Duebox) -> None:
    """Make the broker lose every message waiting out a delay for this test:
    the plugin's entries for its exchange are deleted, its tier queues purged."""
    broker = _broker(app)
    if broker.plugin:
        plugin_delayed(broker.pika_params.virtual_host, broker.topology.delayed, delete=True)
        return
    conn = pika.BlockingConnection(broker.pika_params)
    try:
        chan = conn.channel()
        for queue in _tier_queues(broker):
            chan.queue_purge(queue)
    finally:
        conn.close()


class TestAMQPContract(BackendContract):
    # Parked jobs are published ``max_delay`` ahead through the broker's
    # delay (the plugin's or the tiers'), not held by the relay near due.
    parking_relay_kw: ClassVar[dict[str, Any]] = {"near_window": 0.0}

    @pytest.fixture(params=["plugin", "tiers"])
    def delay_mode(self, request: pytest.FixtureRequest) -> str:
        return str(request.param)

    @pytest.fixture
    def broker_url(self, amqp_vhost: str, delay_mode: str) -> str:
        return with_params(amqp_vhost, prefix=f"t{uuid.uuid4().hex[:10]}", delay_mode=delay_mode)

    @contextlib.asynccontextmanager
    async def broker_outage(self, app: duebox.Duebox,
                            running: Running) -> AsyncIterator[list[uuid.UUID]]:
        """Hands the broker jobs delayed ``HELD_DELAY`` first and checks they
        wait in it (the plugin's table, or tier queues) when it stops.  Both
        keep them across ``stop_app``/``start_app``: still all there after
        it (checked when it is back before they are due), and run once,
        never early.  (Whether they ran from the broker's copy or the
        relay's recovery also depends on how soon the worker reconnects.)"""
        relay = running.relays[0]
        (pipeline,) = relay.pipelines
        errors = relay.totals.errors
        # A running relay keeps jobs due within its near window to itself and
        # publishes them just before due; these must wait in the broker.
        near, pipeline.near_window = pipeline.near_window, 0.0
        try:
            held = [schedule_committed(app, "effect", {"held": i}, delay=HELD_DELAY)
                    for i in range(3)]
            await running.wait(lambda: all_in(app, held, "ENQUEUED"), timeout=15,
                               what="the held jobs handed to the broker")
        finally:
            pipeline.near_window = near
        await wait_for(lambda: held_in_broker(app) >= len(held), timeout=15, interval=0.3,
                       what="the held jobs waiting out their delay in the broker")
        try:
            await asyncio.to_thread(rabbitmqctl, "stop_app")
            yield held
            await running.wait(lambda: relay.totals.errors > errors, timeout=20,
                               what="the relay noticed the outage")
        finally:
            await asyncio.to_thread(rabbitmqctl, "start_app")
            await asyncio.to_thread(rabbitmqctl, "await_startup")
        # Still before their due time: the broker must hold all of them again.
        count = await asyncio.to_thread(held_in_broker, app)
        first_due = min(job_row(app.engine, j).due_at for j in held).timestamp()
        if time.time() < first_due - 0.2:
            assert count == len(held), "the broker lost delayed messages over the restart"
        await running.wait(lambda: all_in(app, held), timeout=HELD_DELAY + 30,
                           what="the held jobs ran after the restart")

    # ``rabbitmqctl stop_app`` stops the broker every worker of a parallel
    # run shares: nothing else may run meanwhile (tests/exclusive.py).
    @pytest.mark.exclusive
    @pytest.mark.slow
    async def test_broker_restart_loses_nothing(self, apps: MakeApp,
                                                caps: Capabilities) -> None:
        await super().test_broker_restart_loses_nothing(apps, caps)

    async def test_delays_the_broker_lost_are_published_again(self, apps: MakeApp) -> None:
        """What the broker loses while delaying (the plugin disabled, its
        node lost, tier queues purged) comes back through the relay's
        recovery of ENQUEUED jobs overdue by ``redeliver_after``: late, once,
        never early.  A job handed over after the loss still goes through
        the broker's delay (losing some leaves the plugin working)."""
        app = apps(settings={"redeliver_after": 2.0})
        # Long enough to count them in the broker (a rabbitmqctl call) first.
        ids = [schedule_committed(app, delay=5.0) for _ in range(3)]
        assert (await relay_pass(app)).published == 3
        first = {j: job_row(app.engine, j).published_at for j in ids}
        await wait_for(lambda: held_in_broker(app) == len(ids), timeout=15, interval=0.3,
                       what="the jobs waiting out their delay in the broker")
        await asyncio.to_thread(lose_delayed, app)
        assert await asyncio.to_thread(held_in_broker, app) == 0
        after = schedule_committed(app, delay=1.0)
        await relay_pass(app)  # on a slow machine it may recover the lost ones already
        assert state(app, after) == "ENQUEUED"
        handed = job_row(app.engine, after).published_at
        async with Running(app, relays=1, workers=1) as r:
            await r.wait(lambda: all_in(app, [after]), timeout=20,
                         what="the job handed over after the loss ran")
            ran = time.time()
            await r.wait(lambda: all_in(app, ids), timeout=30, what="the lost jobs ran")
        check_no_early_start(app.engine)
        for j in ids:
            assert calls(app, j) == 1
            row = job_row(app.engine, j)
            assert row.published_at > first[j], "ran without being published again"
        assert calls(app, after) == 1
        due = job_row(app.engine, after).due_at.timestamp()
        if ran < due + app.settings.redeliver_after - 0.5:
            # Too early for the recovery: the broker delivered it.
            assert job_row(app.engine, after).published_at == handed
