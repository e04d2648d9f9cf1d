"""``sqs://`` — Amazon SQS (or LocalStack) through boto3 in a bounded thread pool.

One SQS queue per duebox queue, named ``PREFIX + queue`` (``.fifo`` added on
FIFO queues), created on first use unless ``?create=false``.

*Standard queues* (the default) delay each message natively with
``DelaySeconds``: at most 900 s, whole seconds.  The relay rounds every delay
**up** to the second, so a message never becomes visible before its due
time; jobs due farther out stay parked in the database and are published as
they come within 900 s (``?max_delay=`` lowers that).  *FIFO queues*
(``?fifo=true``) have no per-message delay: the backend declares a ceiling of
0, so the relay keeps jobs parked until due, holds the last second or so in
memory and publishes each at its due time.  ``MessageDeduplicationId`` is the
outbox id and the job's version (a retry or reschedule is a new version and
must not be swallowed by SQS's five-minute deduplication window);
``MessageGroupId`` is the job's ``ordering_key`` header, else its id.

Publishing uses ``SendMessageBatch`` (10 entries and ``max_message_size``
bytes per call) with several calls in flight.  Only the entries SQS reports
as failed are retried; throttling and server errors back off exponentially.
A message over ``max_message_size`` (256 KiB unless configured) is refused
before anything is sent, with an error naming the limit.

Workers long-poll ``ReceiveMessage``.  While a handler runs, its message's
visibility timeout is extended (``ChangeMessageVisibilityBatch``): that is the
heartbeat of long handlers.  A worker that dies stops extending; the message
reappears after ``visibility_timeout`` and the version check plus the SQL
dedupe store drop what already ran.  A message received before its due time
(clock skew) is hidden again for the remainder with ``ChangeMessageVisibility``.
``ack`` is a batched ``DeleteMessage``.

SQS cannot be asked whether it still holds a message, but it can say when a
queue was created: a queue that was deleted and created again (a LocalStack
restart, an operator's mistake) lost every message sent before that moment.
:meth:`SQSBroker.data_lost` notices a queue that vanished or changed its
``CreatedTimestamp``; :meth:`SQSBroker.missing` then names the ``ENQUEUED``
jobs published before the queue's creation, and the relay publishes them again.

URL: ``sqs://[KEY:SECRET@][HOST[:PORT]]?region=&endpoint=&prefix=duebox-&fifo=false
&wait=10&visibility_timeout=3&threads=8&max_message_size=262144&create=true
&check_interval=60&tls=&max_delay=``.  A host in the URL is the endpoint
(``http://`` for localhost and 127.0.0.1, else ``https://``; ``?tls=`` decides);
without one, boto3 finds AWS's endpoint, credentials and region as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from duebox.errors import (
    BrokerError,
    ConfigurationError,
    MissingDependencyError,
    ValidationError,
)
from duebox.logs import CollapsedLog
from duebox.message import JobMessage

from ._common import safe_token
from .base import (
    BrokerContext,
    Capabilities,
    Delivery,
    Outgoing,
    PublishingBroker,
    PublishResult,
    refused,
)
from .sqs_settings import MAX_DELAY_SECONDS, MAX_VISIBILITY, SQSSettings

try:
    import boto3
    import botocore.config
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError
except ImportError as exc:  # pragma: no cover - exercised by a test with the module hidden
    raise MissingDependencyError("boto3", "sqs") from exc

if TYPE_CHECKING:
    from duebox.jobstore import EnqueuedRef

log = logging.getLogger("duebox.brokers.sqs")

T = TypeVar("T")

BATCH = 10
_SEND_ATTEMPTS = 6
_NOT_FOUND = ("AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist")
_THROTTLED = ("ThrottlingException", "RequestThrottled", "Throttling", "ServiceUnavailable",
              "InternalError", "InternalFailure", "KMS.ThrottlingException",
              "AWS.SimpleQueueService.RequestThrottled", "RequestThrottledException")
_DEAD_LETTER = "dead-letter"


@dataclass
class _Entry:
    """One message on its way into a ``SendMessageBatch`` call."""

    index: int
    request: dict[str, Any]
    size: int
    visible_at: float | None  # epoch seconds; None: at once
    send_at: float  # epoch seconds


@dataclass
class _InFlight:
    url: str
    queue: str
    received: float  # monotonic
    deadline: float  # monotonic: when the message would reappear


@dataclass
class _Pending:
    items: list[tuple[str, asyncio.Future[str | None]]] = field(default_factory=list)
    scheduled: bool = False


def _code(exc: ClientError) -> str:
    error = exc.response.get("Error", {})
    return str(error.get("Code") or error.get("QueryErrorCode") or "")


def _not_found(exc: BaseException) -> bool:
    if not isinstance(exc, ClientError):
        return False
    error = exc.response.get("Error", {})
    return _code(exc) in _NOT_FOUND or error.get("QueryErrorCode") == "QueueDoesNotExist"


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, NoCredentialsError):
        return False
    if isinstance(exc, BotoCoreError):
        return True  # connection refused, timeouts, ...
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return _code(exc) in _THROTTLED or int(status or 0) >= 500
    return False


def _backoff(attempt: int) -> float:
    return min(2.0, 0.05 * 2.0 ** attempt) * (0.5 + random.random() / 2)


def attributes(msg: JobMessage) -> dict[str, dict[str, str]]:
    """The envelope's header fields as SQS message attributes."""
    return {name: {"DataType": "String", "StringValue": value}
            for name, value in msg.header_map().items()}


