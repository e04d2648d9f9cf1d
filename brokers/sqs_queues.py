"""The ``sqs://`` backend's connection and queues (see :mod:`duebox.brokers.sqs`).

boto3 is synchronous: every call runs in a bounded thread pool.  A queue's
URL is resolved once (the queue created on first use unless ``?create=false``)
together with its ``CreatedTimestamp``.  That timestamp is all SQS can say
about loss: a queue that was deleted and created again (a LocalStack restart,
an operator's mistake) lost every message sent before that moment.
:meth:`SQSQueues.data_lost` notices a queue that vanished or changed its
``CreatedTimestamp``; :meth:`SQSQueues.missing` then names the ``ENQUEUED``
jobs published before the queue's creation, and the relay publishes them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from duebox.errors import BrokerError, ConfigurationError, MissingDependencyError

from .base import BrokerContext, PublishingBroker
from .sqs_settings import SQSSettings

try:
    import boto3
    import botocore.config
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError
except ImportError as exc:  # pragma: no cover - exercised by a test with the module hidden
    raise MissingDependencyError("boto3", "sqs") from exc

if TYPE_CHECKING:
    from duebox.leases.recovery import EnqueuedRef

log = logging.getLogger("duebox.brokers.sqs")

T = TypeVar("T")

_NOT_FOUND = ("AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist")
_THROTTLED = ("ThrottlingException", "RequestThrottled", "Throttling", "ServiceUnavailable",
              "InternalError", "InternalFailure", "KMS.ThrottlingException",
              "AWS.SimpleQueueService.RequestThrottled", "RequestThrottledException")


def code(exc: ClientError) -> str:
    error = exc.response.get("Error", {})
    return str(error.get("Code") or error.get("QueryErrorCode") or "")


def not_found(exc: BaseException) -> bool:
    if not isinstance(exc, ClientError):
        return False
    error = exc.response.get("Error", {})
    return code(exc) in _NOT_FOUND or error.get("QueryErrorCode") == "QueueDoesNotExist"


def retryable(exc: BaseException) -> bool:
    if isinstance(exc, NoCredentialsError):
        return False
    if isinstance(exc, BotoCoreError):
        return True  # connection refused, timeouts, ...
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return code(exc) in _THROTTLED or int(status or 0) >= 500
    return False


def backoff(attempt: int) -> float:
    return min(2.0, 0.05 * 2.0 ** attempt) * (0.5 + random.random() / 2)


class SQSQueues(PublishingBroker):
    """The connection, the queues and what they lost; :class:`~duebox.brokers.sqs.SQSBroker`
    adds the messages."""

    settings: SQSSettings

    def __init__(self, url: str, context: BrokerContext) -> None:
        super().__init__(url, context)
        self._client: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._poll_pool: ThreadPoolExecutor | None = None
        self._urls: dict[str, str] = {}
        self._created: dict[str, int] = {}  # queue -> CreatedTimestamp seen
        self._resolving: dict[str, asyncio.Lock] = {}
        self._lost = False
        self._first_check = True
        self._last_check = time.monotonic()
        self._closing = False

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
                    if not not_found(exc) or not self.settings.create:
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

    # --- what SQS lost (reconciliation) ------------------------------------------

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
                if not_found(exc):
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
