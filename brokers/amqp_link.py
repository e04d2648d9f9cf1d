"""pika's asyncio adapter as awaitables, for :mod:`duebox.brokers.amqp`.

pika's ``AsyncioConnection`` is callback-driven; these wrappers turn its
callbacks into futures: :class:`Link` (a connection), :class:`Channel` (RPCs
that fail when the broker closes the channel, and pipelined declarations) and
:class:`Publisher` (a confirm-mode channel on which every publish has a
future resolved by its ack, nack or return).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from duebox.errors import (
    BrokerError,
    BrokerRefusedError,
    BrokerUnreachableError,
    ConfigurationError,
    MissingDependencyError,
)
from duebox.message import HEADER_DUE_AT, JobMessage
from duebox.observability.logs import collapse_library_logs

try:
    import pika
    import pika.exceptions
    import pika.spec
    from pika.adapters.asyncio_connection import AsyncioConnection
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("pika", "rabbitmq") from exc

from .amqp_hosts import node_urls
from .amqp_pack import HEADER_PACK
from .amqp_topology import ExchangeBind, ExchangeDecl, Op, QueueBind, QueueDecl, Route

# pika logs each failed connection attempt at ERROR in some nine lines: a
# RabbitMQ cut of 8 s wrote ~1,400 of them.  Once per kind per 30 s, with a
# count (duebox.observability.logs); duebox says what it does about it in its own lines.
PIKA_LOGS = collapse_library_logs("pika")


class _Without(logging.Filter):
    def __init__(self, texts: tuple[str, ...]) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not all(t in message for t in self.texts)


@contextlib.contextmanager
def pika_logs_without(*texts: str) -> Iterator[None]:
    """Hold back pika's records that contain all ``texts`` while inside: a probe
    whose expected failure closes the connection (RabbitMQ answers an
    unknown exchange type with a 503 on the whole connection) would otherwise
    have pika log the ``ConnectionClosedByBroker`` like an outage.  Only
    records with those texts are held back, whichever connection made them
    (pika quotes the broker's reason differently at each level)."""
    drop = _Without(texts)
    names = ["pika", *(n for n in list(logging.root.manager.loggerDict)
                       if n.startswith("pika."))]
    loggers = [logging.getLogger(n) for n in names]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


RPC_TIMEOUT = 30.0
CONNECT_TIMEOUT = 10.0


def properties(msg: JobMessage, route: Route) -> Any:
    return pika.BasicProperties(
        content_type="application/json",
        delivery_mode=2,  # persistent
        message_id=msg.id_text,
        timestamp=int(time.time()),
        type=msg.task,
        headers={**msg.header_map(), **route.headers},
    )


def pack_properties(messages: Sequence[JobMessage], route: Route) -> Any:
    """A pack's properties (brokers/amqp_pack.py): persistent, and headers
    saying how many jobs it carries, due by the last one's due time."""
    return pika.BasicProperties(
        content_type="application/json",
        delivery_mode=2,  # persistent
        message_id=f"pack:{messages[0].job_id}",
        timestamp=int(time.time()),
        type="duebox-pack",
        headers={HEADER_PACK: str(len(messages)),
                 HEADER_DUE_AT: max(m.due_at for m in messages).isoformat(), **route.headers},
    )


def pika_parameters(url: str, worker_name: str, own_params: frozenset[str]) -> list[Any]:
    """pika's parameters for each node the URL names (brokers/amqp_hosts.py),
    without duebox's own query parameters."""
    return [_node_parameters(u, worker_name, own_params) for u in node_urls(url)]


def _node_parameters(url: str, worker_name: str, own_params: frozenset[str]) -> Any:
    split = urlsplit(url)
    if split.username is not None and split.password is None:
        # pika raises a bare TypeError on such a URL.
        raise ConfigurationError(
            f"broker_url: names the user {split.username!r} but no password; write "
            f"{split.scheme}://USER:PASSWORD@host (or neither, for RabbitMQ's guest:guest)")
    query = [(k, v) for k, v in parse_qsl(split.query, keep_blank_values=True)
             if k not in own_params]
    try:
        params = pika.URLParameters(urlunsplit(split._replace(query=urlencode(query))))
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"broker_url: {exc}") from None
    params.client_properties = {"connection_name": f"duebox {worker_name}"}
    if not any(k == "connection_attempts" for k, _ in query):
        params.connection_attempts = 1  # duebox retries with its own backoff
    return params


def _resolver(fut: asyncio.Future[Any]) -> Callable[[Any], None]:
    def resolve(value: Any) -> None:
        if not fut.done():
            fut.set_result(value)
    return resolve


