"""The seam every backend implements, and the record of what it can do.

A backend moves :class:`~duebox.message.JobMessage` envelopes from the relay
to workers.  It is a delivery path, never the source of truth: the job table
is.  Each backend states its semantics as data in :class:`Capabilities`; the
relay and the worker read them instead of special-casing backends, and the
shared contract suite checks each backend against what it declares.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from duebox.errors import AccessRefusedError, BrokerError, ConfigurationError, MessageDecodeError
from duebox.message import JobMessage
from duebox.observability.trouble import TROUBLES, Cause, cause_of
from duebox.registry import effective_max_delay
from duebox.seam import (
    BrokerContext,
    Capabilities,
    Durability,
    Ordering,
    Outgoing,
    PublishResult,
    refused,
)
from duebox.timing import HANDOVER_LEAD_SECONDS

log = logging.getLogger("duebox.broker")

if TYPE_CHECKING:
    import uuid

    from duebox.leases.records import JobRecord
    from duebox.leases.recovery import EnqueuedRef


@dataclass
class Delivery:
    """One message handed to a worker.  ``claimed`` is the job's row, leased,
    from backends that claim it themselves (``sql://``); absent, the worker
    starts the job with a version-checked update."""

    message: JobMessage | None
    raw: Any = None
    claimed: JobRecord | None = None
    # When ``claimed`` was leased: a claim made ahead of the due time, or
    # long before the handler starts, is re-read before it runs.
    claimed_at: datetime | None = None
    redelivered: bool = False
    decode_error: str | None = None
    # Why a message that did not decode is discarded (the metric's label).
    decode_reason: str = "undecodable"
    extra: dict[str, Any] = field(default_factory=dict)


# The most unacknowledged messages a backend buffers for one worker, however
# many it wants in hand (:func:`buffer_size`).
MAX_BUFFER = 256


def buffer_size(prefetch: int, wanted: Callable[[], int] | None) -> int:
    """How many unacknowledged messages a backend that buffers them should
    hold for a worker now: as many as the worker wants in hand (short
    handlers: a batch's worth per thread), up to :data:`MAX_BUFFER`, and as
    few as one while every thread of it runs a long handler — it takes
    nothing more in then, and what it would buffer goes to other workers
    (consumers/runner.py).  ``prefetch`` where the worker says nothing."""
    if wanted is None:
        return prefetch
    return max(1, min(wanted(), MAX_BUFFER))


def delivery_from_body(body: bytes | str, raw: Any = None, *, max_bytes: int | None = None,
                       **kw: Any) -> Delivery:
    """Decode at the boundary: garbage becomes a delivery the worker rejects
    with the reason, never an exception that stops consumption — whatever
    the body, and whatever goes wrong decoding it (``max_bytes``: the
    broker's message limit)."""
    try:
        return Delivery(message=JobMessage.decode(body, max_bytes), raw=raw, **kw)
    except MessageDecodeError as exc:
        return Delivery(message=None, raw=raw, decode_error=str(exc), decode_reason=exc.reason,
                        **kw)
    except Exception as exc:  # a decoder gap must not end consumption either
        return Delivery(message=None, raw=raw,
                        decode_error=f"body: cannot be decoded ({type(exc).__name__}: {exc})"[:300],
                        **kw)


class Broker(abc.ABC):
    """A delivery path.  Implementations are async and safe to use from one loop.

    Every backend consumes; those the relay publishes to are a
    :class:`PublishingBroker`.  A backend that is neither (``sql://``: its
    workers claim due rows from the job table) declares
    ``Capabilities.direct_claim``, and the relay publishes nothing there.
    """

    capabilities: Capabilities

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        caps = cls.__dict__.get("capabilities")
        # A backend that declares no direct claim must take the relay's
        # messages, or its jobs would never reach a worker.
        if isinstance(caps, Capabilities) and caps.direct_claim == issubclass(
                cls, PublishingBroker):
            kind = "must not" if caps.direct_claim else "must"
            raise TypeError(f"{cls.__name__}: a backend with direct_claim={caps.direct_claim} "
                            f"{kind} be a PublishingBroker")

    def __init__(self, url: str, context: BrokerContext) -> None:
        self.url = url
        self.context = context
        self.params = parse_params(url)
        self.max_delay = effective_max_delay(self.capabilities.max_delay, self.params)
        # Set by a worker: call when :meth:`registry_info` changed, so the
        # registry row says so at once.
        self.registry_changed: Callable[[], None] | None = None

    @classmethod  # noqa: B027 - an optional hook
    def check_queue_name(cls, url: str, name: str) -> None:
        """Raise :class:`ValidationError` (field ``queue``) if this backend,
        configured by ``url``, cannot use ``name`` as a queue.  Called through
        ``duebox.registry.check_queue_name`` (core never imports a backend)
        when a task is registered and a job scheduled, after the rule every
        backend shares; must not connect anywhere.  The default: no rule of
        its own."""

    def delivery(self, body: bytes | str, raw: Any = None, **kw: Any) -> Delivery:
        """A delivery of ``body`` (see :func:`delivery_from_body`), bounded by
        this backend's message limit: never raises."""
        return delivery_from_body(body, raw, max_bytes=self.capabilities.payload_limit, **kw)

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect and declare what is needed.  Must be idempotent."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections.  Must be idempotent."""

    @abc.abstractmethod
    def consume(self, queues: Sequence[str], prefetch: int,
                wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        """Yield deliveries for ``queues``, at most ``prefetch`` unacknowledged.

        ``wanted``: how many jobs the worker wants in hand right now (running
        or waiting to run).  A backend that claims jobs itself (``sql://``)
        claims up to it rather than a fixed multiple of ``prefetch``; one
        that buffers a broker's messages has ``prefetch`` for that.
        """

    async def ack(self, delivery: Delivery) -> None:  # noqa: B027 - optional hook
        """The job reached a final or rescheduled state: drop the message."""

    def release(self, delivery: Delivery) -> None:  # noqa: B027 - an optional hook
        """The worker took ``delivery`` but will never handle it (it is
        stopping).  The default leaves it unacknowledged: the broker hands it
        on when the consumer's connection closes, or after its visibility or
        claim timeout."""

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """:meth:`ack` each of these, in as few calls as the backend can (the
        batch lane settles many at once).  The default acks them together."""
        await asyncio.gather(*(self.ack(d) for d in deliveries))

    async def reject(self, delivery: Delivery, reason: str) -> None:
        """The message is not runnable (garbage, stale, cancelled): drop it."""
        await self.ack(delivery)

    async def defer(self, delivery: Delivery, seconds: float) -> bool:
        """Hide the message again for ``seconds`` (it arrived before its due
        time, e.g. clock skew).  False: the broker would not take it back and
        the message is still the caller's (who then returns the job to the
        job table and acks it) — never a retry loop here.  The default acks it
        and relies on the job's lease expiry to publish it again."""
        await self.ack(delivery)
        return True

    async def hand_back(self, delivery: Delivery) -> bool:
        """The worker holds ``delivery`` but cannot start it soon — every
        thread it has runs a long handler — so another consumer should
        have it now: give it back to the broker, visible at once.  False:
        this backend cannot (the worker keeps it and runs it when a thread
        is free).  The default cannot."""
        return False

    def wanted_changed(self) -> None:  # noqa: B027 - an optional hook
        """The worker's ``wanted()`` may have changed (a thread started or
        stopped running a long handler): a backend that sizes a buffer or
        claims by it looks again now rather than at its next wake-up.  The
        default: nothing."""

    async def cancel(self, job_ids: Sequence[uuid.UUID]) -> int:
        """Best effort, after a cancel committed: drop these jobs' messages that
        no worker has read yet; returns how many were dropped.  Only for
        cancelled jobs (a final state: no newer message can exist).  Nothing
        depends on it: the worker's version check discards a cancelled job's
        message.  The default, for backends that cannot, drops nothing."""
        return 0

    async def take_over(self, worker: str, info: Mapping[str, Any]) -> int:
        """A worker died (its liveness lock is gone, core/processes/liveness.py): hand
        the messages it had received and not settled to live consumers now;
        returns how many.  ``info``: its registry row (``queues``, ...).  Its jobs' rows
        are already recovered, so a handed-on message starts its job, or is
        discarded by the version check.  The default hands on nothing:
        RabbitMQ requeues a closed channel's unacked messages itself, SQS
        after the visibility timeout, Kafka after the group's session
        timeout and rebalance."""
        return 0

    def registry_info(self) -> dict[str, Any]:
        """What a worker's registry row should say about its consumer, for a
        peer's :meth:`take_over` after its death (Kafka: its group member id)."""
        return {}

    # --- for consumers of your own (docs/own-consumers.md) -----------------------

    def queue_name(self, queue: str) -> str:
        """The name under which this broker holds ``queue``'s messages: the
        queue, topic or stream a consumer of your own reads (no network
        call).  The default: a backend with no queue outside duebox."""
        raise ConfigurationError(
            f"broker_url: {self.capabilities.name}:// keeps queue {queue!r} to itself; "
            "a consumer of your own needs amqp://, sqs://, kafka:// or redis://")

    async def declare(self, queues: Sequence[str]) -> list[str]:
        """Create what ``queues`` need on the broker now, as the relay's first
        publish would, so a consumer of your own started before it finds its
        queue; idempotent.  Returns the names (:meth:`queue_name`)."""
        return [self.queue_name(q) for q in queues]  # raises for the default

    async def serve_own_queues(self, queues: Sequence[str], stop: asyncio.Event) -> None:
        """Run inside the relay until ``stop``, for queues a consumer of your
        own reads: whatever duebox's worker would otherwise do to make a
        delayed message readable (Redis: move parked messages onto the stream
        as they come due).  The default: nothing, the broker delays itself."""
        return

    def locate(self, job: EnqueuedRef, now: datetime) -> str:
        """Where the message of ``job`` (``ENQUEUED``) is at ``now``, in a few
        words for people (``duebox jobs show``, the dashboard): read from the
        job's row and this backend's delay mechanism, never from the broker
        (no network call).  The default names the backend."""
        return f"in the {self.capabilities.name} broker"

    async def missing(self, jobs: Sequence[EnqueuedRef]) -> list[uuid.UUID] | None:
        """Reconciliation: of these ``ENQUEUED`` jobs, the ids whose message
        (at that version) the broker no longer holds; the relay publishes them
        again.  ``None`` (the default) means the backend cannot tell."""
        return None

    async def data_lost(self) -> bool:
        """Cheap check the relay makes every pass: True when the broker knows
        it lost its data since the last call (Redis restarted empty), so the
        relay reconciles at once instead of at its next periodic sweep."""
        return False


    def lane_claims(self) -> LaneClaims | None:
        """The backend's side of a batch lane that claims due jobs itself
        (``sql://``, consumers/runner.py); None (the default): deliveries
        reach the lane only through :meth:`consume`."""
        return None


class LaneClaims(abc.ABC):
    """A backend whose workers claim rows from the job table lets the
    worker's batch lane claim the *due* ones itself, in the transaction that
    runs them (core/leases/batch_sql.py, ``lock_due``): no claim is written for a
    job the lane runs.  While the lane :meth:`leads`, the backend's own
    claimer takes only jobs not yet due (the hand-over ahead of the due time)
    and :attr:`wake` tells the lane when due rows wait; jobs the lane locked
    but will not run itself it leases in its transaction and hands back
    through :meth:`adopt`, to be delivered the usual way."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.leading = False

    def leads(self, on: bool) -> None:
        """Whether the lane claims the due rows (True) or the backend's
        claimer does, as without a lane (False)."""
        if on != self.leading:
            self.leading = on
            self.wake.set()
            self.changed()

    def changed(self) -> None:  # noqa: B027 - an optional hook
        """Called when :attr:`leading` changed (the claimer looks again)."""

    @abc.abstractmethod
    def adopt(self, records: Sequence[JobRecord], claimed_at: datetime) -> None:
        """Deliver these jobs, leased by the lane's transaction (committed),
        as if the backend had claimed them at ``claimed_at``."""


class PublishingBroker(Broker):
    """A backend the relay hands due jobs to (all but ``sql://``)."""

    @abc.abstractmethod
    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        """Hand messages to the broker; return one result per message, in order.

        A result is ``ok`` only when the broker confirmed it durably; the
        relay marks ``ENQUEUED`` only those.  A message must not become
        visible to consumers before ``delay`` has passed.  Send what
        ``message.encode()`` gives: a relay's message may carry its payload
        as the stored JSON text (``duebox.message.RawJSON``), which only the
        body knows how to embed.
        """


async def open_broker(broker: Broker, stop: asyncio.Event, *,
                      refusals_only: bool = False) -> bool:
    """Open ``broker``, retrying with backoff while it is unreachable (a
    broker briefly down at start must not kill the process); False if
    ``stop`` was set first.  Configuration errors are raised at once, and a
    refusal (a wrong login or vhost) once it outlasts the grace of
    duebox.observability.trouble: :class:`~duebox.errors.AccessRefusedError`.  What it
    meets is said once per cause per interval (duebox.observability.trouble).
    ``refusals_only``: retry refusals only; False at once when the broker is
    out of reach (a look before the process starts, which leaves an outage
    to the process's own retrying)."""
    backoff = 0.2
    name = broker.capabilities.name
    while not stop.is_set():
        try:
            await broker.open()
            return True
        except BrokerError as exc:
            cause = cause_of(exc) or Cause(f"unreachable: broker {name}",
                                           f"broker {name} unreachable: {exc}")
            if refusals_only and not cause.permanent:
                return False
            TROUBLES.report(cause, log, f"opening the {name} broker", stops=True)
            if TROUBLES.final(cause):
                raise AccessRefusedError(TROUBLES.ended(cause)) from exc
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            backoff = min(backoff * 2, 10.0)
    return False


def parse_params(url: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))


# The seam's shared types (core/seam.py) are re-exported: backends and users
# import them from here.
__all__ = [
    "HANDOVER_LEAD_SECONDS",
    "MAX_BUFFER",
    "Broker",
    "BrokerContext",
    "Capabilities",
    "Delivery",
    "Durability",
    "LaneClaims",
    "Ordering",
    "Outgoing",
    "PublishResult",
    "buffer_size",
    "delivery_from_body",
    "open_broker",
    "parse_params",
    "refused",
]
