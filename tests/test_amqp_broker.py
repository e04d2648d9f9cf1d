"""The ``amqp://`` backend: its topology as data, the plugin path against a
fake pika connection, and the tier topology against a real RabbitMQ.

The real-broker tests run in a vhost of their own (the ``amqp_vhost``
fixture of ``conftest.py``: created with ``rabbitmqctl``, deleted at the
end); each test uses its own duebox queue names, or its own ``?prefix=`` when
it looks at shared objects.  Under ``CI=true`` an unreachable RabbitMQ fails
them instead of skipping them.  Delays, cancel, reschedule, parking and the
broker restart end to end are clauses of the shared contract
(``tests/contract/``); this file keeps what is specific to this backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import pika
import pika.exceptions
import pika.frame
import pika.spec
import pytest
from backends import rabbitmqctl
from conftest import reset_tables
from helpers import (
    check_no_early_start,
    create_effects,
    effect_rows,
    effect_values,
    effects,
    job_row,
    schedule_committed,
)

import duebox
from duebox.brokers import amqp_link, amqp_pack
from duebox.brokers.amqp import AMQPBroker
from duebox.brokers.amqp_settings import AMQPSettings
from duebox.brokers.amqp_topology import (
    LEVELS,
    MAX_DELAY_MS,
    ExchangeBind,
    ExchangeDecl,
    QueueBind,
    QueueDecl,
    Topology,
    delay_ms,
    tier_key,
)
from duebox.brokers.base import Delivery, Outgoing
from duebox.consumers import Worker
from duebox.errors import ConfigurationError, ValidationError
from duebox.message import JobMessage
from duebox.registry import broker_class
from duebox.relay import Relay

PROCS = Path(__file__).parent / "procs"


# --- fixtures and helpers ------------------------------------------------------


@pytest.fixture
def amqp_url(amqp_vhost: str) -> str:
    """The shared test vhost with the default topology (prefix ``duebox``)."""
    return amqp_vhost


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A migrated SQLite file, for tests that are about the broker only."""
    url = f"sqlite:///{tmp_path}/duebox.db"
    reset_tables(url)
    return url


async def until(predicate: Callable[[], Any], *, seconds: float, what: str,
                interval: float = 0.05, check: Callable[[], None] | None = None) -> Any:
    """Poll ``predicate`` (in a thread: it may query the database) until it
    returns something truthy; fail naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        if check is not None:
            check()
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds}s waiting for {what}")
        await asyncio.sleep(interval)


def unique(stem: str = "q") -> str:
    return f"{stem}{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def admin(url: str) -> Iterator[Any]:
    """A plain blocking pika channel on the test vhost, for looking and meddling."""
    conn = pika.BlockingConnection(pika.URLParameters(url.split("?")[0]))
    try:
        yield conn.channel()
    finally:
        conn.close()


def message_count(url: str, queue: str) -> int:
    with admin(url) as ch:
        return int(ch.queue_declare(queue, passive=True).method.message_count)


MakeApp = Callable[..., duebox.Duebox]


@pytest.fixture
def make_app() -> Iterator[MakeApp]:
    """:func:`amqp_app`, with every app's engine disposed of at teardown."""
    made: list[duebox.Duebox] = []

    def make(database_url: str, broker_url: str, queue: str, **settings: Any) -> duebox.Duebox:
        made.append(amqp_app(database_url, broker_url, queue, **settings))
        return made[-1]

    yield make
    for app in made:
        app.dispose()


def amqp_app(database_url: str, broker_url: str, queue: str, **settings: Any) -> duebox.Duebox:
    """An app whose ``effect`` task (on ``queue``) writes one effects row
    through ``ctx.session``: the primary key makes every effect countable."""
    values: dict[str, Any] = {"poll_interval": 0.1, "lease_seconds": 5.0,
                              "clock_skew_margin": 0.2, "batch_size": 100}
    values.update(settings)
    app = duebox.Duebox(database_url, broker_url, settings=duebox.Settings(**values))

    @app.task("effect", queue=queue)
    def effect(payload: Any, ctx: duebox.JobContext) -> None:
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    create_effects(app.engine)
    return app


def message(queue: str, delay: float = 0.0, **kw: Any) -> JobMessage:
    return JobMessage(job_id=uuid.uuid4(), task="effect", queue=queue, version=1, attempt=0,
                      due_at=datetime.now(UTC) + timedelta(seconds=delay), payload=kw)


def broker(url: str, name: str = "test") -> AMQPBroker:
    b = duebox.Duebox(database_url="sqlite://", broker_url=url).broker(name)
    assert isinstance(b, AMQPBroker)
    return b


class Collector:
    """Consumes with ``broker.consume`` in the background, acking everything."""

    @classmethod
    async def ready(cls, b: AMQPBroker, pub: AMQPBroker, queue: str) -> Collector:
        """Start consuming, and return once a first message went through."""
        self = cls(b, [queue])
        [r] = await pub.publish([Outgoing(message(queue), 0.0)])
        assert r.ok, r
        await self.wait(1, within=15)
        self.got.clear()
        return self

    def __init__(self, b: AMQPBroker, queues: list[str]) -> None:
        self.broker = b
        self.got: list[tuple[float, Delivery]] = []
        self.task = asyncio.create_task(self._run(queues))

    async def _run(self, queues: list[str]) -> None:
        async for d in self.broker.consume(queues, 50):
            self.got.append((time.time(), d))
            await self.broker.ack(d)

    async def wait(self, n: int, within: float) -> list[tuple[float, Delivery]]:
        await until(lambda: len(self.got) >= n or self.task.done(), seconds=within,
                    what=f"{n} deliveries", interval=0.01)
        if self.task.done():
            self.task.result()
        return self.got

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.broker.close()


