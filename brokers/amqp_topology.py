"""The RabbitMQ topology of ``amqp://``, as data: names, declarations, routes.

Nothing here talks to a broker (and nothing imports pika), so the exact
declarations and headers each delay path sends are unit-testable.

Two ways to delay a message:

**Tiers** (no plugin needed).  A queue's ``x-message-ttl`` expires messages
only at its head, so one queue must only ever hold *one* delay: then entry
order is expiry order and nothing blocks anything.  A delay in milliseconds
is written as ``LEVELS`` hexadecimal digits, and each non-zero digit ``d`` at
position ``j`` is one stop in the fixed-TTL queue ``delay.{j}.{d}`` (TTL
``d * 16**j`` ms).  The digits travel in the routing key, most significant
first, ahead of the destination queue's name::

    0.0.0.0.0.1.a.0.orders        # 0x1a0 ms = 416 ms: 256 ms, then 160 ms

A tier queue dead-letters into the topic exchange of its level, which routes
on the digits below it straight to the next non-zero digit's queue (one
binding per reachable queue, no exchange chains), or, when none is left, to
the ``deliver`` exchange, which routes on the name to the destination queue.
8 levels x 15 digits = 120 queues give a ceiling of ``16**8 - 1`` ms =
``2**32 - 1`` ms (49.7 days, the plugin's too) at 1 ms precision, and a
message stops in at most 8 queues (binary levels would need up to 32 stops:
every stop costs a dead-letter hop of about a millisecond of lateness and a
broker write, so fewer stops is both more punctual and cheaper).  That is
the default shape; ``?tier_base=``, ``?tier_precision=`` and ``?max_delay=``
choose another (:mod:`duebox.brokers.amqp_tiers`), whose names carry the
shape so two shapes never share a queue.

**Plugin** (``rabbitmq_delayed_message_exchange``): one ``x-delayed-message``
exchange (``x-delayed-type: direct``) and an ``x-delay`` header in ms.

Immediate messages (delay 0) go through the ``direct`` exchange in both
modes, published *mandatory*: an unroutable one comes back as an error.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from duebox.errors import ConfigurationError, ValidationError

from .amqp_tiers import MAX_DELAY_MS, Tiers

# The default shape's (the names tests and older code know).
RADIX = Tiers().radix
LEVELS = Tiers().levels
# Tier queues whose level's unit is at least this (16**4 ms, 65.5 s) hold
# long waits: on classic queues they are lazy and use the v2 index (RabbitMQ
# >= 3.10; older brokers ignore the argument), so a message waiting for days
# costs disk, not memory: 100,000 of them hold the queues' memory constant.
LAZY_FROM_MS = 16**4
_LONG_WAIT_ARGS = {"x-queue-mode": "lazy", "x-queue-version": 2}
MAX_NAME_BYTES = 255  # AMQP short string: queue names and routing keys

MODES = ("auto", "tiers", "plugin")
QUEUE_TYPES = ("classic", "quorum")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")


@dataclass(frozen=True)
class ExchangeDecl:
    name: str
    type: str
    arguments: dict[str, Any] = field(default_factory=dict)
    internal: bool = False
    durable: bool = True


@dataclass(frozen=True)
class QueueDecl:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    durable: bool = True


@dataclass(frozen=True)
class QueueBind:
    queue: str
    exchange: str
    routing_key: str


@dataclass(frozen=True)
class ExchangeBind:
    destination: str
    source: str
    routing_key: str


Op = ExchangeDecl | QueueDecl | QueueBind | ExchangeBind


@dataclass(frozen=True)
class Route:
    """Where and how one message is published."""

    exchange: str
    routing_key: str
    mandatory: bool
    headers: dict[str, Any] = field(default_factory=dict)
    delay_ms: int = 0


@dataclass(frozen=True)
class Topology:
    """Every name derives from ``prefix`` (``?prefix=``, default ``duebox``)."""

    prefix: str = "duebox"
    queue_type: str = "classic"
    tiers: Tiers = field(default_factory=Tiers)

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise ConfigurationError(
                "broker_url: prefix must be 1-100 characters of letters, digits, "
                f"'_', '.', ':' or '-' (got {self.prefix!r})")
        if self.queue_type not in QUEUE_TYPES:
            raise ConfigurationError(
                f"broker_url: queue_type must be one of {', '.join(QUEUE_TYPES)} "
                f"(got {self.queue_type!r})")

    # --- names ---------------------------------------------------------------

    @property
    def direct(self) -> str:
        """Immediate delivery: routing key = duebox queue name."""
        return f"{self.prefix}.direct"

    @property
    def deliver(self) -> str:
        """End of the tiers: routes ``<digits>.<queue>`` to the destination."""
        return f"{self.prefix}.deliver"

    @property
    def delayed(self) -> str:
        """The plugin's ``x-delayed-message`` exchange."""
        return f"{self.prefix}.delayed"

    @property
    def dead_letter(self) -> str:
        """Exchange and queue for what could not be delivered or decoded."""
        return f"{self.prefix}.dead-letter"

    @property
    def _tier_stem(self) -> str:
        """The tiers' names start with it: the default shape's as ever,
        another's with its shape, so shapes sharing a prefix never meet."""
        t = self.tiers
        if t.default:
            return f"{self.prefix}.delay"
        return f"{self.prefix}.delay-b{t.radix}-p{t.precision_ms}ms-l{t.levels}"

    def level_exchange(self, k: int) -> str:
        """Routes on the digits below position ``k`` (``k == levels``: all)."""
        return f"{self._tier_stem}.{k}"

    def tier_queue(self, j: int, d: int) -> str:
        return f"{self._tier_stem}.{j}.{d:x}"

    def queue(self, name: str) -> str:
        """The RabbitMQ queue of duebox queue ``name``."""
        return f"{self.prefix}.q.{name}"

    # --- declarations --------------------------------------------------------

    def base_ops(self) -> list[Op]:
        """What both modes and both sides need."""
        dead = self.dead_letter
        return [
            ExchangeDecl(dead, "fanout"),
            QueueDecl(dead, self._parking_args()),
            QueueBind(dead, dead, ""),
            ExchangeDecl(self.direct, "direct"),
            ExchangeDecl(self.deliver, "topic", {"alternate-exchange": dead}, internal=True),
        ]

    def tier_ops(self) -> list[Op]:
        """The tier topology: one topic exchange per level, the tier queues
        of the shape (120 by default) and the bindings between them (all
        idempotent)."""
        levels = self.tiers.levels
        queues = self.tiers.queues()
        ops: list[Op] = []
        for k in range(levels, 0, -1):
            # The entry exchange (k == levels) has no alternate exchange, so a
            # mandatory publish that matches no tier queue comes back; the
            # inner ones only see dead-lettered messages, which cannot come
            # back, so they keep anything unroutable in the dead-letter queue.
            args = {} if k == levels else {"alternate-exchange": self.dead_letter}
            ops.append(ExchangeDecl(self.level_exchange(k), "topic", args,
                                    internal=k != levels))
        for j, d in queues:
            nxt = self.level_exchange(j) if j > 0 else self.deliver
            ops.append(QueueDecl(self.tier_queue(j, d), self._tier_args(j, d, nxt)))
        for k in range(levels, 0, -1):
            src = self.level_exchange(k)
            skip = "*." * (levels - k)
            for j, d in sorted((q for q in queues if q[0] < k), key=lambda q: -q[0]):
                zeros = "0." * (k - 1 - j)
                ops.append(QueueBind(self.tier_queue(j, d), src, f"{skip}{zeros}{d:x}.#"))
            if k < levels:
                ops.append(ExchangeBind(self.deliver, src, f"{skip}{'0.' * k}#"))
        return ops

    def plugin_ops(self) -> list[Op]:
        return [ExchangeDecl(self.delayed, "x-delayed-message", {"x-delayed-type": "direct"})]

    def queue_ops(self, name: str, plugin: bool) -> list[Op]:
        """Declare duebox queue ``name`` and bind it to every path into it."""
        check_queue_name(self, name)
        q = self.queue(name)
        ops: list[Op] = [
            QueueDecl(q, self._queue_args()),
            QueueBind(q, self.direct, name),
            QueueBind(q, self.deliver, "*." * self.tiers.levels + name),
        ]
        if plugin:
            ops.append(QueueBind(q, self.delayed, name))
        return ops

    def _queue_args(self) -> dict[str, Any]:
        # A message a worker rejects (not a duebox message) is kept, not dropped.
        args: dict[str, Any] = {"x-dead-letter-exchange": self.dead_letter}
        if self.queue_type == "quorum":
            args["x-queue-type"] = "quorum"
        return args

    def _parking_args(self) -> dict[str, Any]:
        if self.queue_type == "quorum":
            return {"x-queue-type": "quorum"}
        return dict(_LONG_WAIT_ARGS)

    def _tier_args(self, j: int, d: int, dlx: str) -> dict[str, Any]:
        args: dict[str, Any] = {"x-message-ttl": self.tiers.ttl_ms(j, d),
                                "x-dead-letter-exchange": dlx}
        if self.queue_type == "quorum":
            # At-least-once dead-lettering (RabbitMQ >= 3.10) needs reject-publish.
            args.update({"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once",
                         "x-overflow": "reject-publish"})
        elif self.tiers.ttl_ms(j, 1) >= LAZY_FROM_MS:
            args.update(_LONG_WAIT_ARGS)
        return args

    # --- routes --------------------------------------------------------------

    def route(self, queue: str, delay: float, plugin: bool) -> Route:
        """How to publish a message for ``queue`` that must stay invisible for
        ``delay`` seconds (rounded up to whole milliseconds, and in the
        tiers up to the shape's precision)."""
        check_queue_name(self, queue)
        ms = delay_ms(delay)
        if ms == 0:
            return Route(self.direct, queue, mandatory=True)
        if plugin:
            # The plugin routes only when the delay ends: with mandatory set it
            # returns every delayed message as NO_ROUTE although it keeps it
            # (rabbitmq-delayed-message-exchange#7), so routability is ensured
            # by declaring and binding the queue before publishing instead.
            return Route(self.delayed, queue, mandatory=False, headers={"x-delay": ms},
                         delay_ms=ms)
        units = self.tiers.units(ms)
        if units > self.tiers.most_units:  # the relay never asks: its horizon is max_delay
            raise ValidationError("delay", f"must be at most max_delay "
                                  f"({self.tiers.ceiling_ms / 1000:g} s) in these tiers", delay)
        return Route(self.level_exchange(self.tiers.levels), f"{self.tiers.key(units)}.{queue}",
                     mandatory=True, delay_ms=units * self.tiers.precision_ms)

    def stops(self, ms: int) -> list[str]:
        """The tier queues a message delayed ``ms`` passes through, in order."""
        return [self.tier_queue(j, d) for j, d in self.tiers.stops(self.tiers.units(ms))]

    def tier_at(self, ms: int, elapsed_ms: float) -> str:
        """The tier queue a message delayed ``ms`` sits in ``elapsed_ms``
        after it was published."""
        # Capped: a message published under another max_delay may say more.
        return self.tiers.at(min(self.tiers.units(ms), self.tiers.most_units), elapsed_ms)


def delay_ms(delay: float) -> int:
    """Seconds to whole milliseconds, rounded up (never early), within the ceiling."""
    if not math.isfinite(delay) or delay <= 0:
        return 0
    return min(MAX_DELAY_MS, math.ceil(delay * 1000 - 1e-6))


def tier_key(ms: int) -> str:
    """The default shape's routing-key digits for ``ms``."""
    return Tiers().key(ms)


def check_queue_name(topology: Topology, name: str) -> None:
    """A duebox queue name must fit RabbitMQ's 255-byte names and keys and must
    not contain a topic wildcard word (``*`` or ``#``)."""
    if not isinstance(name, str) or not name:
        raise ValidationError("queue", "must be a non-empty string", name)
    longest = max(len(topology.queue(name).encode()),
                  len(name.encode()) + 2 * topology.tiers.levels)
    if longest > MAX_NAME_BYTES:
        raise ValidationError(
            "queue", f"must be short enough for a RabbitMQ name ({MAX_NAME_BYTES} bytes with "
            f"the prefix {topology.prefix!r})", name)
    if any(word in ("*", "#") for word in name.split(".")):
        raise ValidationError("queue", "must not contain '*' or '#' as a dot-separated word "
                              "(they are topic wildcards on RabbitMQ)", name)
