"""duebox.brokers.base: the seam's own rules — a body always becomes a
delivery, a buffer is as large as the worker wants within bounds, a backend
either publishes or claims directly (never both, never neither), and a
broker that is down at start is retried until stopped."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from duebox import BrokerError, ConfigurationError, JobMessage
from duebox.brokers.base import (
    MAX_BUFFER,
    Broker,
    Delivery,
    Outgoing,
    PublishingBroker,
    PublishResult,
    buffer_size,
    delivery_from_body,
    open_broker,
    parse_params,
)
from duebox.brokers.memory import MemoryBroker
from duebox.states import Discard

MSG = JobMessage(job_id=uuid.UUID(int=1), task="t", queue="q", version=1, attempt=0,
                 due_at=datetime(2030, 1, 1, tzinfo=UTC))


def test_a_body_becomes_a_delivery_whatever_it_holds() -> None:
    good = delivery_from_body(MSG.encode(), raw="r", redelivered=True)
    assert (good.message, good.raw, good.redelivered, good.decode_error) == (MSG, "r", True, None)
    big = delivery_from_body(MSG.encode(), max_bytes=10)
    assert big.message is None
    assert big.decode_reason == Discard.TOO_LARGE
    assert big.decode_error is not None
    assert big.decode_error.startswith("body: must be at most")


def test_a_decoder_gap_is_a_delivery_too(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(body: Any, max_bytes: Any = None) -> JobMessage:
        raise KeyError("x" * 1000)

    monkeypatch.setattr(JobMessage, "decode", broken)
    d = delivery_from_body(b"{}")
    assert d.message is None
    assert d.decode_reason == Discard.UNDECODABLE
    assert d.decode_error is not None
    assert d.decode_error.startswith(
        "body: cannot be decoded (KeyError: ")
    assert len(d.decode_error) <= 300


@pytest.mark.parametrize(("prefetch", "wanted", "size"), [
    (16, None, 16), (16, 40, 40), (16, 0, 1), (16, -5, 1), (16, 10**6, MAX_BUFFER),
])
def test_the_buffer_is_what_the_worker_wants_within_bounds(prefetch: int, wanted: int | None,
                                                           size: int) -> None:
    assert buffer_size(prefetch, None if wanted is None else lambda: wanted) == size


def test_query_parameters_keep_blanks_and_the_last_of_repeats() -> None:
    assert parse_params("redis://h/0?a=1&b=&a=2") == {"a": "2", "b": ""}
    assert parse_params("sql://") == {}


def test_a_backend_publishes_or_claims_directly_never_both_nor_neither() -> None:
    direct = replace(MemoryBroker.capabilities, direct_claim=True)
    with pytest.raises(TypeError, match="direct_claim=True must not be a PublishingBroker"):
        type("Both", (MemoryBroker,), {"capabilities": direct})
    with pytest.raises(TypeError, match="direct_claim=False must be a PublishingBroker"):
        type("Neither", (Broker,), {"capabilities": MemoryBroker.capabilities})
    type("Claims", (Broker,), {"capabilities": direct})  # the sql:// shape


class Flaky(PublishingBroker):
    capabilities = MemoryBroker.capabilities

    def __init__(self, failure: Exception, stop: asyncio.Event, fail_times: int) -> None:
        self.failure, self.stop, self.left, self.opened = failure, stop, fail_times, 0

    async def open(self) -> None:
        self.opened += 1
        if self.left:
            self.left -= 1
            if not self.left:
                self.stop.set()  # stopped while it waits to retry
            raise self.failure

    def consume(self, queues: Sequence[str], prefetch: int, wanted: Any = None
                ) -> AsyncIterator[Delivery]:
        raise NotImplementedError

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        return []


async def test_a_broker_down_at_start_is_retried_until_stopped() -> None:
    stop = asyncio.Event()
    down = Flaky(BrokerError("refused"), stop, fail_times=1)
    assert await asyncio.wait_for(open_broker(down, stop), 10) is False
    assert down.opened == 1
    up = Flaky(BrokerError("refused"), asyncio.Event(), fail_times=0)
    assert await open_broker(up, asyncio.Event()) is True


async def test_a_misconfigured_broker_is_not_retried() -> None:
    stop = asyncio.Event()
    bad = Flaky(ConfigurationError("broker_url: no"), stop, fail_times=5)
    with pytest.raises(ConfigurationError):
        await open_broker(bad, stop)
    assert bad.opened == 1
    stop.set()
    assert await open_broker(Flaky(BrokerError("x"), stop, 0), stop) is False