async def start(*parts: Relay | Worker) -> tuple[asyncio.Event, list[asyncio.Task[None]]]:
    """Run relays and workers; return once each is connected (and each worker
    consuming), so a test's timings do not include their start-up."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(p.run(stop)) for p in parts]

    def ready() -> bool:
        relays = [pl.broker for p in parts if isinstance(p, Relay) for pl in p.pipelines]
        workers = [p for p in parts if not isinstance(p, Relay)]
        return (all(b._link is not None for b in relays)  # type: ignore[attr-defined]
                and all(w.broker._link is not None  # type: ignore[attr-defined]
                        and set(w.queues) <= w.broker._declared  # type: ignore[attr-defined]
                        for w in workers))

    await until(ready, seconds=20, what="relays and workers connected", check=alive(tasks))
    return stop, tasks


async def finish(stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
    stop.set()
    for r in await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30):
        if isinstance(r, BaseException):
            raise r


def alive(tasks: list[asyncio.Task[None]]) -> Callable[[], None]:
    def check() -> None:
        for t in tasks:
            if t.done():
                t.result()
                raise AssertionError("a relay or worker stopped on its own")
    return check


def state(app: duebox.Duebox, job_id: uuid.UUID) -> str:
    return str(job_row(app.engine, job_id).state)


# --- configuration ---------------------------------------------------------------


def test_registry_maps_amqp_and_amqps() -> None:
    assert broker_class("amqp://h/") is AMQPBroker
    assert broker_class("amqps://h/") is AMQPBroker
    b = broker("amqps://u:p@example.com/vh?heartbeat=5&prefix=app&max_delay=60")
    assert b.pika_params.ssl_options is not None
    assert b.pika_params.port == 5671
    assert b.pika_params.heartbeat == 5
    assert b.pika_params.virtual_host == "vh"
    assert b.topology.prefix == "app"
    assert b.max_delay == 60
    assert b.capabilities.max_delay == MAX_DELAY_MS / 1000 == 4294967.295
    assert b.capabilities.delay_precision == 0.001


@pytest.mark.parametrize(("query", "field"), [
    ("delay_mode=sometimes", "delay_mode"),
    ("queue_type=stream", "queue_type"),
    ("prefix=a%20b", "prefix"),
    ("confirm_timeout=-1", "confirm_timeout"),
    ("max_delay=5000000", "max_delay"),
    ("frobnicate=1", "frobnicate"),
    ("tier_base=1", "tier_base"),
    ("tier_base=17", "tier_base"),
    ("tier_base=2.5", "tier_base"),
    ("tier_precision=0", "tier_precision"),
    ("tier_precision=0.0015", "tier_precision"),
    ("tier_precision=61", "tier_precision"),
    ("tier_precision=nan", "tier_precision"),
])
def test_bad_url_parameters_name_the_field(query: str, field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        broker(f"amqp://h/?{query}")


# --- the topology as data ----------------------------------------------------------


def test_delays_become_milliseconds_rounded_up_and_capped() -> None:
    assert delay_ms(0) == 0
    assert delay_ms(-1) == 0
    assert delay_ms(0.0001) == 1
    assert delay_ms(0.001) == 1
    assert delay_ms(1.0) == 1000
    assert delay_ms(0.4161) == 417
    assert delay_ms(10**9) == MAX_DELAY_MS == 2**32 - 1
    assert tier_key(0x1A0) == "0.0.0.0.0.1.a.0"
    assert tier_key(MAX_DELAY_MS) == ".".join("f" * LEVELS)


def _topic_match(pattern: str, key: str) -> bool:
    """AMQP topic matching: ``*`` is one word, ``#`` zero or more."""
    def match(p: list[str], k: list[str]) -> bool:
        if not p:
            return not k
        if p[0] == "#":
            return any(match(p[1:], k[i:]) for i in range(len(k) + 1))
        return bool(k) and p[0] in ("*", k[0]) and match(p[1:], k[1:])
    return match(pattern.split("."), key.split("."))


def simulate(ops: list[Any], exchange: str, key: str) -> tuple[list[str], int]:
    """Follow a message through declared exchanges, bindings and dead-letter
    queues (a tiny topic router): the queues it stops in and the total TTL."""
    queues = {o.name: o for o in ops if isinstance(o, QueueDecl)}
    binds = [o for o in ops if isinstance(o, QueueBind | ExchangeBind)]
    path: list[str] = []
    ttl = 0
    while True:
        frontier, targets = [exchange], []
        while frontier:
            x = frontier.pop()
            for b in binds:
                src = b.exchange if isinstance(b, QueueBind) else b.source
                if src == x and _topic_match(b.routing_key, key):
                    if isinstance(b, QueueBind):
                        targets.append(b.queue)
                    else:
                        frontier.append(b.destination)
        assert len(targets) == 1, (exchange, key, targets)
        q = queues[targets[0]]
        path.append(q.name)
        if "x-message-ttl" not in q.arguments:
            return path, ttl
        ttl += q.arguments["x-message-ttl"]
        exchange = q.arguments["x-dead-letter-exchange"]


def test_tier_topology_routes_every_delay_through_its_digits() -> None:
    t = Topology()
    ops = t.base_ops() + t.tier_ops() + t.queue_ops("orders", plugin=False)
    tiers = [o for o in ops if isinstance(o, QueueDecl) and ".delay." in o.name]
    assert len(tiers) == LEVELS * 15  # bounded, whatever the delays
    assert {o.arguments["x-message-ttl"] for o in tiers} == {
        d * 16**j for j in range(LEVELS) for d in range(1, 16)}
    for o in tiers:
        long_wait = o.arguments["x-message-ttl"] >= 16**4
        assert (o.arguments.get("x-queue-mode") == "lazy") is long_wait
        assert (o.arguments.get("x-queue-version") == 2) is long_wait
    rng = random.Random(7)
    samples = [1, 15, 16, 0x1A0, 1000, 2047, 86_400_000, 30 * 86_400_000, MAX_DELAY_MS]
    for ms in samples + [rng.randrange(1, MAX_DELAY_MS) for _ in range(200)]:
        route = t.route("orders", ms / 1000, plugin=False)
        assert route.mandatory
        assert route.exchange == "duebox.delay.8"
        assert route.delay_ms == ms
        path, total = simulate(ops, route.exchange, route.routing_key)
        assert total == ms, ms
        assert path == [*t.stops(ms), "duebox.q.orders"]
        assert len(path) - 1 <= LEVELS