def _innermost(exc: BaseException) -> BaseException:
    """The useful part of pika's nested connection errors."""
    for _ in range(5):
        inner = getattr(exc, "exceptions", None) or getattr(exc, "exception", None) or (
            exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else None)
        if isinstance(inner, tuple | list):
            inner = inner[-1]
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc


def _cause(exc: BaseException) -> str:
    exc = _innermost(exc)
    return describe(exc) if isinstance(exc, pika.exceptions.ConnectionClosed) else repr(exc)


# RabbitMQ's answer to a login it does not accept (403) and to a vhost that
# is not there or not permitted (530), quoted by pika as "(403) 'ACCESS_REFUSED - ...'".
_REFUSED_CODES = (403, 530)
_QUOTED_REPLY = re.compile(r"\((\d{3})\) '([^']*)'")


def _refusal(exc: BaseException) -> str | None:
    """RabbitMQ's words when it answered and refused the connection (a
    configuration error: see duebox.errors.BrokerRefusedError), else None."""
    exc = _innermost(exc)
    if isinstance(exc, pika.exceptions.ConnectionClosed):
        return describe(exc) if exc.reply_code in _REFUSED_CODES else None
    if isinstance(exc, pika.exceptions.ProbableAuthenticationError
                  | pika.exceptions.ProbableAccessDeniedError):
        quoted = _QUOTED_REPLY.search(str(exc))
        if quoted is not None:
            return f"{quoted.group(1)} {quoted.group(2)}"
        return ("login refused" if isinstance(exc, pika.exceptions.ProbableAuthenticationError)
                else "access to the vhost refused")
    return None


def _connect_error(params: Any, exc: BaseException) -> BrokerUnreachableError:
    """What a failed connection attempt raises: a refusal, or out of reach."""
    at = f"RabbitMQ at {params.host}:{params.port}"
    refused = _refusal(exc)
    if refused is not None:
        user = getattr(params.credentials, "username", "?")
        return BrokerRefusedError(f"{at} (vhost {params.virtual_host!r}, user {user!r})",
                                  f"{refused.rstrip('.')}; check the broker URL's user, "
                                  "password and vhost")
    return BrokerUnreachableError(at, _cause(exc))


def describe(reason: object) -> str:
    if isinstance(reason, pika.exceptions.ChannelClosed | pika.exceptions.ConnectionClosed):
        return f"{reason.reply_code} {reason.reply_text}"
    return str(reason) or type(reason).__name__


def chan_code(exc: BaseException) -> int | None:
    cause = exc.__cause__
    if isinstance(cause, pika.exceptions.ChannelClosed | pika.exceptions.ConnectionClosed):
        return int(cause.reply_code)
    return None


class Connection(AsyncioConnection):  # type: ignore[misc]
    def _output_marshaled_frames(self, marshaled_frames: Sequence[bytes]) -> None:
        # One write (one send(2)) per message instead of one per frame.
        if len(marshaled_frames) > 1:
            marshaled_frames = [b"".join(marshaled_frames)]
        super()._output_marshaled_frames(marshaled_frames)


