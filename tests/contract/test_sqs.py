"""The backend contract on ``sqs://`` against LocalStack's SQS, under a
queue-name prefix of the test's own (its queues deleted afterwards).  A
restart is LocalStack stopped and started again by ``localstack/start.sh``:
its community edition keeps nothing, so every queue and message is gone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
from backends import Queues, localstack, sqs_healthy
from conftest import service_missing
from helpers import Running

import duebox

from .base import BackendContract

pytestmark = [pytest.mark.contract, pytest.mark.backend_sqs, pytest.mark.postgres]


class TestSQSContract(BackendContract):
    @pytest.fixture
    def broker_url(self, sqs_endpoint: str) -> Iterator[str]:
        queues = Queues(sqs_endpoint)
        # visibility_timeout=1: a dead consumer's message comes back while its job
        # is still leased (2 s);
        # check_interval=1: a recreated queue is noticed within a second.
        yield queues.url(visibility_timeout=1, check_interval=1)
        if sqs_healthy(sqs_endpoint):
            queues.delete_all()

    @contextlib.asynccontextmanager
    async def broker_outage(self, app: duebox.Duebox,
                            running: Running) -> AsyncIterator[None]:
        relay = running.relays[0]
        errors = relay.totals.errors
        stopped = await asyncio.to_thread(localstack, "stop", 60)
        if b"stopped" not in stopped.stdout:
            service_missing("a LocalStack this suite can stop (started by localstack/start.sh)",
                            RuntimeError(stopped.stdout.decode()))
        try:
            yield
            await running.wait(lambda: relay.totals.errors > errors, timeout=20,
                               what="the relay noticed the outage")
        finally:
            started = await asyncio.to_thread(localstack, "start", 120)
            assert started.returncode == 0, started.stderr.decode()[-2000:]