SHAPES = {  # URL options: tier queues they declare (docs/brokers.md, "How many tier queues")
    "": 120,
    "tier_base=2&tier_precision=1": 23,
    "tier_base=4&tier_precision=1": 34,
    "tier_precision=0.1": 92,
    "max_delay=3600": 78,
    "tier_base=16&tier_precision=1&max_delay=86400": 61,
}


@pytest.mark.parametrize("query", list(SHAPES))
def test_a_chosen_tier_shape_routes_every_delay_never_early_within_one_unit(query: str) -> None:
    t = AMQPSettings.from_url(f"amqp://h/?{query}").topology
    unit = t.tiers.precision_ms
    ops = t.base_ops() + t.tier_ops() + t.queue_ops("orders", plugin=False)
    tiers = [o for o in ops if isinstance(o, QueueDecl) and ".delay" in o.name]
    assert len(tiers) == SHAPES[query]
    # Its own names: two shapes under one prefix never share a queue.
    assert all(o.name.startswith("duebox.delay.") == (query == "") for o in tiers)
    longest = t.tiers.ceiling_ms / 1000
    rng = random.Random(11)
    for seconds in [0.001, 0.999, 1.0, 1.001, 59.5, longest, *(
            rng.uniform(0.001, longest) for _ in range(100))]:
        ms = delay_ms(seconds)
        route = t.route("orders", seconds, plugin=False)
        path, total = simulate(ops, route.exchange, route.routing_key)
        assert ms <= total < ms + unit, (query, seconds, total)  # never early
        assert total == route.delay_ms
        assert path == [*t.stops(ms), "duebox.q.orders"]
        assert len(path) - 1 <= t.tiers.levels
    assert all(o.arguments["x-message-ttl"] <= MAX_DELAY_MS for o in tiers)  # RabbitMQ's most
    if "max_delay" in query:  # beyond it: refused, never cut short
        with pytest.raises(ValidationError, match="max_delay"):
            t.route("orders", longest + unit / 1000, plugin=False)


def test_immediate_route_is_mandatory_on_the_direct_exchange() -> None:
    t = Topology(prefix="app")
    for plugin in (False, True):
        r = t.route("orders", 0.0, plugin)
        assert (r.exchange, r.routing_key, r.mandatory, r.headers) == (
            "app.direct", "orders", True, {})


def test_plugin_declarations_and_headers() -> None:
    t = Topology()
    assert t.plugin_ops() == [ExchangeDecl("duebox.delayed", "x-delayed-message",
                                           {"x-delayed-type": "direct"})]
    assert QueueBind("duebox.q.orders", "duebox.delayed", "orders") in t.queue_ops(
        "orders", plugin=True)
    r = t.route("orders", 2.5001, plugin=True)
    assert (r.exchange, r.routing_key, r.headers, r.mandatory) == (
        "duebox.delayed", "orders", {"x-delay": 2501}, False)


def test_queue_names_that_cannot_work_are_refused() -> None:
    t = Topology()
    for bad in ("a.#", "*", "x" * 250):
        with pytest.raises(ValidationError, match="queue"):
            t.route(bad, 1.0, plugin=False)
    assert t.route("a.b-c:d", 1.0, plugin=False).routing_key.endswith(".a.b-c:d")


def test_quorum_arguments() -> None:
    t = Topology(queue_type="quorum")
    tier = next(o for o in t.tier_ops() if isinstance(o, QueueDecl))
    assert tier.arguments["x-queue-type"] == "quorum"
    assert tier.arguments["x-dead-letter-strategy"] == "at-least-once"
    assert tier.arguments["x-overflow"] == "reject-publish"
    assert "x-queue-mode" not in tier.arguments
    q = t.queue_ops("orders", plugin=False)[0]
    assert isinstance(q, QueueDecl)
    assert q.arguments["x-queue-type"] == "quorum"


# --- the plugin path against a fake pika connection ----------------------------------


class FakeChannel:
    def __init__(self, conn: FakeConnection, number: int) -> None:
        self.conn = conn
        self.number = number
        self.is_open = True
        self.close_callbacks: list[Callable[..., Any]] = []
        self.return_callbacks: list[Callable[..., Any]] = []
        self.confirm: Callable[..., Any] | None = None
        self.tag = 0

    def _reply(self, callback: Callable[..., Any] | None, method: Any = None) -> None:
        if callback is not None:
            self.conn.loop.call_soon(callback, pika.frame.Method(self.number, method))

    def add_on_close_callback(self, cb: Callable[..., Any]) -> None:
        self.close_callbacks.append(cb)

    def add_on_return_callback(self, cb: Callable[..., Any]) -> None:
        self.return_callbacks.append(cb)

    def add_on_cancel_callback(self, cb: Callable[..., Any]) -> None:
        pass

    def exchange_declare(self, exchange: str, exchange_type: str, durable: bool = False,
                         internal: bool = False, arguments: Any = None,
                         callback: Any = None) -> None:
        self.conn.calls.append(("exchange_declare", exchange, exchange_type, durable, internal,
                                arguments))
        if exchange_type == "x-delayed-message" and not self.conn.plugin:
            self.conn.loop.call_soon(self.conn.kill, 503,
                                     "COMMAND_INVALID - unknown exchange type "
                                     "'x-delayed-message'")
            return
        self._reply(callback)

    def queue_declare(self, queue: str, durable: bool = False, arguments: Any = None,
                      callback: Any = None) -> None:
        self.conn.calls.append(("queue_declare", queue, durable, arguments))
        self._reply(callback)

    def queue_bind(self, queue: str, exchange: str, routing_key: str,
                   callback: Any = None) -> None:
        self.conn.calls.append(("queue_bind", queue, exchange, routing_key))
        self._reply(callback)

    def exchange_bind(self, destination: str, source: str, routing_key: str,
                      callback: Any = None) -> None:
        self.conn.calls.append(("exchange_bind", destination, source, routing_key))
        self._reply(callback)

    def confirm_delivery(self, ack_nack_callback: Any, callback: Any = None) -> None:
        self.confirm = ack_nack_callback
        self._reply(callback)

    def basic_publish(self, exchange: str, routing_key: str, body: bytes, properties: Any,
                      mandatory: bool = False) -> None:
        self.tag += 1
        self.conn.calls.append(("basic_publish", exchange, routing_key, properties, mandatory))
        outcome = self.conn.outcomes.pop(0) if self.conn.outcomes else "ack"
        if outcome == "return":
            for cb in self.return_callbacks:
                self.conn.loop.call_soon(cb, self, pika.spec.Basic.Return(
                    312, "NO_ROUTE", exchange, routing_key), properties, body)
        method = (pika.spec.Basic.Nack if outcome == "nack" else pika.spec.Basic.Ack)(
            delivery_tag=self.tag)
        assert self.confirm is not None
        self.conn.loop.call_soon(self.confirm, pika.frame.Method(self.number, method))

    def close(self) -> None:
        self.is_open = False


