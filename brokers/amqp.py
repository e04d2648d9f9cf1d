"""``amqp://`` and ``amqps://`` — RabbitMQ through pika's asyncio adapter.

Delays use the ``x-delayed-message`` plugin when the broker has it (detected
at connect; ``?delay_mode=plugin|tiers`` forces one) and otherwise a TTL +
dead-letter tier topology (:mod:`duebox.brokers.amqp_topology`).  Either way
the ceiling is ``2**32 - 1`` ms (49.7 days) at 1 ms precision; later jobs stay
parked in the database (``?max_delay=`` lowers the ceiling).

Publishing is pipelined: a batch is written at once on a confirm-mode channel
and its confirms are awaited together.  Every message is persistent; a result
is ``ok`` only when the broker acked it and did not return it, and immediate
and tier publishes are *mandatory*, so an unroutable message is an error the
relay retries, never a silent loss.  Queues are durable (``?queue_type=quorum``
for quorum queues).  Consumers use ``basic.qos`` prefetch and manual acks; a
lost connection is re-established by both sides, and unacked messages are
redelivered by the broker and dropped by the worker's version check and
dedupe.

A cluster: ``amqp://u:p@h1:5672,h2:5672,h3:5672/vhost`` names every node
(brokers/amqp_hosts.py); a connection goes to the first that accepts, and a
new one after a loss starts at the next node.

URL parameters besides pika's own (``heartbeat``, ``ssl_options``, ...):
``prefix`` (names, default ``duebox``), ``delay_mode`` (``auto``),
``queue_type`` (``classic``), ``confirm_timeout`` (seconds, 30) and
``max_delay``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from duebox.errors import BrokerError, DueboxError, MessageDecodeError, ValidationError
from duebox.message import JobMessage
from duebox.observability.logs import CollapsedLog
from duebox.wait_any import wait_any

from . import amqp_pack
from .amqp_link import (
    Channel,
    Link,
    Publisher,
    chan_code,
    describe,
    pack_properties,
    pika_logs_without,
    pika_parameters,
    properties,
)
from .amqp_pack import HEADER_PACK
from .amqp_settings import OWN_PARAMS, AMQPSettings, topology_of
from .amqp_tiers import MAX_DELAY_MS, longest_ms
from .amqp_topology import ExchangeDecl, check_queue_name, delay_ms
from .base import (
    HANDOVER_LEAD_SECONDS,
    BrokerContext,
    Capabilities,
    Delivery,
    Durability,
    Ordering,
    Outgoing,
    PublishingBroker,
    PublishResult,
    buffer_size,
    parse_params,
    refused,
)

if TYPE_CHECKING:
    from duebox.leases.recovery import EnqueuedRef

log = logging.getLogger("duebox.brokers.amqp")

# RabbitMQ's default max_message_size (3.8+): larger messages close the channel.
PAYLOAD_LIMIT = 128 * 1024 * 1024
_YIELD_EVERY = 64
# Ended consumer channels kept open for late acks; beyond this the oldest is
# closed (the broker redelivers what it still held; the worker drops it).
_RETIRED_MOST = 4
# How often a consumer fits its prefetch while its worker takes nothing in
# (and whenever the worker's wants change).
_FOLLOW_EVERY = 0.25


@dataclass
class _Intake:
    """A consumer channel's prefetch as last set, and when."""

    qos: int
    at: float = field(default_factory=time.monotonic)


