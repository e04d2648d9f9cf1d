"""The backend contract on ``amqp://`` against the real RabbitMQ: the
session's vhost, with an object-name ``?prefix=`` of the test's own.  A
restart is ``rabbitmqctl stop_app`` / ``start_app`` (always started again in
a ``finally``)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
from backends import rabbitmqctl, with_params
from helpers import Running

import duebox

from .base import BackendContract

pytestmark = [pytest.mark.contract, pytest.mark.backend_amqp, pytest.mark.postgres]


class TestAMQPContract(BackendContract):
    @pytest.fixture
    def broker_url(self, amqp_vhost: str) -> str:
        return with_params(amqp_vhost, prefix=f"t{uuid.uuid4().hex[:10]}")

    @contextlib.asynccontextmanager
    async def broker_outage(self, app: duebox.Duebox,
                            running: Running) -> AsyncIterator[None]:
        relay = running.relays[0]
        errors = relay.totals.errors
        try:
            await asyncio.to_thread(rabbitmqctl, "stop_app")
            yield
            await running.wait(lambda: relay.totals.errors > errors, timeout=20,
                               what="the relay noticed the outage")
        finally:
            await asyncio.to_thread(rabbitmqctl, "start_app")
            await asyncio.to_thread(rabbitmqctl, "await_startup")