class FakeConnection:
    """Just enough of pika's AsyncioConnection for the broker's code paths."""

    instances: ClassVar[list[FakeConnection]] = []
    plugin: ClassVar[bool] = True
    outcomes: ClassVar[list[str]] = []

    def __init__(self, params: Any, on_open_callback: Any, on_open_error_callback: Any,
                 on_close_callback: Any, custom_ioloop: Any) -> None:
        self.loop = custom_ioloop
        self.on_close = on_close_callback
        self.calls: list[tuple[Any, ...]] = []
        self.channels: list[FakeChannel] = []
        self.is_open, self.is_closed, self.is_closing = True, False, False
        FakeConnection.instances.append(self)
        self.loop.call_soon(on_open_callback, self)

    def channel(self, on_open_callback: Any) -> None:
        ch = FakeChannel(self, len(self.channels) + 1)
        self.channels.append(ch)
        self.loop.call_soon(on_open_callback, ch)

    def kill(self, code: int, text: str) -> None:
        exc = pika.exceptions.ConnectionClosedByBroker(code, text)
        for ch in self.channels:
            ch.is_open = False
            for cb in ch.close_callbacks:
                cb(ch, exc)
        self.is_open, self.is_closed = False, True
        self.on_close(self, exc)

    def close(self) -> None:
        self.kill(200, "Normal shutdown")


@pytest.fixture
def fake_pika(monkeypatch: pytest.MonkeyPatch) -> type[FakeConnection]:
    FakeConnection.instances = []
    FakeConnection.plugin = True
    FakeConnection.outcomes = []
    monkeypatch.setattr(amqp_link, "Connection", FakeConnection)
    return FakeConnection


def all_calls(fake: type[FakeConnection]) -> list[tuple[Any, ...]]:
    return [c for conn in fake.instances for c in conn.calls]


async def test_plugin_path_declares_and_publishes_exactly_this(
        fake_pika: type[FakeConnection]) -> None:
    b = broker("amqp://guest:guest@rabbit.example/%2F")
    soon, later = message("orders"), message("orders", 2.5)
    results = await b.publish([Outgoing(soon, 0.0), Outgoing(later, 2.5)])
    assert [r.ok for r in results] == [True, True]
    assert b.plugin is True
    calls = all_calls(fake_pika)
    delayed = ("exchange_declare", "duebox.delayed", "x-delayed-message", True, False,
               {"x-delayed-type": "direct"})
    assert calls.count(delayed) == 2  # the probe connection, then the real one
    assert ("queue_declare", "duebox.q.orders", True,
            {"x-dead-letter-exchange": "duebox.dead-letter"}) in calls
    assert ("queue_bind", "duebox.q.orders", "duebox.delayed", "orders") in calls
    assert ("queue_bind", "duebox.q.orders", "duebox.direct", "orders") in calls
    assert not [c for c in calls if c[0] == "queue_declare" and ".delay." in c[1]]
    pubs = [c for c in calls if c[0] == "basic_publish"]
    (_, x0, k0, p0, m0), (_, x1, k1, p1, m1) = pubs
    assert (x0, k0, m0) == ("duebox.direct", "orders", True)
    assert "x-delay" not in p0.headers
    assert (x1, k1, m1) == ("duebox.delayed", "orders", False)
    assert isinstance(p1.headers["x-delay"], int)
    assert 2400 < p1.headers["x-delay"] <= 2500
    for props, msg in ((p0, soon), (p1, later)):
        assert props.delivery_mode == 2
        assert props.content_type == "application/json"
        assert props.message_id == str(msg.job_id)
        assert {k: v for k, v in props.headers.items() if k != "x-delay"} == msg.header_map()
    await b.close()


async def test_auto_mode_without_plugin_uses_tiers(fake_pika: type[FakeConnection]) -> None:
    fake_pika.plugin = False
    b = broker("amqp://guest:guest@rabbit.example/%2F")
    msg = message("orders", 0.416)
    [result] = await b.publish([Outgoing(msg, 0.416)])
    assert result.ok
    assert b.plugin is False
    calls = all_calls(fake_pika)
    assert len([c for c in calls if c[0] == "queue_declare" and ".delay." in c[1]]) == 120
    [pub] = [c for c in calls if c[0] == "basic_publish"]
    assert pub[1] == "duebox.delay.8"
    assert pub[4] is True
    assert pub[2].startswith("0.0.0.0.0.1.")
    assert pub[2].endswith(".orders")
    assert "x-delay" not in pub[3].headers
    await b.close()


async def test_forced_plugin_mode_without_plugin_is_a_clear_error(
        fake_pika: type[FakeConnection]) -> None:
    fake_pika.plugin = False
    b = broker("amqp://guest:guest@rabbit.example/%2F?delay_mode=plugin")
    with pytest.raises(duebox.BrokerError, match="rabbitmq_delayed_message_exchange"):
        await b.open()