def message_size(body: str, attrs: dict[str, dict[str, str]]) -> int:
    """What SQS counts against its size limit: the body plus every
    attribute's name, type and value, in UTF-8 bytes."""
    size = len(body.encode())
    for name, attr in attrs.items():
        size += len(name.encode()) + len(attr["DataType"].encode())
        size += len(attr["StringValue"].encode())
    return size


class SQSBroker(PublishingBroker):
    capabilities = Capabilities(
        name="sqs",
        max_delay=float(MAX_DELAY_SECONDS),
        delay_precision=1.0,
        cancel=False,
        ordering="none: standard queues deliver in roughly but not strictly visibility "
                 "order, and may deliver a message twice",
        durability="SQS's: stored redundantly before SendMessageBatch returns; kept "
                    "14 days (MessageRetentionPeriod) until deleted; a deleted and "
                    "recreated queue is detected and its jobs are published again",
        payload_limit=256 * 1024,
        redelivers_unacked=True,
        in_flight_after_cancel="waits out its DelaySeconds in SQS, then is delivered and "
                               "discarded by the version check",
    )

    def __init__(self, url: str, context: BrokerContext) -> None:
        self.settings = s = SQSSettings.from_url(url)
        caps = replace(type(self).capabilities, payload_limit=s.max_message_size)
        if s.fifo:
            caps = replace(
                caps, name="sqs-fifo", max_delay=0.0, delay_precision=0.001,
                ordering="per message group (the job's ordering_key header, else its id): "
                         "in publish order, which the relay makes due-time order; one "
                         "message of a group in flight at a time",
                in_flight_after_cancel="nothing is in flight before the due time (FIFO "
                                       "jobs are published when due); a message already "
                                       "published is discarded by the version check")
        self.capabilities = caps
        super().__init__(url, context)
        self.consumer = context.worker_name
        self._client: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._poll_pool: ThreadPoolExecutor | None = None
        self._urls: dict[str, str] = {}
        self._created: dict[str, int] = {}  # queue -> CreatedTimestamp seen
        self._resolving: dict[str, asyncio.Lock] = {}
        self._in_flight: dict[str, _InFlight] = {}  # receipt handle -> where and until when
        self._freed = asyncio.Event()
        self._deletes: dict[str, _Pending] = {}
        self._lost = False
        self._first_check = True
        self._last_check = time.monotonic()
        self._closing = False
        # Pollers and the visibility heartbeat, cancelled by close() even when
        # the consume() generator was abandoned without being closed.
        self._tasks: set[asyncio.Task[None]] = set()
        self.received = 0  # messages received by this broker (tests, metrics)
        self._log = CollapsedLog(log)

    @classmethod
    def check_queue_name(cls, url: str, name: str) -> None:
        """SQS names: letters, digits, '-' and '_', at most 80 with the prefix
        (and ``.fifo``)."""
        SQSSettings.from_url(url).queue_name(name)

    # --- connection -------------------------------------------------------------

    def _where(self) -> str:
        where = self.settings.endpoint or f"AWS ({self.settings.region or 'default region'})"
        return f"SQS at {where}"

    async def open(self) -> None:
        """Build the client (no network call: an outage is retried by the loops)."""
        if self._client is not None:
            return
        s = self.settings
        self._closing = False
        self._pool = ThreadPoolExecutor(s.threads, thread_name_prefix="duebox-sqs")
        config = botocore.config.Config(
            max_pool_connections=s.threads + 16,
            retries={"mode": "standard", "total_max_attempts": 2},
            connect_timeout=5, read_timeout=s.wait + 15,
            user_agent_extra="duebox",
        )
        try:
            session = boto3.session.Session(
                aws_access_key_id=s.access_key, aws_secret_access_key=s.secret_key,
                region_name=s.region)
            self._client = await asyncio.get_running_loop().run_in_executor(
                self._pool, functools.partial(session.client, "sqs", endpoint_url=s.endpoint,
                                              config=config))
        except NoRegionError:
            raise ConfigurationError(
                "broker_url: no AWS region: add ?region=... to the sqs:// URL or set "
                "AWS_REGION") from None
        except (BotoCoreError, ValueError) as exc:
            raise ConfigurationError(f"broker_url: {exc}") from exc

    async def close(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for url in list(self._deletes):
            await self._flush_deletes(url)
        pools = (self._pool, self._poll_pool)
        self._pool = self._poll_pool = None
        self._client = None
        for pool in pools:
            if pool is not None:
                # A long poll still running finishes on its own and hands back
                # what it received (see _receive); nobody waits for it.
                pool.shutdown(wait=False, cancel_futures=True)

    async def _call(self, fn: Callable[..., T], *args: Any, pool: ThreadPoolExecutor | None = None,
                    **kw: Any) -> T:
        if self._client is None:
            await self.open()
        executor = pool or self._pool
        if executor is None:
            raise BrokerError(f"{self._where()}: the broker was closed")
        return await asyncio.get_running_loop().run_in_executor(
            executor, functools.partial(fn, *args, **kw))

    def _api(self, name: str) -> Callable[..., Any]:
        fn: Callable[..., Any] = getattr(self._client, name)
        return fn

    def _error(self, what: str, exc: BaseException) -> BrokerError:
        if isinstance(exc, NoCredentialsError):
            return BrokerError(f"{self._where()}: no AWS credentials: put KEY:SECRET@ in the "
                               f"sqs:// URL or configure boto3 (AWS_ACCESS_KEY_ID, ...)")
        return BrokerError(f"{self._where()}: {what} failed: {exc}")

    # --- queues -----------------------------------------------------------------

    async def queue_url(self, queue: str, *, fifo: bool | None = None) -> str:
        """The queue's URL, creating the queue if it does not exist (``create``)."""
        fifo = self.settings.fifo if fifo is None else fifo
        key = queue if fifo == self.settings.fifo else f"{queue}\0{fifo}"
        url = self._urls.get(key)
        if url is not None:
            return url
        lock = self._resolving.setdefault(key, asyncio.Lock())
        async with lock:
            url = self._urls.get(key)
            if url is not None:
                return url
            name = self.settings.queue_name(queue, fifo)
            try:
                await self.open()
                try:
                    reply = await self._call(self._api("get_queue_url"), QueueName=name)
                except ClientError as exc:
                    if not _not_found(exc) or not self.settings.create:
                        raise
                    reply = await self._call(self._api("create_queue"), QueueName=name,
                                             Attributes=self._queue_attributes(fifo))
                    log.info("created SQS queue %s", name)
            except (ClientError, BotoCoreError) as exc:
                raise self._error(f"finding queue {name!r}", exc) from exc
            url = str(reply["QueueUrl"])
            self._urls[key] = url
            if key == queue:
                await self._baseline(queue, url)
            return url

    async def _baseline(self, queue: str, url: str) -> None:
        """Remember the queue's ``CreatedTimestamp`` as first resolved here, so
        a later recreation (by anyone) shows as a change."""
        try:
            reply = await self._call(self._api("get_queue_attributes"), QueueUrl=url,
                                     AttributeNames=["CreatedTimestamp"])
        except (ClientError, BotoCoreError) as exc:
            log.debug("%s: no CreatedTimestamp for %r: %s", self._where(), queue, exc)
            return
        created = int(float(reply.get("Attributes", {}).get("CreatedTimestamp", 0)))
        seen = self._created.get(queue)
        if seen is not None and seen != created:
            self._lost = True
        self._created[queue] = created

    def _queue_attributes(self, fifo: bool) -> dict[str, str]:
        attrs = {"MessageRetentionPeriod": "1209600",
                 "VisibilityTimeout": str(self.settings.visibility_timeout),
                 "MaximumMessageSize": str(self.settings.max_message_size)}
        if fifo:
            attrs.update(FifoQueue="true", ContentBasedDeduplication="false")
        return attrs

    def _forget(self, queue: str) -> None:
        """The queue vanished (deleted, or the emulator restarted empty)."""
        if self._urls.pop(queue, None) is not None:
            log.warning("%s: queue %r does not exist any more; it is created again and the "
                        "relay republishes what it held", self._where(), queue)
        self._lost = True

    # --- relay side ---------------------------------------------------------------

    def _entry(self, i: int, out: Outgoing, now: float) -> _Entry | str:
        """The request for one message, or the reason it cannot be sent
        (:class:`ValidationError`: one SQS refuses every time)."""
        msg = out.message
        if self.settings.fifo and out.delay > 0:
            return ("sqs:// FIFO queues cannot delay a message (max_delay is 0): the relay "
                    "publishes FIFO jobs at their due time")
        self.settings.queue_name(msg.queue)
        body = msg.encode().decode()
        attrs = attributes(msg)
        size = message_size(body, attrs)
        if size > self.settings.max_message_size:
            raise ValidationError(
                "payload", f"the message is {size} bytes with its attributes; SQS takes at "
                f"most {self.settings.max_message_size} (max_message_size); keep large "
                f"data elsewhere and pass a reference")
        request: dict[str, Any] = {"Id": str(i), "MessageBody": body,
                                   "MessageAttributes": attrs}
        if self.settings.fifo:
            request["MessageGroupId"] = safe_token(msg.ordering_key())
            request["MessageDeduplicationId"] = f"{msg.job_id}.{msg.version}"
        visible_at = None
        if out.delay > 0:
            # Never before the due time, nor before the delay the relay gave.
            visible_at = min(msg.due_at.timestamp(), now + min(out.delay, MAX_DELAY_SECONDS))
        return _Entry(i, request, size, visible_at, self._send_at(visible_at, now))

    def _send_at(self, visible_at: float | None, now: float) -> float:
        """When to send so that whole-second ``DelaySeconds`` ends just after
        ``visible_at``: at ``visible_at - floor(visible_at - now)``, rounded up
        to the next ``align`` step (a batch goes out per step)."""
        step = self.settings.align
        if visible_at is None or step <= 0:
            return now
        wait = (visible_at - now) % 1.0
        if wait <= 0:
            return now
        return now + min(1.0, math.ceil(wait / step) * step)

    def _chunks(self, entries: list[_Entry]) -> list[list[_Entry]]:
        """At most 10 entries and ``max_message_size`` bytes per call, of
        entries that go out at the same moment."""
        chunks: list[list[_Entry]] = []
        size = 0
        for e in sorted(entries, key=lambda e: e.send_at):
            if not chunks or len(chunks[-1]) >= BATCH or e.send_at != chunks[-1][0].send_at \
                    or size + e.size > self.settings.max_message_size:
                chunks.append([])
                size = 0
            chunks[-1].append(e)
            size += e.size
        return chunks

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        if not batch:
            return []
        now = self.context.clock.now().timestamp()
        results: list[PublishResult | None] = [None] * len(batch)
        by_queue: dict[str, list[_Entry]] = {}
        for i, out in enumerate(batch):
            try:
                entry = self._entry(i, out, now)
            except ValidationError as exc:
                results[i] = refused(out.message.job_id, exc)
                continue
            if isinstance(entry, str):
                results[i] = PublishResult(out.message.job_id, False, error=entry)
            else:
                by_queue.setdefault(out.message.queue, []).append(entry)
        failures: list[BaseException] = []
        calls = []
        for queue, entries in by_queue.items():
            for chunk in self._chunks(entries):
                calls.append(self._send(queue, chunk))
        outcomes = await asyncio.gather(*calls)
        for outcome, failure in outcomes:
            if failure is not None:
                failures.append(failure)
            for index, (ok, value) in outcome.items():
                job_id = batch[index].message.job_id
                results[index] = (PublishResult(job_id, True, value) if ok
                                  else PublishResult(job_id, False, error=value))
        if failures and len(failures) == len(calls):
            # Nothing got through: an outage.  The relay releases the batch
            # and backs off.
            raise self._error("SendMessageBatch", failures[0]) from failures[0]
        return [r for r in results if r is not None]

    async def _send(self, queue: str, chunk: list[_Entry]
                    ) -> tuple[dict[int, tuple[bool, str]], BaseException | None]:
        """One ``SendMessageBatch`` and its retries: only failed entries again;
        throttling, server and connection errors back off.  Returns
        ``{index: (ok, message id or error)}`` and the error that made every
        entry fail, if one did."""
        clock = self.context.clock
        wait = chunk[0].send_at - clock.now().timestamp()
        if wait > 0:
            await asyncio.sleep(wait)
        done: dict[int, tuple[bool, str]] = {}
        pending = list(chunk)
        last: BaseException | None = None
        for attempt in range(_SEND_ATTEMPTS):
            if attempt:
                await asyncio.sleep(_backoff(attempt))
            try:
                url = await self.queue_url(queue)
            except BrokerError as exc:
                last = exc
                if isinstance(exc.__cause__, (ClientError, BotoCoreError)) and \
                        _retryable(exc.__cause__):
                    continue
                break
            # DelaySeconds counts from when SQS takes the message, a little
            # after now: rounded up, it ends at or after ``visible_at``.
            now = clock.now().timestamp()
            requests = []
            for e in pending:
                req = dict(e.request)
                if e.visible_at is not None and e.visible_at > now:
                    req["DelaySeconds"] = min(MAX_DELAY_SECONDS, math.ceil(e.visible_at - now))
                requests.append(req)
            try:
                reply = await self._call(self._api("send_message_batch"), QueueUrl=url,
                                         Entries=requests)
            except (ClientError, BotoCoreError) as exc:
                last = exc
                if _not_found(exc):
                    self._forget(queue)
                    continue
                if _retryable(exc):
                    log.info("%s: SendMessageBatch failed (%s); retrying", self._where(), exc)
                    continue
                break
            last = None
            by_id = {str(e.index): e for e in pending}
            for ok in reply.get("Successful", []):
                done[int(ok["Id"])] = (True, str(ok["MessageId"]))
                by_id.pop(ok["Id"], None)
            retry = []
            for bad in reply.get("Failed", []):
                entry = by_id.pop(bad["Id"], None)
                if entry is None:
                    continue
                if bad.get("SenderFault"):
                    done[entry.index] = (False, f"SQS refused the message: {bad.get('Code')}: "
                                                f"{bad.get('Message', '')}")
                else:
                    retry.append(entry)
            retry += by_id.values()  # neither successful nor failed: send again
            if not retry:
                return done, None
            log.info("%s: %d of %d entries failed on SQS's side; retrying only those",
                     self._where(), len(retry), len(pending))
            pending = retry
        error = str(self._error("SendMessageBatch", last)) if last else \
            "SQS kept failing these entries"
        for e in pending:
            done[e.index] = (False, error)
        every = last is not None and len(pending) == len(chunk)
        return done, (last if every else None)

    async def missing(self, jobs: Sequence[EnqueuedRef]) -> list[uuid.UUID]:
        """Jobs published before their queue was (re)created: SQS lost them."""
        by_queue: dict[str, list[EnqueuedRef]] = {}
        for ref in jobs:
            by_queue.setdefault(ref.queue, []).append(ref)
        # CreatedTimestamp is whole seconds, rounded down: a message sent to
        # this incarnation was sent at or after it.  The clock-skew margin
        # keeps a relay whose clock lags SQS's from republishing live ones; a
        # message sent to the old queue within that margin of its recreation
        # is left to ``redeliver_after``.
        margin = self.context.settings.clock_skew_margin
        gone: list[uuid.UUID] = []
        for queue, refs in by_queue.items():
            created = await self._created_at(queue)
            for ref in refs:
                published = ref.published_at
                if published is None or published.timestamp() < created - margin:
                    gone.append(ref.id)
        return gone

    async def _created_at(self, queue: str) -> float:
        """The queue's ``CreatedTimestamp`` (creating the queue if it is gone)."""
        for _ in range(2):
            url = await self.queue_url(queue)
            try:
                reply = await self._call(self._api("get_queue_attributes"), QueueUrl=url,
                                         AttributeNames=["CreatedTimestamp"])
            except (ClientError, BotoCoreError) as exc:
                if _not_found(exc):
                    self._forget(queue)
                    continue
                raise self._error("GetQueueAttributes", exc) from exc
            created = int(float(reply.get("Attributes", {}).get("CreatedTimestamp", 0)))
            seen = self._created.setdefault(queue, created)
            if seen != created:
                self._created[queue] = created
                self._lost = True
            return float(created)
        raise BrokerError(f"{self._where()}: queue {queue!r} keeps disappearing")

    async def data_lost(self) -> bool:
        """True once on first use (so a relay that starts after an outage
        checks), then whenever a known queue vanished or was recreated; the
        queues are looked at every ``check_interval`` seconds."""
        if self._first_check:
            self._first_check = False
            return True
        if time.monotonic() - self._last_check >= self.settings.check_interval:
            self._last_check = time.monotonic()
            for queue in list(self._urls):
                with contextlib.suppress(BrokerError):  # an outage: look next time
                    await self._created_at(queue)
        lost, self._lost = self._lost, False
        return lost

    # --- worker side --------------------------------------------------------------

    async def consume(self, queues: Sequence[str], prefetch: int,
                      wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        names = list(dict.fromkeys(queues)) or ["default"]
        for name in names:
            self.settings.queue_name(name)  # a name SQS cannot take fails now
        await self.open()
        if self._poll_pool is None:
            self._poll_pool = ThreadPoolExecutor(len(names), thread_name_prefix="duebox-sqs-rx")
        inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        room = _Room(prefetch, self, len(names))
        tasks = [asyncio.create_task(self._poll(q, room, inbox), name=f"duebox-sqs-poll-{q}")
                 for q in names]
        tasks.append(asyncio.create_task(self._extend(), name="duebox-sqs-visibility"))
        for t in tasks:
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        getter: asyncio.Future[Delivery] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(inbox.get())
                await asyncio.wait({getter, *tasks}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    for t in tasks:
                        if t.done():
                            t.result()  # a poller's fatal error ends consumption
                    continue
                delivery, getter = getter.result(), None
                yield delivery
        finally:
            if getter is not None:
                getter.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            leftovers = []
            while not inbox.empty():
                leftovers.append(inbox.get_nowait())
            for d in leftovers:  # received, never handed out: visible again at once
                with contextlib.suppress(BrokerError):
                    await self._hide(d, 0)

    async def _poll(self, queue: str, room: _Room, inbox: asyncio.Queue[Delivery]) -> None:
        backoff = 0.1
        while True:
            n = await room.reserve(BATCH)
            try:
                try:
                    url = await self.queue_url(queue)
                    messages = await self._call(self._receive, url, n, pool=self._poll_pool)
                except (ClientError, BotoCoreError) as exc:
                    if _not_found(exc):
                        self._forget(queue)
                        continue
                    raise self._error("ReceiveMessage", exc) from exc
            except BrokerError as exc:
                if isinstance(exc.__cause__, NoCredentialsError):
                    raise
                self._log.warning(f"receive:{queue}", "%s: receiving from %r failed (%s); "
                                  "retrying in %.1fs", self._where(), queue, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            now = time.monotonic()
            for m in messages:
                handle = m["ReceiptHandle"]
                self._in_flight[handle] = _InFlight(
                    url, queue, now, now + self.settings.visibility_timeout)
                self.received += 1
                count = int(m.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
                inbox.put_nowait(self.delivery(
                    m.get("Body", ""), raw=handle, redelivered=count > 1,
                    extra={"queue": queue, "url": url, "message_id": m.get("MessageId"),
                           "body": m.get("Body", ""),
                           "attributes": m.get("MessageAttributes", {}),
                           "receive_count": count}))

    def _receive(self, url: str, n: int) -> list[dict[str, Any]]:
        """Runs in the poll thread.  If the broker closed meanwhile, whatever
        arrived is made visible again at once instead of after the timeout."""
        reply = self._client.receive_message(
            QueueUrl=url, MaxNumberOfMessages=n, WaitTimeSeconds=self.settings.wait,
            VisibilityTimeout=self.settings.visibility_timeout,
            MessageAttributeNames=["All"], MessageSystemAttributeNames=["ApproximateReceiveCount"])
        messages: list[dict[str, Any]] = reply.get("Messages", [])
        if messages and self._closing:
            with contextlib.suppress(Exception):
                self._client.change_message_visibility_batch(QueueUrl=url, Entries=[
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"], "VisibilityTimeout": 0}
                    for i, m in enumerate(messages)])
            return []
        return messages

    async def _extend(self) -> None:
        """The heartbeat of long handlers: every third of the visibility
        timeout, messages still being handled are hidden for another one."""
        vt = self.settings.visibility_timeout
        while True:
            await asyncio.sleep(max(0.5, vt / 3))
            now = time.monotonic()
            due: dict[str, list[tuple[str, _InFlight]]] = {}
            for handle, f in list(self._in_flight.items()):
                if f.deadline - now < vt / 2 and now - f.received < MAX_VISIBILITY - vt:
                    due.setdefault(f.url, []).append((handle, f))
            for url, items in due.items():
                for i in range(0, len(items), BATCH):
                    part = items[i:i + BATCH]
                    entries = [{"Id": str(n), "ReceiptHandle": h, "VisibilityTimeout": vt}
                               for n, (h, _) in enumerate(part)]
                    try:
                        reply = await self._call(self._api("change_message_visibility_batch"),
                                                 QueueUrl=url, Entries=entries)
                    except (ClientError, BotoCoreError, BrokerError) as exc:
                        log.warning("%s: extending the visibility of %d messages failed: %s",
                                    self._where(), len(part), exc)
                        continue
                    failed = {int(f["Id"]) for f in reply.get("Failed", [])}
                    for n, (_, held) in enumerate(part):
                        if n not in failed:
                            held.deadline = now + vt

    def _settle(self, delivery: Delivery) -> _InFlight | None:
        held = self._in_flight.pop(delivery.raw, None) if isinstance(delivery.raw, str) else None
        if held is not None:
            self._freed.set()
        return held

    async def ack(self, delivery: Delivery) -> None:
        """Delete the message (batched with other acks of the same moment)."""
        held = self._settle(delivery)
        url = held.url if held else delivery.extra.get("url")
        if url is None or not isinstance(delivery.raw, str):
            return
        pending = self._deletes.setdefault(url, _Pending())
        fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        pending.items.append((delivery.raw, fut))
        if len(pending.items) >= BATCH:
            await self._flush_deletes(url)
        elif not pending.scheduled:
            pending.scheduled = True
            asyncio.get_running_loop().call_soon(
                lambda: asyncio.ensure_future(self._flush_deletes(url)))
        error = await fut
        if error:
            # The message reappears after its visibility timeout and is
            # discarded by the version check.
            self._log.warning("delete", "%s: deleting a message failed: %s", self._where(),
                              error)

    async def _flush_deletes(self, url: str) -> None:
        pending = self._deletes.pop(url, None)
        if pending is None or not pending.items:
            return
        items = pending.items
        for i in range(0, len(items), BATCH):
            part = items[i:i + BATCH]
            entries = [{"Id": str(n), "ReceiptHandle": h} for n, (h, _) in enumerate(part)]
            errors: dict[int, str] = {}
            try:
                reply = await self._call(self._api("delete_message_batch"), QueueUrl=url,
                                         Entries=entries)
                errors = {int(f["Id"]): f"{f.get('Code')}: {f.get('Message', '')}"
                          for f in reply.get("Failed", [])}
            except (ClientError, BotoCoreError, BrokerError) as exc:
                errors = dict.fromkeys(range(len(part)), str(exc))
            for n, (_, fut) in enumerate(part):
                if not fut.done():
                    fut.set_result(errors.get(n))

    async def _hide(self, delivery: Delivery, seconds: float) -> None:
        held = self._settle(delivery)
        url = held.url if held else delivery.extra.get("url")
        if url is None:
            return
        cap = MAX_VISIBILITY - 1
        if held is not None:
            cap = max(0, int(MAX_VISIBILITY - (time.monotonic() - held.received)) - 1)
        timeout = min(cap, math.ceil(max(0.0, seconds)))
        try:
            await self._call(self._api("change_message_visibility"), QueueUrl=url,
                             ReceiptHandle=delivery.raw, VisibilityTimeout=timeout)
        except (ClientError, BotoCoreError) as exc:
            raise self._error("ChangeMessageVisibility", exc) from exc

    async def defer(self, delivery: Delivery, seconds: float) -> bool:
        """Hide the message again for the rest of ``seconds``, rounded up (it
        came before its due time, e.g. clock skew): never run early.  If that
        fails it reappears after its visibility timeout: SQS's own bounded
        retry."""
        try:
            await self._hide(delivery, seconds)
        except BrokerError as exc:
            log.warning("could not hide an early message again (%s); it reappears after "
                        "its visibility timeout", exc)
        return True

    async def reject(self, delivery: Delivery, reason: str) -> None:
        if reason == "locked":  # the row was busy, not gone: look again shortly
            await self.defer(delivery, 1.0)
            return
        if delivery.message is None:
            await self._dead_letter(delivery, reason)
        await self.ack(delivery)

    async def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Keep a message that is not a duebox message, with the reason, in
        the ``PREFIX + dead-letter`` queue (a standard queue)."""
        body = str(delivery.extra.get("body") or "-")
        attrs = {"duebox-reason": {"DataType": "String", "StringValue": reason[:1000] or "-"},
                 "duebox-source-queue": {"DataType": "String",
                                         "StringValue": str(delivery.extra.get("queue", "?"))}}
        try:
            url = await self.queue_url(_DEAD_LETTER, fifo=False)  # always a standard queue
            await self._call(self._api("send_message"), QueueUrl=url, MessageBody=body,
                             MessageAttributes=attrs)
        except (ClientError, BotoCoreError, BrokerError) as exc:
            log.warning("%s: could not keep a rejected message in %s: %s", self._where(),
                        _DEAD_LETTER, exc)


class _Room:
    """Prefetch accounting for one consumer's per-queue pollers.  Each asks for
    its share of the free slots (at least one), so a long poll on an empty queue
    never holds the only free slot while another queue has messages; with fewer
    free slots than queues, one message per extra queue may be received beyond
    the prefetch (held, its visibility extended, until a slot frees)."""

    def __init__(self, prefetch: int, broker: SQSBroker, pollers: int) -> None:
        self.prefetch = max(1, prefetch)
        self.broker = broker
        self.pollers = max(1, pollers)

    def free(self) -> int:
        return self.prefetch - len(self.broker._in_flight)

    async def reserve(self, most: int) -> int:
        while True:
            if (free := self.free()) > 0:
                return min(most, max(1, free // self.pollers))
            self.broker._freed.clear()
            if self.free() > 0:  # freed between the look and the clear
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.broker._freed.wait(), 1.0)

