"""The backend contract on ``memory://``: an in-process hub (relay and worker
share the process), a fresh one per test."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from helpers import Running, memory_url

import duebox
from duebox.brokers.base import Durability
from duebox.brokers.memory import MemoryBroker

from .base import BackendContract

pytestmark = [pytest.mark.contract, pytest.mark.backend_memory, pytest.mark.postgres]


class TestMemoryContract(BackendContract):
    in_process_only = True

    @pytest.fixture
    def broker_url(self) -> str:
        return memory_url()

    @contextlib.asynccontextmanager
    async def broker_outage(self, app: duebox.Duebox,
                            running: Running) -> AsyncIterator[None]:
        """This broker's restart is its process's end: every message it holds
        is gone.  For the outage, the hub drops what is visible and every
        message whose delay ends (at least one); the job table's
        ``redeliver_after`` backstop must publish those jobs again."""
        broker = running.relays[0].pipelines[0].broker
        assert isinstance(broker, MemoryBroker)
        assert broker.capabilities.durability is Durability.NONE
        lost: list[object] = []
        queues = list(broker.hub.queues.values())
        for q in queues:
            while not q.empty():
                lost.append(q.get_nowait())
            q.put_nowait = lost.append  # type: ignore[method-assign]
        try:
            yield
            await running.wait(lambda: lost, timeout=10, what="a message lost in the outage")
        finally:
            for q in queues:
                del q.put_nowait
