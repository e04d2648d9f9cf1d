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

A queue deleted and created again (a LocalStack restart, an operator's
mistake) is noticed and the relay publishes its jobs again; the connection,
the queues and that check are brokers/sqs_queues.py, what a message becomes
in a ``SendMessageBatch`` is brokers/sqs_messages.py.

URL: ``sqs://[KEY:SECRET@][HOST[:PORT]]?region=&endpoint=&prefix=duebox-&fifo=false
&wait=10&visibility_timeout=3&threads=8&max_message_size=262144&create=true
&check_interval=60&tls=&max_delay=``.  A host in the URL is the endpoint
(``http://`` for localhost and 127.0.0.1, else ``https://``; ``?tls=`` decides);
without one, boto3 finds AWS's endpoint, credentials and region as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from duebox.errors import (
    BrokerError,
    MissingDependencyError,
    ValidationError,
)
from duebox.observability.logs import CollapsedLog

from .base import (
    BrokerContext,
    Capabilities,
    Delivery,
    Durability,
    Ordering,
    Outgoing,
    PublishResult,
    refused,
)
from .sqs_messages import BATCH, Entry, chunks, make_entry
from .sqs_queues import SQSQueues, backoff, not_found, retryable
from .sqs_settings import MAX_DELAY_SECONDS, MAX_VISIBILITY, SQSSettings

try:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
except ImportError as exc:  # pragma: no cover - exercised by a test with the module hidden
    raise MissingDependencyError("boto3", "sqs") from exc

if TYPE_CHECKING:
    from duebox.leases.recovery import EnqueuedRef

log = logging.getLogger("duebox.brokers.sqs")


_SEND_ATTEMPTS = 6
_DEAD_LETTER = "dead-letter"


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


class SQSBroker(SQSQueues):
    capabilities = Capabilities(
        name="sqs",
        max_delay=float(MAX_DELAY_SECONDS),
        delay_precision=1.0,
        cancel=False,
        ordering=Ordering.NONE,
        ordering_note="none: standard queues deliver in roughly but not strictly visibility "
                      "order, and may deliver a message twice",
        durability=Durability.BROKER,
        durability_note="SQS's: stored redundantly before SendMessageBatch returns; kept "
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
                ordering=Ordering.PER_GROUP,
                ordering_note="per message group (the job's ordering_key header, else its id): "
                              "in publish order, which the relay makes due-time order; one "
                              "message of a group in flight at a time",
                in_flight_after_cancel="nothing is in flight before the due time (FIFO "
                                       "jobs are published when due); a message already "
                                       "published is discarded by the version check")
        self.capabilities = caps
        super().__init__(url, context)
        self.consumer = context.worker_name
        self._in_flight: dict[str, _InFlight] = {}  # receipt handle -> where and until when
        self._freed = asyncio.Event()
        self._deletes: dict[str, _Pending] = {}
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

    async def close(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for url in list(self._deletes):
            await self._flush_deletes(url)
        await super().close()  # the thread pools and the client

    # --- relay side ---------------------------------------------------------------

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        if not batch:
            return []
        now = self.context.clock.now().timestamp()
        results: list[PublishResult | None] = [None] * len(batch)
        by_queue: dict[str, list[Entry]] = {}
        for i, out in enumerate(batch):
            try:
                entry = make_entry(self.settings, i, out, now)
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
            for chunk in chunks(self.settings, entries):
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

    async def _send(self, queue: str, chunk: list[Entry]
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
                await asyncio.sleep(backoff(attempt))
            try:
                url = await self.queue_url(queue)
            except BrokerError as exc:
                last = exc
                if isinstance(exc.__cause__, (ClientError, BotoCoreError)) and \
                        retryable(exc.__cause__):
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
                if not_found(exc):
                    self._forget(queue)
                    continue
                if retryable(exc):
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

    def queue_name(self, queue: str) -> str:
        return self.settings.queue_name(queue)

    async def declare(self, queues: Sequence[str]) -> list[str]:
        """Creates the queues (``create``, the default), or finds them."""
        for q in queues:
            await self.queue_url(q)
        return [self.queue_name(q) for q in queues]

    def locate(self, job: EnqueuedRef, now: datetime) -> str:
        return "in SQS delay (DelaySeconds)" if job.due_at > now else "visible in the SQS queue"

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
                    if not_found(exc):
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

    async def hand_back(self, delivery: Delivery) -> bool:
        """Another consumer should have it: made visible again at once."""
        return await self.defer(delivery, 0.0)

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