class Link:
    """One pika ``AsyncioConnection``; ``params``: the node's it went to."""

    def __init__(self, conn: Any, closed: asyncio.Future[Any], params: Any) -> None:
        self.conn = conn
        self.closed = closed
        self.params = params

    @classmethod
    async def connect_any(cls, nodes: Sequence[Any]) -> Link:
        """A connection to the first of ``nodes`` that accepts one.  A node
        that is down answers a connect at once (refused), so a cluster's
        survivors are reached without delay; one that does not answer costs
        CONNECT_TIMEOUT before the next is tried."""
        if len(nodes) == 1:
            return await cls.connect(nodes[0])
        failures: list[str] = []
        for params in nodes:
            try:
                return await cls.connect(params)
            except BrokerRefusedError:
                raise  # one cluster, one set of users: another node refuses it too
            except BrokerError as exc:
                failures.append(str(exc).removeprefix("cannot connect to RabbitMQ at "))
        raise BrokerUnreachableError(f"any of {len(failures)} RabbitMQ nodes",
                                     "; ".join(failures))

    @classmethod
    async def connect(cls, params: Any) -> Link:
        loop = asyncio.get_running_loop()
        opened: asyncio.Future[Any] = loop.create_future()
        closed: asyncio.Future[Any] = loop.create_future()

        def on_open(conn: Any) -> None:
            if not opened.done():
                opened.set_result(conn)

        def on_open_error(_conn: Any, exc: BaseException) -> None:
            if not opened.done():
                opened.set_exception(_connect_error(params, exc))

        def on_close(_conn: Any, exc: BaseException) -> None:
            if not closed.done():
                closed.set_result(exc)
            on_open_error(_conn, exc)

        try:
            conn = Connection(params, on_open_callback=on_open,
                                     on_open_error_callback=on_open_error,
                                     on_close_callback=on_close, custom_ioloop=loop)
        except pika.exceptions.AMQPError as exc:
            raise BrokerError(f"cannot connect to RabbitMQ: {exc!r}") from exc
        try:
            await asyncio.wait_for(opened, timeout=CONNECT_TIMEOUT)
        except TimeoutError:
            with contextlib.suppress(Exception):
                conn.close()
            raise BrokerUnreachableError(f"RabbitMQ at {params.host}:{params.port}",
                                         "timed out") from None
        return cls(conn, closed, params)

    @property
    def is_open(self) -> bool:
        return not self.closed.done() and bool(self.conn.is_open)

    @property
    def close_code(self) -> int | None:
        if self.closed.done() and isinstance(self.closed.result(),
                                             pika.exceptions.ConnectionClosed):
            return int(self.closed.result().reply_code)
        return None

    async def channel(self) -> Channel:
        loop = asyncio.get_running_loop()
        opened: asyncio.Future[Any] = loop.create_future()
        try:
            self.conn.channel(on_open_callback=_resolver(opened))
        except pika.exceptions.AMQPError as exc:
            raise BrokerError(f"cannot open a RabbitMQ channel: {exc!r}") from exc
        await asyncio.wait({opened, self.closed}, timeout=RPC_TIMEOUT,
                           return_when=asyncio.FIRST_COMPLETED)
        if not opened.done():
            raise BrokerError("cannot open a RabbitMQ channel: "
                              + (describe(self.closed.result()) if self.closed.done()
                                 else "timed out"))
        return Channel(opened.result())

    async def close(self) -> None:
        if self.conn.is_closed:
            return
        with contextlib.suppress(pika.exceptions.AMQPError):
            if not self.conn.is_closing:
                self.conn.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.closed), timeout=5.0)