class AMQPBroker(PublishingBroker):
    capabilities = Capabilities(
        name="amqp",
        max_delay=MAX_DELAY_MS / 1000,
        delay_precision=0.001,
        cancel=False,
        ordering=Ordering.DUE,
        ordering_note="per queue in visibility order; messages due within a few ms of each "
                      "other may swap (each tier stop adds about 1 ms)",
        durability=Durability.BROKER,
        durability_note="durable queues, persistent messages, publisher confirms; a classic "
                        "queue dead-letters between tiers at most once (quorum: at least once); "
                        "the job table republishes anything lost after redeliver_after",
        payload_limit=PAYLOAD_LIMIT,
        redelivers_unacked=True,
        prompt_redelivery=True,
        publish_lead=HANDOVER_LEAD_SECONDS,  # coarse TTL tiers: the relay holds the last seconds
        in_flight_after_cancel="waits out its delay in the broker, then is delivered and "
                               "discarded by the version check",
    )

    def __init__(self, url: str, context: BrokerContext) -> None:
        super().__init__(url, context)
        self.settings = AMQPSettings.from_url(url)
        self.topology = self.settings.topology
        # The relay rounds delays up to the tiers' unit (never early); with
        # the plugin that only costs a little lateness where one was chosen.
        tiers = self.topology.tiers
        self.capabilities = replace(type(self).capabilities,
                                    delay_precision=tiers.precision_ms / 1000,
                                    max_delay=longest_ms(tiers.precision_ms) / 1000)
        if self.max_delay is not None:  # ?max_delay=, within the tiers' whole units
            self.max_delay = min(self.max_delay, tiers.ceiling_ms / 1000)
        self.mode = self.settings.delay_mode
        self.confirm_timeout = self.settings.confirm_timeout
        # One per node the URL names (brokers/amqp_hosts.py); pika_params is
        # the first (the vhost, credentials and options are the same in all).
        self.pika_nodes = pika_parameters(url, context.worker_name, OWN_PARAMS)
        self.pika_params = self.pika_nodes[0]
        # The node of the last connection: a new one starts at the next, so
        # a client whose node died goes to a survivor at the first try.
        self._last_node = -1
        self.plugin: bool | None = self.settings.plugin
        self._why = f"delay_mode={self.mode}"  # why this mode: the connected line says it
        self._lock = asyncio.Lock()
        self._link: Link | None = None
        self._admin: Channel | None = None
        self._publisher: Publisher | None = None
        self._declared: set[str] = set()
        self._log = CollapsedLog(log)
        # Consumer channels whose consumption ended, kept open for the acks
        # of the deliveries still being handled (see _stop_consuming).
        self._retired: list[Channel] = []
        # Jobs per message delivered lately (packs: more than one), smoothed:
        # the prefetch, counted in messages, is sized by it.
        self._per_message = 1.0
        # Set when the worker's wanted() may have changed (wanted_changed).
        self._wanted_changed = asyncio.Event()
        # Packs being given back by a consumer that stopped (_settle_pack).
        self._settling: set[asyncio.Task[None]] = set()

    @classmethod
    def check_queue_name(cls, url: str, name: str) -> None:
        """No ``*`` or ``#`` word (topic wildcards in the tier bindings), at
        most 255 bytes with the prefix and the tier routing key."""
        check_queue_name(topology_of(parse_params(url)), name)

    # --- connection ----------------------------------------------------------

    async def open(self) -> None:
        await self._connected()

    async def close(self) -> None:
        if self._settling:  # packs given back: their jobs published again first
            await asyncio.wait(set(self._settling), timeout=self.confirm_timeout)
        link, self._link = self._link, None
        self._admin = self._publisher = None
        self._retired.clear()
        if link is not None:
            await link.close()

    async def _connected(self) -> Link:
        """The open connection, (re)connecting and declaring the topology."""
        async with self._lock:
            link = self._link
            if link is not None and link.is_open:
                return link
            self._link = self._admin = self._publisher = None
            self._declared.clear()
            if self.plugin is None:
                self.plugin = await self._detect_plugin()
            link = await Link.connect_any(self._nodes_in_turn())
            self._last_node = next(i for i, p in enumerate(self.pika_nodes)
                                   if p is link.params)
            try:
                admin = await link.channel()
                t = self.topology
                ops = t.base_ops() + (t.plugin_ops() if self.plugin else t.tier_ops())
                await admin.apply(ops)
            except BrokerError as exc:
                await link.close()
                hint = ""
                if self.plugin and "x-delayed-message" in str(exc):
                    hint = " (delay_mode=plugin needs rabbitmq_delayed_message_exchange)"
                raise BrokerError(f"declaring the RabbitMQ topology failed: {exc}{hint}") from exc
            self._link, self._admin = link, admin
            log.info("connected to RabbitMQ %s:%s vhost %r: %s delays (%s)",
                     link.params.host, link.params.port, link.params.virtual_host,
                     "plugin" if self.plugin else "tier", self._why)
            if self.plugin and len(self.pika_nodes) > 1:
                self._log.warning("plugin-cluster", "the URL names %d RabbitMQ nodes but "
                                  "delays use the delayed-message plugin, which keeps each "
                                  "message on the one node that took it: a lost node loses "
                                  "them (the job table republishes them after "
                                  "redeliver_after); delay_mode=tiers with queue_type=quorum "
                                  "replicates them (docs/brokers.md)", len(self.pika_nodes))
            return link

    def _nodes_in_turn(self) -> list[Any]:
        """Every node, starting after the one connected to last."""
        start = (self._last_node + 1) % len(self.pika_nodes)
        return self.pika_nodes[start:] + self.pika_nodes[:start]

    async def _detect_plugin(self) -> bool:
        """Declare the delayed exchange on a throwaway connection: RabbitMQ
        closes the whole connection (503) when the exchange type is unknown.
        That answer is expected here, so pika's record of it is held back:
        the connected line says which mode is in use and why."""
        ops = self.topology.plugin_ops()
        types = [op.type for op in ops if isinstance(op, ExchangeDecl)]
        probe = await Link.connect_any(self._nodes_in_turn())
        with pika_logs_without("unknown exchange type", types[0]):
            try:
                chan = await probe.channel()
                await chan.apply(ops)
            except BrokerError as exc:
                if probe.close_code == 503 or chan_code(exc) == 503:
                    self._why = (f"auto: the broker has no {types[0]!r} exchange type, "
                                 "i.e. no rabbitmq_delayed_message_exchange plugin")
                    return False
                raise
            finally:
                await probe.close()
        self._why = "auto: the broker has the rabbitmq_delayed_message_exchange plugin"
        return True

    async def _admin_channel(self) -> Channel:
        link = await self._connected()
        if self._admin is None or not self._admin.is_open:
            self._admin = await link.channel()
        return self._admin

    async def declare_queues(self, names: Iterable[str]) -> dict[str, DueboxError]:
        """Declare and bind duebox queues not yet declared on this connection;
        returns ``{name: error}`` for those that failed (a ValidationError:
        a name RabbitMQ can never use)."""
        errors: dict[str, DueboxError] = {}
        for name in dict.fromkeys(names):
            if name in self._declared:
                continue
            try:
                admin = await self._admin_channel()  # connects: ``plugin`` is known after
                await admin.apply(self.topology.queue_ops(name, bool(self.plugin)))
            except ValidationError as exc:
                errors[name] = exc
                continue
            except BrokerError as exc:
                errors[name] = BrokerError(f"declaring queue {name!r} failed: {exc}")
                continue
            self._declared.add(name)
        return errors

    def queue_name(self, queue: str) -> str:
        check_queue_name(self.topology, queue)
        return self.topology.queue(queue)

    async def declare(self, queues: Sequence[str]) -> list[str]:
        errors = await self.declare_queues(queues)
        for error in errors.values():
            raise error
        return [self.queue_name(q) for q in queues]

    async def _publishing(self) -> Publisher:
        link = await self._connected()
        pub = self._publisher
        if pub is None or not pub.chan.is_open:
            pub = self._publisher = await Publisher.start(await link.channel())
        return pub

    # --- publish -------------------------------------------------------------

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        if not batch:
            return []
        start = time.monotonic()
        await self._connected()  # an outage raises BrokerError: the relay backs off
        queue_errors = await self.declare_queues(o.message.queue for o in batch)
        pub = await self._publishing()
        plugin = bool(self.plugin)
        results: list[PublishResult | None] = [None] * len(batch)
        # Due jobs of one queue go out together (brokers/amqp_pack.py); their
        # envelopes are encoded once, here.
        own = self.context.settings.own_queues
        bodies = [o.message.encode() if o.delay <= 0 and o.message.queue not in own else None
                  for o in batch]
        waiting: list[tuple[list[int], asyncio.Future[str | None]]] = []
        for n, unit in enumerate(amqp_pack.units(batch, bodies, self.settings.pack, own)):
            if n and n % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let pika write what is encoded so far
            msg = batch[unit[0]].message
            refusal = queue_errors.get(msg.queue)
            if refusal is None:
                try:
                    waiting.append((unit, self._send(pub, batch, bodies, unit, start, plugin)))
                    continue
                except (ValidationError, BrokerError) as exc:
                    refusal = exc
            for i in unit:
                job_id = batch[i].message.job_id
                results[i] = (refused(job_id, refusal) if isinstance(refusal, ValidationError)
                              else PublishResult(job_id, False, error=str(refusal)))
        if waiting:
            await asyncio.wait([f for _, f in waiting], timeout=self.confirm_timeout)
        for unit, fut in waiting:
            error: str | None
            if not fut.done():
                fut.cancel()
                error = f"no publisher confirm within {self.confirm_timeout:g} s"
            else:
                error = fut.result()
            for i in unit:
                msg = batch[i].message
                if error is None:
                    results[i] = PublishResult(msg.job_id, True, msg.id_text)
                else:
                    if "unroutable" in error:
                        self._declared.discard(msg.queue)  # declare it again next time
                    results[i] = PublishResult(msg.job_id, False, error=error)
        return [r for r in results if r is not None]

    def _send(self, pub: Publisher, batch: Sequence[Outgoing], bodies: Sequence[bytes | None],
              unit: list[int], start: float, plugin: bool) -> asyncio.Future[str | None]:
        """Write one message — a job, or a pack of due jobs — and return
        the future of its confirm."""
        msg = batch[unit[0]].message
        if len(unit) == 1:
            out = batch[unit[0]]
            # The delay counts from when the broker enqueues the message,
            # which is after this moment: time spent since the relay
            # computed it (>= ``start``) can come off, never more.
            delay = out.delay - (time.monotonic() - start) if out.delay > 0 else 0.0
            route = self.topology.route(msg.queue, delay, plugin)
            body = bodies[unit[0]] or msg.encode()
            props = properties(msg, route)
        else:
            route = self.topology.route(msg.queue, 0.0, plugin)
            body = amqp_pack.encode([b for i in unit if (b := bodies[i]) is not None])
            props = pack_properties([batch[i].message for i in unit], route)
        if len(body) > PAYLOAD_LIMIT:
            raise ValidationError("payload", f"must encode to at most {PAYLOAD_LIMIT} bytes "
                                  "on RabbitMQ", len(body))
        return pub.send(route, body, props)

    def locate(self, job: EnqueuedRef, now: datetime) -> str:
        """The tier a delayed message is in, from the delay it was published
        with (or the plugin's exchange: which one is decided at connect)."""
        if job.due_at <= now or job.published_at is None:
            return f"in the RabbitMQ queue {job.queue}"
        ms = delay_ms((job.due_at - job.published_at).total_seconds())
        elapsed = (now - job.published_at).total_seconds() * 1000
        return (f"in RabbitMQ delay {self.topology.tier_at(ms, elapsed)} (tier topology; with the "
                f"delayed-message plugin, in its exchange)")

    # --- consume -------------------------------------------------------------

    async def consume(self, queues: Sequence[str], prefetch: int,
                      wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        names = list(dict.fromkeys(queues)) or ["default"]
        for name in names:
            check_queue_name(self.topology, name)
        backoff = 0.2
        while True:
            try:
                chan, inbox = await self._start_consuming(names, prefetch)
            except BrokerError as exc:
                self._log.warning("consume", "cannot consume from RabbitMQ (%s); retrying in "
                                  "%.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.2
            getter: asyncio.Future[Delivery] | None = None
            intake = _Intake(prefetch)
            following = asyncio.create_task(self._follow(chan, inbox, intake, prefetch, wanted,
                                                         names))
            try:
                while chan.is_open:
                    # What pika has already handed over goes out without a
                    # wait (a future and a wait per message were a good part
                    # of a delivery's cost); only an empty inbox is awaited.
                    while not inbox.empty():
                        yield inbox.get_nowait()
                    await self._fit_qos(chan, intake, prefetch, wanted, names)
                    getter = asyncio.ensure_future(inbox.get())
                    await asyncio.wait({getter, chan.closed}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        break
                    delivery, getter = getter.result(), None
                    yield delivery
            finally:
                following.cancel()
                if getter is not None:
                    getter.cancel()
                self._stop_consuming(chan, inbox)
                self._declared.difference_update(names)  # a deleted queue is declared again
            self._log.warning("channel-closed", "RabbitMQ consumer channel closed (%s); "
                              "consuming again", describe(chan.closed.result()))

    def wanted_changed(self) -> None:
        self._wanted_changed.set()

    async def _fit_qos(self, chan: Channel, intake: _Intake, prefetch: int,
                       wanted: Callable[[], int] | None, names: Sequence[str]) -> None:
        """The prefetch follows how many jobs the worker wants in hand
        (short handlers: many), counted in messages (a pack holds several
        jobs): asked again at most twice a second and only when it changed
        by a quarter — or at once when it halved (threads taken by long
        handlers), so RabbitMQ sends the rest to other consumers."""
        size = max(1, math.ceil(buffer_size(prefetch, wanted) / self._per_message))
        qos = intake.qos
        if (abs(size - qos) * 4 >= qos and time.monotonic() - intake.at >= 0.5) or (
                size * 2 <= qos):
            intake.qos, intake.at = size, time.monotonic()
            await chan.rpc(chan.ch.basic_qos, prefetch_count=size,
                           global_qos=self._shared_qos(names))

    async def _follow(self, chan: Channel, inbox: asyncio.Queue[Delivery], intake: _Intake,
                      prefetch: int, wanted: Callable[[], int] | None,
                      names: Sequence[str]) -> None:
        """While the worker takes nothing in (every thread of it runs a long
        handler) the consume loop does not run: keep the prefetch fitted
        anyway, and hand what RabbitMQ already sent to other consumers (each
        published again at once, :meth:`hand_back`)."""
        if wanted is None:
            return
        try:
            while chan.is_open:
                await wait_any(_FOLLOW_EVERY, self._wanted_changed)
                self._wanted_changed.clear()
                await self._fit_qos(chan, intake, prefetch, wanted, names)
                while wanted() == 0 and not inbox.empty():
                    await self.hand_back(inbox.get_nowait())
        except BrokerError:
            return  # the channel went: consume() starts again
        except Exception as exc:  # a bug: said once, never a silent stop
            self._log.warning(f"follow:{type(exc).__name__}", "fitting the prefetch failed "
                              "(%s: %s)", type(exc).__name__, exc, exc_info=True)

    def _stop_consuming(self, chan: Channel, inbox: asyncio.Queue[Delivery]) -> None:
        """Consumption ends (the worker stops, or consumes afresh): RabbitMQ
        stops sending, and what it sent that was never handed out goes back
        at once.  The channel stays open until close(): the deliveries still
        being handled are acked on it when their jobs finish.  Closing it here
        (before them) left the last finished jobs' messages in the queue, to
        be delivered again to the next worker."""
        if not chan.is_open:
            return
        self._retired.append(chan)
        while len(self._retired) > _RETIRED_MOST:  # unsettled that long: redelivered
            with contextlib.suppress(Exception):
                self._retired.pop(0).ch.close()
        with contextlib.suppress(Exception):
            for tag in list(chan.ch.consumer_tags):
                chan.ch.basic_cancel(tag)
        while not inbox.empty():
            self.release(inbox.get_nowait())

    def release(self, delivery: Delivery) -> None:
        """Back to the queue at once; a pack's job given back, to be
        published again once the pack's other jobs are settled (a pack with
        jobs still out is settled when they are)."""
        chan, tag, part = delivery.raw
        if part is None:
            chan.requeue(tag)
            return
        settled = part[0].settle(part[1], delivery.message, handled=False)
        if settled is not None:
            task = asyncio.get_running_loop().create_task(
                self._settle_pack(chan, tag, part[0], settled))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _start_consuming(self, names: list[str], prefetch: int
                               ) -> tuple[Channel, asyncio.Queue[Delivery]]:
        errors = await self.declare_queues(names)
        if errors:
            raise BrokerError("; ".join(map(str, errors.values())))
        link = await self._connected()
        chan = await link.channel()
        inbox: asyncio.Queue[Delivery] = asyncio.Queue()

        def on_message(_ch: Any, method: Any, props: Any, body: bytes) -> None:
            if chan in self._retired:  # sent before RabbitMQ saw the cancel
                chan.requeue(method.delivery_tag)
                return
            # An exception here escapes into pika's I/O callback and drops the
            # connection, and the message comes back, forever: self.delivery()
            # never raises, whatever the body holds.
            chan.delivered(method.delivery_tag)
            headers = props.headers or {}
            extra = {"headers": headers, "message_id": props.message_id,
                     "exchange": method.exchange, "routing_key": method.routing_key}
            if HEADER_PACK in headers:
                for delivery in self._unpack(body, chan, method.delivery_tag,
                                             bool(method.redelivered), extra):
                    inbox.put_nowait(delivery)
                return
            self._per_message += 0.1 * (1.0 - self._per_message)
            inbox.put_nowait(self.delivery(
                body, raw=(chan, method.delivery_tag, None),
                redelivered=bool(method.redelivered), extra=extra))

        await chan.rpc(chan.ch.basic_qos, prefetch_count=prefetch,
                       global_qos=self._shared_qos(names))
        chan.ch.add_on_cancel_callback(lambda frame: chan.ch.close() if chan.is_open else None)
        for name in names:
            await chan.rpc(chan.ch.basic_consume, self.topology.queue(name), on_message)
        return chan, inbox

    def _unpack(self, body: bytes, chan: Channel, tag: int, redelivered: bool,
                extra: dict[str, Any]) -> list[Delivery]:
        """A pack's deliveries, one per job (brokers/amqp_pack.py); a pack
        that does not decode as a whole is one undecodable delivery (the
        worker rejects it, into the dead-letter queue).  Never raises: it
        runs in pika's I/O callback."""
        try:
            jobs = amqp_pack.decode(body, self.capabilities.payload_limit)
        except Exception as exc:
            reason = exc.reason if isinstance(exc, MessageDecodeError) else "undecodable"
            return [Delivery(message=None, raw=(chan, tag, None), redelivered=redelivered,
                             decode_error=str(exc)[:300], decode_reason=reason, extra=extra)]
        self._per_message += 0.1 * (len(jobs) - self._per_message)
        pack = amqp_pack.Pack(len(jobs))
        out = []
        for j, job in enumerate(jobs):
            if isinstance(job, JobMessage):
                out.append(Delivery(message=job, raw=(chan, tag, (pack, j)),
                                    redelivered=redelivered, extra=extra))
            else:
                out.append(Delivery(message=None, raw=(chan, tag, (pack, j)),
                                    redelivered=redelivered, decode_error=str(job),
                                    decode_reason=job.reason, extra=extra))
        return out

    def _shared_qos(self, names: Sequence[str]) -> bool:
        """Several queues share one prefetch window per channel (global
        qos); quorum queues only support per-consumer prefetch."""
        return len(names) > 1 and self.topology.queue_type == "classic"

    async def ack(self, delivery: Delivery) -> None:
        # On a closed channel: the broker redelivers, the worker drops it.
        chan, tag, part = delivery.raw
        if part is None:
            chan.ack(tag)
            return
        settled = part[0].settle(part[1])
        if settled is not None:
            await self._settle_pack(chan, tag, part[0], settled)

    async def _settle_pack(self, chan: Channel, tag: int, pack: amqp_pack.Pack,
                           settled: str) -> None:
        """A pack whose every job is settled: acked; requeued, if none of
        it was handled; or, if some of it was, its jobs never handled
        published again first, then acked, so the jobs that finished do not
        come back (requeued after all if that publish fails: their copies
        are then discarded by the version check, and nothing is lost)."""
        if settled == "republish":
            try:
                again = await self.publish([Outgoing(m, 0.0) for m in pack.given_back])
                settled = "ack" if all(r.ok for r in again) else "requeue"
            except Exception as exc:  # the broker went away: back whole
                self._log.warning("pack-give-back", "could not publish the %d unhandled jobs "
                                  "of a pack again (%s); it goes back whole",
                                  len(pack.given_back), exc)
                settled = "requeue"
        if settled == "ack":
            chan.ack(tag)
        else:
            chan.requeue(tag)

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """Each channel's deliveries in as few acks as it allows (a run of
        the lowest unsettled tags is one ``multiple`` ack); a pack's message
        once the last of its jobs is settled."""
        by_channel: dict[int, tuple[Channel, list[int]]] = {}
        for delivery in deliveries:
            chan, tag, part = delivery.raw
            if part is not None:
                settled = part[0].settle(part[1])
                if settled is not None and settled != "ack":
                    await self._settle_pack(chan, tag, part[0], settled)
                if settled != "ack":
                    continue
            by_channel.setdefault(id(chan), (chan, []))[1].append(tag)
        for chan, tags in by_channel.values():
            chan.ack_many(tags)

    async def reject(self, delivery: Delivery, reason: str) -> None:
        chan, tag, part = delivery.raw
        if delivery.message is not None or part is not None:
            # Stale, cancelled, duplicate: done with it.  (An envelope of a
            # pack that did not decode cannot go to the dead-letter queue
            # alone; the worker has logged why it dropped it.)
            await self.ack(delivery)
        else:  # not a duebox message: keep it in the dead-letter queue
            chan.reject(tag)

    async def hand_back(self, delivery: Delivery) -> bool:
        """Another consumer should have it: published again at once, the
        delivery acked (a pack's job settled)."""
        return await self.defer(delivery, 0.0)

    async def defer(self, delivery: Delivery, seconds: float) -> bool:
        """Publish the message again with the remaining delay, then ack it.
        If the broker refuses the publish, False: the caller returns the job
        to the job table and acks the message.  Requeueing it instead put it
        back at the head of the queue, at once, forever (40 such messages
        filled the prefetch window and no other job ran)."""
        if delivery.message is None:
            await self.reject(delivery, "undecodable")
            return True
        try:
            result = (await self.publish([Outgoing(delivery.message, seconds)]))[0]
            ok, error = result.ok, result.error
        except (BrokerError, ValidationError) as exc:
            ok, error = False, str(exc)
        if ok:
            await self.ack(delivery)
            return True
        self._log.warning(f"defer:{error}"[:80], "could not defer job %s (%s); it goes back "
                          "to the job table", delivery.message.job_id, error)
        return False
