"""One relay, several brokers: a lane per publishing route.

With ``broker_routes`` (docs/brokers.md, "Routing") a relay runs one *lane*
per route whose broker it publishes to: a relay of its own in the same
process, with its broker, claim pipeline, ceiling (``max_delay``, hold
window, parking), held jobs, refusals, backpressure and reconciliation, and
claims that carry the route's queue condition (``Route.where``: its queues,
or for the default route every queue not routed elsewhere).  Each lane runs
as its own task: a broker that is slow or down stalls only its own lane,
whose jobs wait in the database (``SCHEDULED``) meanwhile.

What is the process's, not a route's, stays with the relay itself:
recovery and the takeover of dead processes, schedules, the expiry of
too-late jobs, its registry row and liveness lock.  Its own broker is
:class:`LanesBroker`, which publishes nothing (like ``sql://``) and hands a
dead worker's received messages on through every lane's broker.  A route on
``sql://`` gets no lane: its workers claim its rows themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from duebox.brokers.base import Broker, Delivery, PublishingBroker
from duebox.db import PgWaker
from duebox.errors import ConfigurationError
from duebox.routes import Route, describe
from duebox.seam import BrokerContext, Capabilities, Durability, Ordering

from .stats import PassStats, RelayMetrics

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.relay")

# How long a takeover waits for one route's broker to hand on a dead
# worker's messages: a broker that is down must not hold up the others.
_TAKE_OVER_SECONDS = 10.0
# How long a stopping relay waits for its lanes to finish by themselves.
_STOP_GRACE_SECONDS = 10.0


class Lane(Protocol):
    """What the relay's lanes are (a Relay, for one route's broker)."""

    broker: Broker
    observe: RelayMetrics

    async def run(self, stop: asyncio.Event | None = None,
                  waker: PgWaker | None = None) -> None: ...

    async def run_pass(self) -> PassStats: ...


class LanesBroker(Broker):
    """The broker of a relay whose lanes publish: it publishes nothing itself
    (``direct_claim``, as ``sql://`` declares), and hands a dead worker's
    received messages on through each lane's broker."""

    capabilities = Capabilities(
        name="routes", max_delay=None, delay_precision=0.001, cancel=False,
        ordering=Ordering.NONE, durability=Durability.DATABASE, payload_limit=None,
        redelivers_unacked=True, in_flight_after_cancel="each route's own", direct_claim=True,
    )

    def __init__(self, context: BrokerContext, brokers: Sequence[Broker]) -> None:
        super().__init__("routes://", context)
        self.brokers = list(brokers)

    async def consume(self, queues: Sequence[str], prefetch: int,
                      wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        raise ConfigurationError("broker_url: a relay's routes are not consumed; start a "
                                 "worker (it consumes each route's broker)")
        yield  # pragma: no cover - an async generator that yields nothing

    async def take_over(self, worker: str, info: Mapping[str, Any]) -> int:
        handed = 0
        for b in self.brokers:
            try:
                handed += await asyncio.wait_for(b.take_over(worker, info), _TAKE_OVER_SECONDS)
            except Exception as exc:  # down or slow: its redelivery covers them
                log.warning("route %s could not hand on worker %s's messages (%s: %s); its "
                            "own redelivery will", b.capabilities.name, worker,
                            type(exc).__name__, exc)
        return handed


class RelayLanes:
    """The lanes of one relay, built by ``make(route, broker)`` for each
    route the relay publishes to."""

    def __init__(self, app: Duebox, name: str,
                 make: Callable[[Route, Broker], Lane]) -> None:
        self.routes = app.routes.all()
        self.lanes: list[Lane] = []
        self._published: list[Route] = []
        for route in self.routes:
            broker = app.broker_at(route.url, name)
            if isinstance(broker, PublishingBroker):
                self.lanes.append(make(route, broker))
                self._published.append(route)
        self.broker = LanesBroker(BrokerContext(app.engine, app.clock, app.settings, name),
                                  [lane.broker for lane in self.lanes])
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def info(self, own: Callable[[], dict[str, object]]) -> dict[str, object]:
        """The relay's registry row figures (``own``) with its lanes': their
        sums, and each route's under ``routes``."""
        info = own()
        lanes = []
        for route, lane in zip(self._published, self.lanes, strict=True):
            figures = lane.observe.info()
            for k in ("claimed", "published", "errors"):
                info[k] = _count(info.get(k)) + _count(figures.get(k))
            lanes.append({"route": route.label, "queues": list(route.queues) or "(default)",
                          **{k: figures.get(k) for k in ("backend", "claimed", "published",
                                                         "errors")}})
        info["routes"] = lanes
        return info

    def describe(self) -> str:
        return "; ".join(describe(self.routes))

    def start(self, waker: PgWaker) -> None:
        """Each lane runs as a task of its own until :meth:`stop`, woken by
        the relay's ``waker``: lanes open no database connection of their
        own, whatever their number (docs/brokers.md, "Routing")."""
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(lane.run(self._stop, waker.follower()),
                                           name=f"duebox-relay-lane-{lane.broker.capabilities.name}")
                       for lane in self.lanes]

    def check(self) -> None:
        """Raise what ended a lane (a configuration error: the others would
        meet it too)."""
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]

    async def stop(self) -> None:
        """Stop every lane: each flushes its marks and gives its held jobs
        back; one still connecting to an unreachable broker (nothing of it
        to give back) is cancelled after a grace period."""
        self._stop.set()
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=_STOP_GRACE_SECONDS)
            for t in late:
                t.cancel()
            for t in self._tasks:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await t
        self._tasks = []

    async def run_pass(self, stats: PassStats) -> None:
        """One pass of every lane in turn (a relay driven pass by pass, as
        tests do; :meth:`start` runs them side by side instead)."""
        for lane in self.lanes:
            got = await lane.run_pass()
            for f in dataclasses.fields(PassStats):
                setattr(stats, f.name, getattr(stats, f.name) + getattr(got, f.name))


def _count(value: object) -> int:
    return value if isinstance(value, int) else 0


__all__ = ["Lane", "LanesBroker", "RelayLanes"]
