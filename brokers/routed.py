"""Several routes' brokers acting as one (docs/brokers.md, "Routing"): a
worker whose queues are routed to more than one backend consumes them
through :class:`RoutedBroker`; a relay, which runs a pipeline per route's
broker (relay/pipeline.py), hands a dead worker's messages on through each
of them with :func:`hand_on`.

Each route's broker is consumed by a task of its own, which opens it (with
backoff while it is unreachable) and feeds its deliveries into one inbox
the worker reads, so all routes share the worker's executors and limits.  A
broker that is down or slow only stops its own feed: its task retries with
backoff while the others keep delivering.  Each delivery remembers its
broker, which then acks, rejects or defers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from duebox.credentials import redacted
from duebox.errors import ConfigurationError, DueboxError
from duebox.observability.logs import CollapsedLog, kind_of

from .base import Broker, BrokerContext, Capabilities, Delivery, Durability, Ordering

if TYPE_CHECKING:
    from duebox.leases.recovery import EnqueuedRef

log = logging.getLogger("duebox.broker")

# The key in Delivery.extra naming the route a delivery came from.
_ROUTE = "duebox-route"
# How long a takeover waits for one route's broker to hand on a dead
# worker's messages: a broker that is down must not hold up the others.
_TAKE_OVER_SECONDS = 10.0


@dataclass(frozen=True)
class HandedOn:
    """What :func:`hand_on` did: messages handed on, and the brokers that
    could not (down, failing over, slow) — their share is still pending."""

    handed: int = 0
    failed: tuple[Broker, ...] = ()


async def hand_on(brokers: Sequence[Broker], worker: str, info: Mapping[str, Any], *,
                  quiet: bool = False) -> HandedOn:
    """:meth:`Broker.take_over` on each route's broker.  One that is down or
    slow is logged (at DEBUG if ``quiet``: a try again) and reported in
    ``failed``; the others still hand on theirs (the relay tries the failed
    ones again, relay/recovering.py)."""
    handed = 0
    failed: list[Broker] = []
    for b in brokers:
        try:
            handed += await asyncio.wait_for(b.take_over(worker, info), _TAKE_OVER_SECONDS)
        except Exception as exc:  # down or slow: tried again later, else its redelivery
            failed.append(b)
            log.log(logging.DEBUG if quiet else logging.WARNING,
                    "route %s could not hand on worker %s's messages (%s: %s)",
                    b.capabilities.name, worker, type(exc).__name__, exc)
    return HandedOn(handed, tuple(failed))


def _combined(brokers: Sequence[Broker]) -> Capabilities:
    """What holds across every route: the weakest of each promise."""
    caps = [b.capabilities for b in brokers]
    limits = [c.payload_limit for c in caps if c.payload_limit is not None]
    return Capabilities(
        name="+".join(c.name for c in caps),
        max_delay=None,
        delay_precision=max(c.delay_precision for c in caps),
        cancel=all(c.cancel for c in caps),
        ordering=Ordering.NONE,
        ordering_note="each route's own (see its backend)",
        durability=Durability.NONE if any(c.durability is Durability.NONE for c in caps)
        else Durability.BROKER,
        durability_note="each route's own (see its backend)",
        payload_limit=min(limits) if limits else None,
        redelivers_unacked=all(c.redelivers_unacked for c in caps),
        in_flight_after_cancel="each route's own (see its backend)",
        # Some route's workers claim rows themselves: never published to.
        direct_claim=True,
    )


class RoutedBroker(Broker):
    """The brokers of several routes behind one consumer; built by
    ``Duebox.broker(queues=...)`` when the queues span several routes."""

    def __init__(self, parts: Sequence[tuple[Broker, Sequence[str]]],
                 context: BrokerContext) -> None:
        if len(parts) < 2:
            raise ConfigurationError("broker_routes: a routed consumer needs two routes or more")
        self.parts = [(b, list(qs)) for b, qs in parts]
        self.capabilities = _combined([b for b, _ in self.parts])
        self._registry_changed: Callable[[], None] | None = None
        super().__init__("routes://", context)
        self.url = " + ".join(redacted(b.url) for b, _ in self.parts)
        self._opened = [False] * len(self.parts)
        self._log = CollapsedLog(log)

    # The worker tells its broker how to poke the registry; each route's
    # broker must know (Kafka's member id changes on a rebalance).
    @property
    def registry_changed(self) -> Callable[[], None] | None:
        return self._registry_changed

    @registry_changed.setter
    def registry_changed(self, poke: Callable[[], None] | None) -> None:
        self._registry_changed = poke
        for b, _ in getattr(self, "parts", ()):
            b.registry_changed = poke

    def broker_for(self, queue: str) -> Broker:
        for b, qs in self.parts:
            if queue in qs:
                return b
        return self.parts[0][0]

    async def open(self) -> None:
        """Nothing here: each route's feed opens its own broker, so one that
        is unreachable does not keep the others from starting."""

    async def close(self) -> None:
        for b, _ in self.parts:
            with contextlib.suppress(Exception):
                await b.close()

    async def consume(self, queues: Sequence[str], prefetch: int,
                      wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        # One slot: a feed hands over a delivery only as the worker takes
        # one, so each route's own prefetch still bounds what it holds.
        inbox: asyncio.Queue[Delivery | ConfigurationError] = asyncio.Queue(maxsize=1)
        wanted_queues = set(queues)
        feeds = [asyncio.create_task(self._feed(i, b, [q for q in qs if q in wanted_queues],
                                                prefetch, wanted, inbox),
                                     name=f"duebox-route-{b.capabilities.name}")
                 for i, (b, qs) in enumerate(self.parts)
                 if any(q in wanted_queues for q in qs)]
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, ConfigurationError):
                    raise item
                yield item
        finally:
            for t in feeds:
                t.cancel()
            await asyncio.gather(*feeds, return_exceptions=True)

    async def _feed(self, index: int, broker: Broker, queues: list[str], prefetch: int,
                    wanted: Callable[[], int] | None,
                    inbox: asyncio.Queue[Delivery | ConfigurationError]) -> None:
        """Consume one route for good: an outage of its broker is logged and
        retried after a jittered backoff; a configuration error ends the
        worker (it would fail the same way every time)."""
        backoff = 0.2
        name = broker.capabilities.name
        while True:
            try:
                if not self._opened[index]:
                    await broker.open()
                    self._opened[index] = True
                async for delivery in broker.consume(queues, prefetch, wanted):
                    delivery.extra[_ROUTE] = index
                    await inbox.put(delivery)
                    backoff = 0.2
            except ConfigurationError as exc:
                await inbox.put(exc)
                return
            except Exception as exc:
                wait = backoff * (0.5 + random.random())
                self._log.warning(f"route:{index}:{kind_of(exc)}",
                                  "route %s (%s) failed (%s: %s); retrying in %.1fs", name,
                                  redacted(broker.url), type(exc).__name__, exc, wait,
                                  exc_info=not isinstance(exc, DueboxError))
                await asyncio.sleep(wait)
                backoff = min(backoff * 2, 10.0)

    def _of(self, delivery: Delivery) -> Broker:
        return self.parts[int(delivery.extra.get(_ROUTE, 0))][0]

    async def ack(self, delivery: Delivery) -> None:
        await self._of(delivery).ack(delivery)

    def release(self, delivery: Delivery) -> None:
        self._of(delivery).release(delivery)

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        by_route: dict[int, list[Delivery]] = {}
        for d in deliveries:
            by_route.setdefault(int(d.extra.get(_ROUTE, 0)), []).append(d)
        await asyncio.gather(*(self.parts[i][0].ack_many(ds) for i, ds in by_route.items()))

    async def reject(self, delivery: Delivery, reason: str) -> None:
        await self._of(delivery).reject(delivery, reason)

    async def defer(self, delivery: Delivery, seconds: float) -> bool:
        return await self._of(delivery).defer(delivery, seconds)

    async def hand_back(self, delivery: Delivery) -> bool:
        return await self._of(delivery).hand_back(delivery)

    def wanted_changed(self) -> None:
        for b, _ in self.parts:
            b.wanted_changed()

    async def cancel(self, job_ids: Sequence[uuid.UUID]) -> int:
        return sum([await b.cancel(job_ids) for b, _ in self.parts])

    async def take_over(self, worker: str, info: Mapping[str, Any]) -> int:
        # A part that failed is logged; its own redelivery covers it.
        return (await hand_on([b for b, _ in self.parts], worker, info)).handed

    def registry_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for b, _ in self.parts:
            info.update(b.registry_info())
        return info

    def locate(self, job: EnqueuedRef, now: datetime) -> str:
        return self.broker_for(job.queue).locate(job, now)


__all__ = ["HandedOn", "RoutedBroker", "hand_on"]