async def test_returned_and_nacked_publishes_are_not_ok(fake_pika: type[FakeConnection]) -> None:
    b = broker("amqp://guest:guest@rabbit.example/%2F?delay_mode=tiers&pack=1")
    fake_pika.outcomes = ["ack", "return", "nack", "ack"]
    msgs = [message("orders") for _ in range(4)]
    results = await b.publish([Outgoing(m, 0.0) for m in msgs])
    assert [r.ok for r in results] == [True, False, False, True]
    assert "unroutable: 312 NO_ROUTE" in (results[1].error or "")
    assert "nack" in (results[2].error or "")
    assert [r.job_id for r in results] == [m.job_id for m in msgs]
    await b.close()


async def test_due_jobs_of_a_queue_share_a_message_and_its_confirm(
        fake_pika: type[FakeConnection]) -> None:
    """Five due jobs of ``orders``, two of ``mail``, one delayed, with
    ``pack=3``: messages of at most three due jobs per queue, the delayed
    job alone; a pack returned by the broker fails every job in it."""
    b = broker("amqp://guest:guest@rabbit.example/%2F?delay_mode=tiers&pack=3")
    orders = [message("orders") for _ in range(5)]
    mail = [message("mail") for _ in range(2)]
    later = message("orders", 5.0)
    batch = [Outgoing(m, 0.0) for m in orders[:2]] + [Outgoing(mail[0], 0.0),
             Outgoing(later, 5.0)] + [Outgoing(m, 0.0) for m in orders[2:] + mail[1:]]
    fake_pika.outcomes = ["ack", "ack", "ack", "return"]
    results = await b.publish(batch)
    published = [c for c in fake_pika.instances[-1].calls if c[0] == "basic_publish"]
    packs = [int(c[3].headers[amqp_pack.HEADER_PACK]) for c in published
             if amqp_pack.HEADER_PACK in (c[3].headers or {})]
    singles = [c[3].message_id for c in published
               if amqp_pack.HEADER_PACK not in (c[3].headers or {})]
    assert sorted(packs) == [2, 2, 3]  # orders 1-3, mail 1-2, orders 4-5
    assert singles == [str(later.job_id)]
    assert [r.job_id for r in results] == [o.message.job_id for o in batch]
    failed = {r.job_id for r in results if not r.ok}
    # The fourth message published (the second pack of orders) came back.
    assert failed == {orders[3].job_id, orders[4].job_id}
    await b.close()


async def test_pack_1_publishes_one_job_per_message(fake_pika: type[FakeConnection]) -> None:
    b = broker("amqp://guest:guest@rabbit.example/%2F?delay_mode=tiers&pack=1")
    await b.publish([Outgoing(message("orders"), 0.0) for _ in range(4)])
    published = [c for c in fake_pika.instances[-1].calls if c[0] == "basic_publish"]
    assert len(published) == 4
    assert not any(amqp_pack.HEADER_PACK in (c[3].headers or {}) for c in published)
    await b.close()


@pytest.mark.parametrize("value", ["0", "-1", "1001", "2.5", "x", ""])
def test_a_bad_pack_size_names_the_parameter(value: str) -> None:
    with pytest.raises(ConfigurationError, match="pack must be an integer"):
        broker(f"amqp://guest:guest@rabbit.example/%2F?pack={value}")


# --- against the real RabbitMQ: picking the delay mode ------------------------------


def _mode_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "duebox.brokers.amqp" and "delays (" in r.getMessage()]


def _scary(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name} {r.levelname}: {r.getMessage()}" for r in caplog.records
            if "unknown exchange type" in r.getMessage()]


