"""The broker seam's one shape: a backend the relay publishes to is a
``PublishingBroker``; one whose workers claim rows from the job table
(``Capabilities.direct_claim``, sql://) has no ``publish`` at all, and the
relay has no publisher for it.  A backend that says one and is the other is
refused when its class is defined, not found out by jobs that never run."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

import pytest

import duebox
from duebox.brokers.base import Broker, Delivery, Outgoing, PublishingBroker, PublishResult
from duebox.brokers.memory import MemoryBroker
from duebox.brokers.sql import SQLBroker
from duebox.relay import Relay


def test_a_backend_without_direct_claim_must_take_the_relays_messages() -> None:
    with pytest.raises(TypeError, match="must be a PublishingBroker"):
        class Silent(Broker):  # publishes nothing, yet the relay would hand it jobs
            capabilities = replace(MemoryBroker.capabilities, name="silent")

            def consume(self, queues: Sequence[str], prefetch: int,
                        wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
                raise NotImplementedError


def test_a_direct_claim_backend_must_not_publish() -> None:
    with pytest.raises(TypeError, match="must not be a PublishingBroker"):
        class Both(PublishingBroker):
            capabilities = replace(SQLBroker.capabilities, name="both")

            async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
                return []

            def consume(self, queues: Sequence[str], prefetch: int,
                        wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
                raise NotImplementedError


def test_the_relay_has_a_pipeline_only_where_the_backend_publishes() -> None:
    sql = duebox.Duebox("sqlite://", "sql://")
    memory = duebox.Duebox("sqlite://", "memory://")
    assert Relay(sql).pipelines == []
    (pipeline,) = Relay(memory).pipelines
    assert isinstance(pipeline.broker, PublishingBroker)
    assert pipeline.broker.capabilities.name == "memory"