class Channel:
    """A pika channel whose RPCs can be awaited; ``closed`` resolves with the
    reason when the broker (or the connection) closes it."""

    def __init__(self, ch: Any) -> None:
        self.ch = ch
        self.closed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        ch.add_on_close_callback(self._on_close)
        # Delivery tags handed to this consumer and not yet settled: the
        # lowest ones, when acked together, take one ``multiple`` ack.
        self.unsettled: set[int] = set()

    def _on_close(self, _ch: Any, reason: BaseException) -> None:
        if not self.closed.done():
            self.closed.set_result(reason)

    @property
    def is_open(self) -> bool:
        return not self.closed.done() and bool(self.ch.is_open)

    def delivered(self, tag: int) -> None:
        self.unsettled.add(tag)

    def ack(self, tag: int) -> None:
        self._settle(self.ch.basic_ack, tag)

    def ack_many(self, tags: Sequence[int]) -> None:
        """Ack these deliveries with as few frames as the broker allows: the
        run of them that starts at the lowest unsettled tag is one ``basic.ack``
        with ``multiple`` (which acks every unsettled tag up to it, so only
        a run with no other delivery inside it may go that way); the rest
        one by one."""
        acking = sorted(set(tags) & self.unsettled)
        run = 0
        for tag in sorted(self.unsettled):
            if run == len(acking) or tag != acking[run]:
                break
            run += 1
        if run > 1:
            self.unsettled.difference_update(acking[:run])
            if self.is_open:
                with contextlib.suppress(pika.exceptions.AMQPError):
                    self.ch.basic_ack(acking[run - 1], multiple=True)
            acking = acking[run:]
        for tag in acking:
            self.ack(tag)

    def reject(self, tag: int) -> None:
        """Reject without requeueing: into the queue's dead-letter exchange."""
        self._settle(self.ch.basic_reject, tag, requeue=False)

    def requeue(self, tag: int) -> None:
        self._settle(self.ch.basic_nack, tag, requeue=True)

    def _settle(self, method: Callable[..., Any], tag: int, **kw: Any) -> None:
        # A delivery tag is only valid on the channel that delivered it; once
        # that channel is gone the broker has requeued the message already.
        self.unsettled.discard(tag)
        if self.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                method(tag, **kw)

    async def rpc(self, method: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            method(*args, callback=_resolver(fut), **kw)
        except pika.exceptions.AMQPError as exc:
            raise BrokerError(f"RabbitMQ channel unusable: {exc!r}") from exc
        await asyncio.wait({fut, self.closed}, timeout=RPC_TIMEOUT,
                           return_when=asyncio.FIRST_COMPLETED)
        if fut.done():
            return fut.result()
        if self.closed.done():
            reason = self.closed.result()
            raise BrokerError(describe(reason)) from reason
        raise BrokerError(f"RabbitMQ did not answer within {RPC_TIMEOUT:g} s")

    async def apply(self, ops: Sequence[Op]) -> None:
        """Send declarations pipelined (no-wait), then one synchronous one: the
        broker handles them in order and closes the channel at the first
        failure, so the last reply means all of them succeeded."""
        for op in ops[:-1]:
            self._declare(op, None)
        if ops:
            await self.rpc(lambda callback: self._declare(ops[-1], callback))

    def _declare(self, op: Op, callback: Callable[[Any], Any] | None) -> None:
        ch = self.ch
        try:
            if isinstance(op, ExchangeDecl):
                ch.exchange_declare(op.name, op.type, durable=op.durable, internal=op.internal,
                                    arguments=op.arguments or None, callback=callback)
            elif isinstance(op, QueueDecl):
                ch.queue_declare(op.name, durable=op.durable, arguments=op.arguments or None,
                                 callback=callback)
            elif isinstance(op, QueueBind):
                ch.queue_bind(op.queue, op.exchange, op.routing_key, callback=callback)
            elif isinstance(op, ExchangeBind):
                ch.exchange_bind(op.destination, op.source, op.routing_key, callback=callback)
        except pika.exceptions.AMQPError as exc:
            raise BrokerError(f"RabbitMQ channel unusable: {exc!r}") from exc


@dataclass
class Pending:
    future: asyncio.Future[str | None]
    message_id: str
    returned: str | None = None


@dataclass
class Publisher:
    """A confirm-mode channel: publishes are written at once and each one's
    future resolves with ``None`` (acked, routed) or the error."""

    chan: Channel
    seq: int = 0
    pending: dict[int, Pending] = field(default_factory=dict)
    by_id: dict[str, deque[int]] = field(default_factory=dict)

    @classmethod
    async def start(cls, chan: Channel) -> Publisher:
        pub = cls(chan)
        await chan.rpc(chan.ch.confirm_delivery, pub._on_confirm)
        chan.ch.add_on_return_callback(pub._on_return)
        chan.closed.add_done_callback(pub._on_closed)
        return pub

    def send(self, route: Route, body: bytes, props: Any) -> asyncio.Future[str | None]:
        if not self.chan.is_open:
            raise BrokerError("the publishing channel is closed")
        fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        try:
            self.chan.ch.basic_publish(route.exchange, route.routing_key, body, props,
                                       mandatory=route.mandatory)
        except pika.exceptions.AMQPError as exc:
            raise BrokerError(f"publish failed: {exc!r}") from exc
        self.seq += 1
        self.pending[self.seq] = Pending(fut, props.message_id)
        self.by_id.setdefault(props.message_id, deque()).append(self.seq)
        return fut

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        tags = [method.delivery_tag]
        if method.multiple:
            tags = []
            for tag in self.pending:
                if tag > method.delivery_tag:
                    break
                tags.append(tag)
        for tag in tags:
            pending = self.pending.pop(tag, None)
            if pending is None:
                continue
            ids = self.by_id.get(pending.message_id)
            if ids is not None:
                with contextlib.suppress(ValueError):
                    ids.remove(tag)
                if not ids:
                    del self.by_id[pending.message_id]
            error = pending.returned if acked else "nacked by the broker"
            if not pending.future.done():
                pending.future.set_result(error)

    def _on_return(self, _ch: Any, method: Any, props: Any, _body: bytes) -> None:
        # RabbitMQ sends basic.return before the ack of the same message.
        for tag in self.by_id.get(props.message_id, ()):
            pending = self.pending.get(tag)
            if pending is not None and pending.returned is None:
                pending.returned = (f"unroutable: {method.reply_code} {method.reply_text} "
                                    f"(exchange {method.exchange!r}, routing key "
                                    f"{method.routing_key!r})")
                return

    def _on_closed(self, closed: asyncio.Future[Any]) -> None:
        reason = describe(closed.result())
        for pending in self.pending.values():
            if not pending.future.done():
                pending.future.set_result(f"channel closed before the broker confirmed: "
                                          f"{reason}")
        self.pending.clear()
        self.by_id.clear()