async def test_auto_mode_picks_the_plugin_and_says_why(
        amqp_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """``.ci/services`` enables rabbitmq_delayed_message_exchange: ``auto``
    finds it, and one line says so."""
    caplog.set_level(logging.DEBUG)
    b = broker(f"{amqp_url}?prefix={unique('auto')}")
    try:
        await b.open()
        assert b.plugin is True
    finally:
        await b.close()
    [line] = _mode_lines(caplog)
    assert "plugin delays (auto: the broker has the rabbitmq_delayed_message_exchange" in line
    assert not _scary(caplog)


async def test_auto_mode_without_the_plugin_probes_quietly(
        amqp_url: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the plugin the probe's declaration closes its connection with
    ``503 COMMAND_INVALID - unknown exchange type``, which pika logs (at INFO
    and DEBUG) like an outage unless duebox holds it back.  The plugin is not
    disabled for this: the broker is shared, and disabling it deletes every
    delayed message it holds (its Mnesia tables go with it).  The probe
    declares an exchange type no broker has instead, which RabbitMQ refuses
    the same way (exchange types are node-wide: a vhost cannot hide one)."""
    absent = "x-duebox-absent"
    monkeypatch.setattr(Topology, "plugin_ops", lambda self: [
        ExchangeDecl(self.delayed, absent, {"x-delayed-type": "direct"})])
    caplog.set_level(logging.DEBUG)
    b = broker(f"{amqp_url}?prefix={unique('auto')}")
    try:
        await b.open()
        assert b.plugin is False
    finally:
        await b.close()
    [line] = _mode_lines(caplog)
    assert f"tier delays (auto: the broker has no '{absent}' exchange type" in line
    assert not _scary(caplog)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --- against the real RabbitMQ: the tier topology ------------------------------------


async def delivered_after(pub: AMQPBroker, collector: Collector, q: str, delays: list[float]
                          ) -> list[tuple[float, Delivery, float, float]]:
    """Publish one message per delay, one at a time, and wait for them all:
    (arrived, delivery, published, delay) each, none delivered early."""
    sent = {}
    for d in delays:
        msg = message(q, d)
        before = time.time()
        [r] = await pub.publish([Outgoing(msg, d)])
        assert r.ok, r
        sent[msg.job_id] = (before, d)
    out = []
    for arrived, delivery in await collector.wait(len(delays), within=15):
        assert delivery.message is not None
        before, d = sent[delivery.message.job_id]
        assert arrived - before >= d, f"delay {d}s delivered early"
        out.append((arrived, delivery, before, d))
    return out


async def test_tier_delays_are_exact_stops_and_never_early(amqp_url: str) -> None:
    q = unique()
    url = f"{amqp_url}?delay_mode=tiers"  # auto picks the plugin where CI enables it
    pub, con = broker(url, "pub"), broker(url, "con")
    collector = await Collector.ready(con, pub, q)
    try:
        delays = [0.0, 0.001, 0.017, 0.273, 1.5, 2.047, 3.5]
        got = await delivered_after(pub, collector, q, delays)
        for arrived, delivery, before, d in got:
            assert arrived - before < d + 1.0, f"delay {d}s delivered {arrived - before:.3f}s"
            if d == 0:
                assert delivery.extra["exchange"] == "duebox.direct"
                continue
            # The digits it was published with (the delay less the time spent
            # publishing, in whole ms) and the tier queues it really stopped in.
            key = delivery.extra["routing_key"]
            ms = int("".join(key.split(".")[:LEVELS]), 16)
            assert d * 1000 - 50 < ms <= d * 1000
            headers = delivery.extra["headers"]
            expected = pub.topology.stops(ms)
            deaths = headers.get("x-death") or []  # one entry per queue, not in order
            assert sorted(x["queue"] for x in deaths) == sorted(expected), (d, ms, deaths)
            assert all(x["reason"] == "expired" and x["count"] == 1 for x in deaths)
            assert headers["x-first-death-queue"] == expected[0]
    finally:
        await collector.stop()
        await pub.close()


async def test_no_head_of_line_blocking_and_bounded_queues(amqp_url: str) -> None:
    """100 messages over 1 s .. 30 days, published first, do not hold back a
    short one published after them, and they occupy only the fixed tiers."""
    q = unique()
    url = f"{amqp_url}?delay_mode=tiers"
    pub, con = broker(url, "pub"), broker(url, "con")
    collector = await Collector.ready(con, pub, q)
    try:
        rng = random.Random(3)
        long_ones = [Outgoing(message(q, d), d)
                     for d in [30 * 86400.0, 1.5] + [rng.uniform(2, 30 * 86400) for _ in range(98)]]
        assert all(r.ok for r in await pub.publish(long_ones))
        short = message(q, 0.2)
        before = time.time()
        [r] = await pub.publish([Outgoing(short, 0.2)])
        assert r.ok
        got = await collector.wait(1, within=10)
        arrived, first = got[0]
        assert first.message is not None
        assert first.message.job_id == short.job_id
        assert 0.2 <= arrived - before < 1.0
        await collector.wait(2, within=10)  # the 1.5 s one
        assert collector.got[1][1].message.job_id == long_ones[1].message.job_id  # type: ignore[union-attr]
        t = pub.topology
        with admin(url) as ch:
            held = sum(ch.queue_declare(t.tier_queue(j, d), passive=True).method.message_count
                       for j in range(LEVELS) for d in range(1, 16))
        assert held >= 98  # every long one waits in one of the 120 fixed tier queues
    finally:
        await collector.stop()
        await pub.close()


async def test_a_chosen_tier_shape_holds_fewer_queues_and_never_delivers_early(
        amqp_url: str) -> None:
    """Base 2 at 250 ms: 25 tier queues in the vhost instead of 120 (#33
    item 9), delays rounded up to 250 ms, and each message stops exactly in
    the queues of its digits."""
    q, prefix = unique(), unique("shape")
    url = f"{amqp_url}?delay_mode=tiers&prefix={prefix}&tier_base=2&tier_precision=0.25"
    pub, con = broker(url, "pub"), broker(url, "con")
    assert pub.capabilities.delay_precision == 0.25  # the relay rounds up to it
    collector = await Collector.ready(con, pub, q)
    try:
        vhost = urlsplit(amqp_url).path.lstrip("/")
        listed = rabbitmqctl("list_queues", "-p", vhost, "--no-table-headers", "name").split()
        assert len([n for n in listed if n.startswith(f"{prefix}.delay")]) == 25
        # Just under whole quarter seconds: rounded up to 1, 2, 4 and 7 of
        # them (1, 1, 1 and 3 stops), however long a publish takes here.
        units_of = {0.24: 1, 0.49: 2, 0.99: 4, 1.74: 7}
        got = await delivered_after(pub, collector, q, list(units_of))
        tiers = pub.topology.tiers
        for _, delivery, _, d in got:
            key = delivery.extra["routing_key"]  # quarter seconds in base 2
            units = int("".join(key.split(".")[:tiers.levels]), 2)
            assert units == units_of[d], (d, key)
            deaths = delivery.extra["headers"].get("x-death") or []
            stops = pub.topology.stops(units * 250)
            assert sorted(x["queue"] for x in deaths) == sorted(stops), d
    finally:
        await collector.stop()
        await pub.close()


async def test_unroutable_publish_is_not_ok_and_not_lost(
        amqp_vhost: str, sqlite_url: str, make_app: MakeApp) -> None:
    url = f"{amqp_vhost}?prefix={unique('p')}"
    q = unique()
    app = make_app(sqlite_url, url, q)
    relay = Relay(app)
    (pipeline,) = relay.pipelines
    broker = pipeline.broker
    await broker.open()
    try:
        assert not await broker.declare_queues([q])  # type: ignore[attr-defined]
        with admin(url) as ch:
            ch.queue_delete(f"{broker.topology.prefix}.q.{q}")  # type: ignore[attr-defined]
        [r] = await broker.publish([Outgoing(message(q), 0.0)])
        assert not r.ok
        assert "unroutable: 312 NO_ROUTE" in (r.error or "")

        job_id = schedule_committed(app, "effect")
        await broker.declare_queues([q])  # type: ignore[attr-defined]
        with admin(url) as ch:
            ch.queue_delete(f"{broker.topology.prefix}.q.{q}")  # type: ignore[attr-defined]
        stats = await relay.run_pass()
        assert (stats.published, stats.failed) == (0, 1)
        assert state(app, job_id) == "SCHEDULED"  # released, not lost
        stats = await relay.run_pass()  # the queue is declared again: published
        assert stats.published == 1
        assert state(app, job_id) == "ENQUEUED"
        assert message_count(url, f"{broker.topology.prefix}.q.{q}") == 1  # type: ignore[attr-defined]
    finally:
        await broker.close()


async def test_garbage_is_rejected_into_the_dead_letter_queue(
        amqp_vhost: str, sqlite_url: str, make_app: MakeApp) -> None:
    prefix = unique("p")
    url = f"{amqp_vhost}?prefix={prefix}"
    q = unique()
    app = make_app(sqlite_url, url, q)
    worker = Worker(app, concurrency=2)
    stop, tasks = await start(worker)
    try:
        with admin(url) as ch:
            ch.basic_publish(f"{prefix}.direct", q, b"not json")
        await until(lambda: message_count(url, f"{prefix}.dead-letter") == 1, seconds=10,
                    what="garbage in the dead-letter queue", check=alive(tasks))
        assert worker.stats.discarded["undecodable"] == 1
    finally:
        await finish(stop, tasks)


async def test_unroutable_at_the_end_of_its_delay_is_kept(amqp_vhost: str) -> None:
    """Dead-lettering cannot be mandatory: a message whose queue disappeared
    while it waited goes to the dead-letter queue, not into the void."""
    prefix = unique("p")
    # The tiers' deliver exchange has an alternate exchange.  The plugin
    # routes at the end of the delay with no way to keep what matches
    # nothing (an alternate exchange on it would take every delayed message
    # at publish): that message is lost, and the relay publishes it again
    # after redeliver_after (tests/contract/test_amqp.py).
    url = f"{amqp_vhost}?prefix={prefix}&delay_mode=tiers"
    q = unique()
    pub = broker(url, "pub")
    try:
        await pub.open()  # the delay counts from the call: keep connecting out of it
        [r] = await pub.publish([Outgoing(message(q, 1.0), 1.0)])
        assert r.ok, r
        with admin(url) as ch:
            ch.queue_delete(f"{prefix}.q.{q}")
        await until(lambda: message_count(url, f"{prefix}.dead-letter") == 1, seconds=10,
                    what="the orphan in the dead-letter queue")
    finally:
        await pub.close()


async def test_quorum_queues_deliver_through_tiers(amqp_vhost: str) -> None:
    url = f"{amqp_vhost}?prefix={unique('p')}&queue_type=quorum"
    q = unique()
    pub, con = broker(url, "pub"), broker(url, "con")
    collector = await Collector.ready(con, pub, q)
    try:
        msg = message(q, 0.3)
        before = time.time()
        [r] = await pub.publish([Outgoing(msg, 0.3)])
        assert r.ok, r
        [(arrived, d)] = await collector.wait(1, within=15)
        assert d.message is not None
        assert d.message.job_id == msg.job_id
        assert arrived - before >= 0.3
    finally:
        await collector.stop()
        await pub.close()


# --- end to end: relay, worker, database ----------------------------------------------


async def test_duplicate_publishes_run_once(
        database_url: str, amqp_url: str, make_app: MakeApp) -> None:
    q = unique()
    app = make_app(database_url, amqp_url, q)
    # near_window=0: published ahead with a broker delay (not held to its due
    # time), so the job sits ENQUEUED and the copies below can arrive early.
    relay, worker = Relay(app, near_window=0), Worker(app, concurrency=4)
    extra = broker(amqp_url, "duplicator")
    stop, tasks = await start(relay, worker)
    try:
        # Due in 6 s: the copies must arrive more than a second early to be
        # deferred rather than held (_EARLY_HOLD_SECONDS); at 3 s a loaded
        # machine's relay and polling took long enough that they came less
        # than a second early and were held.
        job_id = schedule_committed(app, "effect", delay=6.0)
        msg = await until(lambda: _message(app, job_id, "ENQUEUED"), seconds=10,
                          what="published", check=alive(tasks))
        copies = [Outgoing(msg, 0.0), Outgoing(msg, 0.2)]
        assert all(r.ok for r in await extra.publish(copies))
        await until(lambda: worker.stats.received >= 3 and state(app, job_id) == "SUCCEEDED",
                    seconds=20, what="three deliveries", check=alive(tasks))
        [late] = await extra.publish([Outgoing(msg, 0.0)])  # after success
        assert late.ok
        await until(lambda: worker.stats.received >= 4, seconds=10, what="fourth delivery",
                    check=alive(tasks))
    finally:
        await extra.close()
        await finish(stop, tasks)
    assert list(effect_rows(app.engine)) == [str(job_id)]
    assert sum(worker.stats.discarded.values()) + worker.stats.duplicates >= 3
    assert worker.stats.deferred >= 1  # copies that came >1 s early went back with a delay
    check_no_early_start(app.engine)


def _message(app: duebox.Duebox, job_id: uuid.UUID, wanted: str) -> JobMessage | None:
    """The message the relay published for a job, once the job is ``wanted``."""
    row = job_row(app.engine, job_id)
    if str(row.state) != wanted:
        return None
    return JobMessage(job_id=row.id, task=row.task, queue=row.queue, version=row.version,
                      attempt=row.attempt, due_at=_aware(row.due_at), payload=row.payload,
                      headers=row.headers or {})


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


# --- crashes ----------------------------------------------------------------------


def launch_doomed_worker(database_url: str, amqp_url: str, queue: str,
                         markers: Path) -> subprocess.Popen[bytes]:
    with (markers / "doomed.log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, str(PROCS / "amqp_worker.py"), database_url, amqp_url, queue,
             str(markers)], stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
async def test_sigkilled_worker_messages_are_redelivered_and_deduplicated(
        database_url: str, amqp_url: str, tmp_path: Path, make_app: MakeApp) -> None:
    q = unique()
    app = make_app(database_url, amqp_url, q, lease_seconds=2.0)

    @app.task("kill_effect", queue=q)
    def kill_effect(payload: Any, ctx: duebox.JobContext) -> None:
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    relay = Relay(app, recover_interval=0.2)
    stop, tasks = await start(relay)
    proc = launch_doomed_worker(database_url, amqp_url, q, tmp_path)
    second: Worker | None = None
    try:
        committed = schedule_committed(app, "kill_effect", {"mode": "commit"})
        await until(lambda: (tmp_path / f"{committed}.committed").exists(), seconds=20,
                    what="the doomed worker committed", check=alive(tasks))
        hanging = schedule_committed(app, "kill_effect", {"mode": "hang"})
        await until(lambda: (tmp_path / f"{hanging}.running").exists(), seconds=20,
                    what="the doomed worker is mid-handler", check=alive(tasks))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        second = Worker(app, concurrency=4)
        tasks.append(asyncio.create_task(second.run(stop)))
        await until(lambda: state(app, hanging) == "SUCCEEDED"
                    and second.stats.discarded["already_succeeded"] >= 1,
                    seconds=30, what="redeliveries handled", check=alive(tasks))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        await finish(stop, tasks)
    assert state(app, committed) == "SUCCEEDED"
    assert sorted(effect_rows(app.engine)) == sorted([str(committed), str(hanging)])
    # The hung job's redelivery found it still leased (already_running) or, on
    # a slow machine, already recovered and ran it; either way once.
    assert second.stats.received >= 2
    check_no_early_start(app.engine)


async def test_acking_many_never_acks_a_delivery_still_in_hand(amqp_url: str) -> None:
    """``ack_many`` turns the run of the lowest unsettled tags into one
    ``multiple`` ack, which acks *every* unsettled tag up to it: a delivery
    still being handled inside that range must not be acked with them.  Ten
    messages in hand, three batches acked out of order (one with deliveries
    in hand between its tags), the consumer's connection closed: exactly the
    unacked ones are back in the queue.  (One job per message: ``pack=1``.)"""
    q = unique()
    url = f"{amqp_url}?pack=1"
    pub, con = broker(url, "pub"), broker(url, "con")
    await pub.declare([q])
    sent = [message(q, n=i) for i in range(10)]
    assert all(r.ok for r in await pub.publish([Outgoing(m, 0.0) for m in sent]))
    got: list[Delivery] = []

    async def take() -> None:
        async for d in con.consume([q], 50):
            got.append(d)

    taker = asyncio.create_task(take())
    try:
        await until(lambda: len(got) >= 10, seconds=15, what="10 deliveries")
        by_n = {d.message.payload["n"]: d for d in got if d.message is not None}
        await con.ack_many([by_n[2], by_n[0], by_n[1]])  # the lowest run: one multiple ack
        await con.ack_many([by_n[4], by_n[6]])  # 3 and 5 still in hand between them
        await con.ack_many([by_n[9]])
    finally:
        taker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await taker
        await con.close()  # what is unacked goes back to the queue
        await pub.close()
    back = []
    with admin(amqp_url) as ch:
        name = broker(amqp_url).queue_name(q)
        while (m := ch.basic_get(name, auto_ack=True))[0] is not None:
            back.append(JobMessage.decode(m[2]).payload["n"])
    assert sorted(back) == [3, 5, 7, 8]


# --- packs of due jobs (brokers/amqp_pack.py) ------------------------------------


async def test_due_jobs_travel_in_packs_and_each_runs_once(
        database_url: str, amqp_url: str, make_app: MakeApp) -> None:
    """100 jobs already due, published by a relay before any worker runs:
    they sit in the queue as packs of at most ``pack`` jobs (far fewer
    messages than jobs); a worker then runs each once, acks every pack
    (the queue drains to empty) and nothing early."""
    q = unique()
    url = f"{amqp_url}?pack=8"
    app = make_app(database_url, url, q)
    with app.engine.begin() as conn:
        ids = [app.schedule(conn, "effect", {"n": n}) for n in range(100)]
    relay = Relay(app)
    stop, tasks = await start(relay)
    try:
        await until(lambda: all(state(app, i) == "ENQUEUED" for i in ids), seconds=30,
                    what="all 100 published", check=alive(tasks))
    finally:
        await finish(stop, tasks)
    name = broker(url).queue_name(q)
    held = message_count(url, name)
    assert 13 <= held <= 30  # 100 / 8 = 13 when every claim's batch packs fully
    worker = Worker(app, concurrency=4)
    stop, tasks = await start(worker)
    try:
        await until(lambda: len(effect_rows(app.engine)) == 100, seconds=60,
                    what="all 100 run", check=alive(tasks))
        await until(lambda: message_count(url, name) == 0, seconds=20,
                    what="every pack acked", check=alive(tasks))
    finally:
        await finish(stop, tasks)
    assert sorted(effect_rows(app.engine)) == sorted(str(i) for i in ids)
    assert all(state(app, i) == "SUCCEEDED" for i in ids)
    check_no_early_start(app.engine)


async def test_a_stopping_consumer_gives_back_what_it_never_handled_of_a_pack(
        amqp_url: str) -> None:
    """A consumer that stops with three of a pack's ten jobs handed out and
    seven never handled: once the three are settled it publishes the seven
    again and acks the pack — the finished three never come back (a worker
    stopped with SIGTERM acks every job it finished), and none is lost."""
    q = unique()
    pub, con = broker(amqp_url, "pub"), broker(amqp_url, "con")
    await pub.declare([q])
    jobs = [message(q, n=i) for i in range(10)]
    assert all(r.ok for r in await pub.publish([Outgoing(m, 0.0) for m in jobs]))
    name = pub.queue_name(q)
    handed: list[Delivery] = []
    stream = con.consume([q], 50)
    try:
        async for d in stream:
            handed.append(d)
            if len(handed) == 3:
                break
    finally:
        await stream.aclose()  # the 7 not handed out are given back
    assert message_count(amqp_url, name) == 0  # unacked: still this consumer's
    await con.ack_many(handed[:2])
    await con.ack(handed[2])  # the last one out: the seven go back now
    await until(lambda: message_count(amqp_url, name) == 1, seconds=10,
                what="the unhandled jobs back in the queue")
    await con.close()
    await pub.close()
    with admin(amqp_url) as ch:
        _, props, body = ch.basic_get(name, auto_ack=True)
        assert ch.basic_get(name, auto_ack=True)[0] is None  # the pack itself was acked
    assert props.headers[amqp_pack.HEADER_PACK] == "7"
    assert [m.job_id for m in amqp_pack.decode(body)] == [m.job_id for m in jobs[3:]]
