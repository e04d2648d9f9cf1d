"""duebox.brokers.memory, the real in-process broker: what is published is
delivered, a delayed message only after one published later without delay,
a deferred one comes back, garbage becomes a rejectable delivery, and one
URL name is one broker."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

import duebox
from duebox.brokers.base import Delivery, Outgoing
from duebox.brokers.memory import MemoryBroker, reset_hubs
from duebox.message import JobMessage
from duebox.states import Discard

DEADLINE = 10.0  # seconds: an event, waited for generously


def message(queue: str = "default", n: int = 0) -> JobMessage:
    return JobMessage(job_id=uuid.UUID(int=n + 1), task="t", queue=queue, version=1,
                      attempt=0, due_at=datetime(2030, 1, 1, tzinfo=UTC), payload={"n": n})


def broker(app: duebox.Duebox, url: str | None = None) -> MemoryBroker:
    made = app.broker_at(url or app.settings.broker_url)
    assert isinstance(made, MemoryBroker)
    return made


async def take(deliveries: AsyncIterator[Delivery], n: int) -> list[Delivery]:
    async def collect() -> list[Delivery]:
        return [await anext(deliveries) for _ in range(n)]

    return await asyncio.wait_for(collect(), DEADLINE)


def payloads(deliveries: list[Delivery]) -> list[Any]:
    return [d.message.payload if d.message else d.decode_error for d in deliveries]


async def test_what_the_relay_publishes_the_worker_of_the_same_url_receives(
        app: duebox.Duebox) -> None:
    relay, worker = broker(app), broker(app)
    results = await relay.publish([Outgoing(message(n=1), 0.0), Outgoing(message(n=2), 0.0)])
    assert [(r.job_id, r.ok) for r in results] == [(uuid.UUID(int=2), True),
                                                   (uuid.UUID(int=3), True)]
    assert len({r.broker_message_id for r in results}) == 2
    got = await take(worker.consume(["default"], prefetch=10), 2)
    assert [d.message for d in got] == [message(n=1), message(n=2)]


async def test_a_delayed_message_comes_after_one_published_later_without_delay(
        app: duebox.Duebox) -> None:
    b = broker(app)
    await b.publish([Outgoing(message(n=1), 0.05)])
    await b.publish([Outgoing(message(n=2), 0.0)])
    assert payloads(await take(b.consume(["default"], 10), 2)) == [{"n": 2}, {"n": 1}]


async def test_a_deferred_message_comes_back(app: duebox.Duebox) -> None:
    b = broker(app)
    await b.publish([Outgoing(message(n=1), 0.0)])
    stream = b.consume(["default"], 10)
    [first] = await take(stream, 1)
    assert await b.defer(first, 0.05) is True
    await b.publish([Outgoing(message(n=2), 0.0)])
    assert payloads(await take(stream, 2)) == [{"n": 2}, {"n": 1}]


async def test_garbage_is_a_delivery_with_the_reason_and_consumption_goes_on(
        app: duebox.Duebox) -> None:
    b = broker(app)
    await b.inject("default", b"\xff not json")
    await b.inject("default", b"[" * 5000)
    await b.publish([Outgoing(message(n=3), 0.0)])
    bad, deep, good = await take(b.consume(["default"], 10), 3)
    assert bad.message is None
    assert bad.decode_reason == Discard.UNDECODABLE
    assert deep.message is None
    assert deep.decode_reason == Discard.TOO_DEEP
    assert good.message == message(n=3)
    assert await b.defer(bad, 1.0) is True  # nothing to put back


async def test_one_consumer_over_several_queues(app: duebox.Duebox) -> None:
    b = broker(app)
    await b.publish([Outgoing(message("a", 1), 0.0), Outgoing(message("b", 2), 0.0),
                     Outgoing(message("c", 3), 0.0)])
    got = await take(b.consume(["a", "b"], 10), 2)
    assert sorted(d.message.queue for d in got if d.message) == ["a", "b"]
    [other] = await take(b.consume(["c"], 10), 1)
    assert other.message == message("c", 3)


async def test_another_name_is_another_broker(app: duebox.Duebox, memory_url: str) -> None:
    mine, theirs = broker(app), broker(app, memory_url + "x")
    await theirs.publish([Outgoing(message(n=9), 0.0)])
    await mine.publish([Outgoing(message(n=1), 0.0)])
    assert payloads(await take(mine.consume(["default"], 10), 1)) == [{"n": 1}]
    assert mine.hub is not theirs.hub
    assert mine.hub.published == theirs.hub.published == 1


def test_reset_forgets_every_hub(app: duebox.Duebox) -> None:
    before = broker(app).hub
    reset_hubs()
    assert broker(app).hub is not before


def test_it_says_what_it_is() -> None:
    caps = MemoryBroker.capabilities
    assert (caps.name, caps.max_delay, caps.durability, caps.direct_claim) == (
        "memory", None, "none", False)


@pytest.mark.parametrize("url", ["memory://", "memory://name?max_delay=5"])
def test_any_memory_url_makes_a_broker(app: duebox.Duebox, url: str) -> None:
    assert broker(app, url).max_delay == (5.0 if "max_delay" in url else None)
