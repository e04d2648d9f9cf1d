"""``kafka://`` — Apache Kafka (or any Kafka-protocol broker) through aiokafka.

Kafka has no per-message delay, so this backend declares a ceiling of 0: the
relay keeps jobs parked in the database until they are near, holds the last
second or so in memory (still leased in the database: a relay that dies
loses nothing, its leases expire and another relay takes the jobs) and
publishes each job at its due time, never before.

One topic per duebox queue, ``PREFIX + queue``, created on first use with
``partitions`` partitions (where the cluster allows CreateTopics; otherwise
the broker's auto-creation is relied on).  The producer uses ``acks=all`` and
is idempotent unless ``?idempotence=false`` (``auto``: idempotent, falling back
when the broker is too old for it or answers InitProducerId with an error,
as tansu's memory engine does).  The message key is the job's
``ordering_key`` header, else its id; headers carry the outbox id, version,
attempt, due time and task.

Workers consume in a consumer group with auto-commit off.  A partition's
offset is committed only up to its oldest message whose handler has not
finished, so a crash redelivers everything not yet finished (and possibly
some that finished after it: the version check and the SQL dedupe store drop
those).  While the in-flight limit is reached the assigned partitions are
paused and polling goes on, so a long handler does not make the consumer
leave its group.  A message received before its due time (clock skew) is held
in the worker and handed out again when due; its offset stays uncommitted.

A topic deleted, wiped or cut by retention before its messages were read is
noticed (brokers/kafka_reconcile.py) and the relay publishes its jobs again.
One publish is brokers/kafka_publish.py.

URL: ``kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]?prefix=duebox.&group=duebox
&partitions=12&replication=&idempotence=auto&fetch_max_wait_ms=500
&request_timeout_ms=10000&session_timeout_ms=10000&max_message_size=1048576&create_topics=true
&check_interval=30&security_protocol=&sasl_mechanism=PLAIN&ssl_cafile=``.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from duebox.errors import BrokerError, MissingDependencyError
from duebox.observability.logs import CollapsedLog, kind_of

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
)
from .kafka_offsets import OffsetTracker, Truncated
from .kafka_publish import PublishRound
from .kafka_reconcile import LossWatch
from .kafka_settings import KafkaSettings

try:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import (
        IncompatibleBrokerVersion,
        KafkaError,
        TopicAlreadyExistsError,
        UnsupportedVersionError,
    )
except ImportError as exc:  # pragma: no cover - exercised by a test with the module hidden
    raise MissingDependencyError("aiokafka", "kafka") from exc

if TYPE_CHECKING:
    from duebox.leases.recovery import EnqueuedRef

log = logging.getLogger("duebox.brokers.kafka")


async def _stop_quietly(client: Any) -> None:
    """Stop an aiokafka client whatever state it is in.  ``stop()`` can raise a
    CancelledError of its own when it follows ``start()`` closely or the
    cluster vanished (aiokafka issue #647: it awaits an internal task it has
    just cancelled); that one is swallowed, a cancellation of *this* task is
    not.  A stop that hangs on a dead cluster is bounded."""
    try:
        await asyncio.wait_for(client.stop(), _STOP_TIMEOUT)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.debug("aiokafka client stop raised its own CancelledError", exc_info=True)
    except (KafkaError, OSError, TimeoutError) as exc:
        log.debug("aiokafka client stop failed: %r", exc)


class _ProducerIdRefused(Exception):
    """The broker answered an idempotent producer's InitProducerId with an
    error: it is reachable but gives this client no producer id."""

    def __init__(self, error: KafkaError) -> None:
        super().__init__(str(error))
        self.error = error


# How long a client's stop may take before it is abandoned.
_STOP_TIMEOUT = 10.0

_DEAD_LETTER = "dead-letter"
_COMMIT_EVERY = 0.2  # seconds between offset commits while messages finish


class KafkaBroker(PublishingBroker):
    capabilities = Capabilities(
        name="kafka",
        max_delay=0.0,
        delay_precision=0.001,
        cancel=False,
        ordering=Ordering.PER_PARTITION,
        ordering_note="per partition: jobs with the same ordering_key header (else the job id) "
                      "are published by a relay in due-time order and read in that order by the "
                      "one consumer that owns the partition; with concurrency > 1 their handlers "
                      "overlap, and a redelivery comes again after later messages",
        durability=Durability.BROKER,
        durability_note="acks=all to the in-sync replicas (min.insync.replicas decides how "
                        "many), idempotent producer; offsets committed only after handlers "
                        "finished; a wiped or truncated topic is noticed and its jobs published "
                        "again",
        payload_limit=1024 * 1024,
        redelivers_unacked=True,
        publish_lead=HANDOVER_LEAD_SECONDS,  # no delay at all: the relay holds jobs until due
        in_flight_after_cancel="nothing is in flight before the due time (jobs are "
                               "published when due); a message already published is "
                               "discarded by the version check",
    )

    def __init__(self, url: str, context: BrokerContext) -> None:
        self.settings = KafkaSettings.from_url(url)
        self.capabilities = replace(type(self).capabilities,
                                    payload_limit=self.settings.max_message_size)
        super().__init__(url, context)
        self.client_id = f"duebox-{context.worker_name}"
        self._producer: Any = None
        self._idempotent = self.settings.idempotence != "false"
        self._topics: set[str] = set()
        self._probe: Any = None
        self._probe_lock = asyncio.Lock()
        # A noticed loss starts the producer over (kafka_reconcile.py).
        self.losses = LossWatch(self.settings, self._where(), self._probe_consumer,
                                self._reset_producer)
        self._topic_names: dict[str, str] = {}
        self._freed = asyncio.Event()
        self._in_flight = 0
        self._lock = asyncio.Lock()
        self._tracker: OffsetTracker | None = None
        # Consumers and their committer tasks, stopped by close() even when
        # the consume() generator was abandoned without being closed.
        self._consumers: set[Any] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Consumers of ended consume() calls, kept to commit late acks.
        self._draining: list[tuple[Any, OffsetTracker]] = []
        self._log = CollapsedLog(log)
        self._deferred: list[tuple[float, int, Delivery]] = []
        self._seq = itertools.count()
        self.received = 0

    @classmethod
    def check_queue_name(cls, url: str, name: str) -> None:
        """Kafka topic names: letters, digits, '.', '-' and '_', 1 to 249 with
        the prefix, not '.' or '..'."""
        KafkaSettings.from_url(url).topic(name)

    def _where(self) -> str:
        return f"Kafka at {','.join(self.settings.bootstrap)}"

    # --- connection -----------------------------------------------------------

    async def open(self) -> None:
        """Nothing to do up front: clients connect on first use, so an outage
        at start-up is retried by the relay's and worker's loops."""

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._finish_draining()
        clients = (self._producer, self._probe, *self._consumers)
        self._consumers.clear()
        self._producer = self._probe = None
        self._topics.clear()
        for c in clients:
            if c is not None:
                await _stop_quietly(c)

    async def producer(self) -> Any:
        async with self._lock:
            if self._producer is None:
                try:
                    self._producer = await self._start_producer(self._idempotent)
                except _ProducerIdRefused as refusal:
                    if self.settings.idempotence != "auto":
                        raise BrokerError(f"{self._where()} gives no producer id to an "
                                          f"idempotent producer ({refusal.error!r}); set "
                                          "idempotence=auto or false in the URL") from refusal
                    self._producer = await self._start_producer(False)
                    log.warning("%s refuses idempotent producers (%r from InitProducerId); "
                                "producing without: a retried send may write a message "
                                "twice, and the worker drops the copy as any redelivery",
                                self._where(), refusal.error)
                    self._idempotent = False
            return self._producer

    async def _start_producer(self, idempotent: bool) -> Any:
        p = AIOKafkaProducer(**self.settings.client_options(self.client_id), acks="all",
                             enable_idempotence=idempotent,
                             max_request_size=self.settings.max_message_size + 1024)
        try:
            await p.start()
        except (KafkaError, OSError) as exc:
            connected = bool(p.client.cluster.brokers())
            await _stop_quietly(p)
            if idempotent and connected and isinstance(exc, KafkaError) and not exc.retriable:
                # Connected (the cluster's metadata is in), then refused:
                # start() fails after bootstrap only in InitProducerId.  tansu's
                # memory engine answers aiokafka's v0 request with
                # UNKNOWN_SERVER_ERROR; a Kafka whose ACLs deny IdempotentWrite
                # with CLUSTER_AUTHORIZATION_FAILED.
                raise _ProducerIdRefused(exc) from exc
            raise BrokerError(f"{self._where()} is not reachable: {exc}") from exc
        return p

    async def _reset_producer(self) -> None:
        p, self._producer = self._producer, None
        self._topics.clear()
        if p is not None:
            await _stop_quietly(p)

    async def ensure_topics(self, topics: Sequence[str]) -> None:
        """Create the topics that do not exist (CreateTopics where the cluster
        allows it, else the broker's auto-creation), once per process."""
        todo = [t for t in dict.fromkeys(topics) if t not in self._topics]
        if not todo:
            return
        p = await self.producer()
        if self.settings.create_topics:
            await self._create(todo)
        for t in todo:
            try:
                await asyncio.wait_for(p.partitions_for(t),
                                       self.settings.request_timeout_ms / 1000)
            except (KafkaError, TimeoutError) as exc:
                raise BrokerError(f"{self._where()}: topic {t!r} does not exist and could not "
                                  f"be created ({exc!r}); create it or allow auto-creation"
                                  ) from exc
            self._topics.add(t)

    def _partitions_assigned(self) -> None:
        # A new member id: the worker's registry row should say so now
        # (registry_info), not at its next beat.
        if self.registry_changed is not None:
            self.registry_changed()

    def registry_info(self) -> dict[str, Any]:
        """This worker's member id in the consumer group, for a peer to
        remove it from the group should it die (:meth:`take_over`)."""
        consumer = self._tracker.consumer if self._tracker is not None else None
        coordinator = getattr(consumer, "_coordinator", None)
        member = getattr(coordinator, "member_id", None)
        return {"kafka_member": member} if isinstance(member, str) and member else {}

    async def take_over(self, worker: str, info: Mapping[str, Any]) -> int:
        """A dead worker's partitions would stay unread until its group
        session times out (``session_timeout_ms``) and the group rebalances;
        a LeaveGroup on its behalf (its member id, from its registry row)
        starts that rebalance now, and the uncommitted messages it had are
        read again by the members left.  Returns 0: the messages are
        redelivered by the group, not counted here."""
        from aiokafka.protocol.group import LeaveGroupRequest

        member = info.get("kafka_member")
        if not isinstance(member, str) or not member:
            return 0
        admin = AIOKafkaAdminClient(**self.settings.client_options(self.client_id + "-admin"))
        try:
            await admin.start()
            node = await admin.find_coordinator(self.settings.group)
            # aiokafka has no public call for another member's LeaveGroup;
            # should its private one change, the session timeout still
            # moves the partitions (hence the broad except below).
            reply = await admin._send_request(LeaveGroupRequest(self.settings.group, member),
                                              node)
            log.info("asked group %r to drop dead worker %s (member %s): %s",
                     self.settings.group, worker, member, reply)
        except Exception as exc:
            log.warning("%s: could not remove dead worker %s from group %r (%s); its "
                        "partitions move when its session times out", self._where(), worker,
                        self.settings.group, exc)
        finally:
            with contextlib.suppress(KafkaError, OSError):
                await admin.close()
        return 0

    async def _create(self, topics: list[str]) -> None:
        admin = AIOKafkaAdminClient(**self.settings.client_options(self.client_id))
        try:
            await admin.start()
            brokers = (await admin.describe_cluster()).get("brokers") or [None]
            replication = self.settings.replication or min(3, len(brokers))
            existing = set(await admin.list_topics())
            new = [NewTopic(t, self.settings.partitions, replication)
                   for t in topics if t not in existing]
            if new:
                await admin.create_topics(new)
                log.info("created Kafka topics %s (%d partitions, replication %d)",
                         ", ".join(n.name for n in new), self.settings.partitions, replication)
        except TopicAlreadyExistsError:
            pass
        except (IncompatibleBrokerVersion, UnsupportedVersionError) as exc:
            log.debug("%s cannot CreateTopics (%s); relying on auto-creation", self._where(),
                      exc)
        except Exception as exc:
            # Best effort, whatever the client raises: aiokafka's admin client
            # raised AttributeError ("'NoneType' object has no attribute
            # 'nodeId'") while the cluster reported no controller, and the
            # relay exited on it.
            self._log.warning(f"create:{kind_of(exc)}", "%s: creating topics %s failed (%s: "
                              "%s); relying on auto-creation", self._where(), topics,
                              type(exc).__name__, exc)
        finally:
            with contextlib.suppress(Exception):
                await admin.close()

    # --- relay side --------------------------------------------------------------

    def _topic(self, queue: str) -> str:
        """``settings.topic``, checked once per queue rather than per message."""
        name = self._topic_names.get(queue)
        if name is None:
            name = self._topic_names[queue] = self.settings.topic(queue)
        return name

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        if not batch:
            return []
        round_ = PublishRound(batch, self.settings.max_message_size)
        topics = round_.topics(self._topic)
        if not topics:
            return round_.results()
        await self.ensure_topics(list(topics.values()))
        await round_.send(await self.producer(), topics)
        round_.settle(self.losses.produced)
        if round_.unsupported and self.settings.idempotence == "auto" and self._idempotent:
            log.warning("%s does not support idempotent producers; producing without",
                        self._where())
            self._idempotent = False
        if round_.reset:
            # Fenced, out of sequence, unknown producer id (a broker that lost
            # its state): start over with a fresh producer next time.
            await self._reset_producer()
        if round_.outage():
            error = round_.errors[0]
            raise BrokerError(f"{self._where()} refused the publish: {error}") from error
        return round_.results()

    async def _probe_consumer(self) -> Any:
        # One at a time: two first looks at once (the loss check and a
        # partition's reach) each made one, and the one overwritten was
        # never stopped.
        async with self._probe_lock:
            if self._probe is None:
                c = AIOKafkaConsumer(**self.settings.client_options(self.client_id + "-probe"),
                                     enable_auto_commit=False, group_id=None)
                try:
                    await c.start()
                except BaseException as exc:  # a cancellation too: stopped, not left open
                    await _stop_quietly(c)
                    if isinstance(exc, KafkaError | OSError):
                        raise BrokerError(f"{self._where()} is not reachable: {exc}") from exc
                    raise
                self._probe = c
            return self._probe

    async def data_lost(self) -> bool:
        return await self.losses.data_lost()

    async def missing(self, jobs: Sequence[EnqueuedRef]) -> list[uuid.UUID]:
        return await self.losses.missing(jobs)

    def queue_name(self, queue: str) -> str:
        return self.settings.topic(queue)

    async def declare(self, queues: Sequence[str]) -> list[str]:
        names = [self.queue_name(q) for q in queues]
        await self.ensure_topics(names)
        return names

    def locate(self, job: EnqueuedRef, now: datetime) -> str:
        return f"in the Kafka topic of {job.queue}"

    # --- worker side ----------------------------------------------------------------

    async def consume(self, queues: Sequence[str], prefetch: int,
                      wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        names = list(dict.fromkeys(queues)) or ["default"]
        topics = [self.settings.topic(q) for q in names]
        by_topic = dict(zip(topics, names, strict=True))
        backoff = 0.2
        while True:
            try:
                await self.ensure_topics(topics)
                consumer, tracker = await self._start_consumer(topics)
            except BrokerError as exc:
                self._log.warning("consume", "cannot consume from %s (%s); retrying in %.1fs",
                                  self._where(), exc, backoff)
                # Jittered: workers re-joining in step would keep rebalancing
                # each other.
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 10.0)
                continue
            failed: BaseException | None = None
            try:
                async for d in self._read(consumer, tracker, by_topic, prefetch):
                    backoff = 0.2
                    yield d
            except (KafkaError, OSError, Truncated) as exc:
                failed = exc
            finally:
                if failed is None:
                    # A clean stop: commit what finished, and keep the
                    # consumer until close() to commit what is still being
                    # handled (stopped here, before those, their messages were
                    # delivered again to the next worker).
                    with contextlib.suppress(KafkaError, OSError):
                        await tracker.commit()
                    self._draining.append((consumer, tracker))
                else:
                    # After a failure nothing is committed: the cluster may be
                    # a new one, where these positions would skip its messages.
                    await self._retire(consumer, tracker)
            # The group or the cluster went away (a broker restart, a
            # coordinator that forgot the group): join again.
            self._log.warning("rejoin", "consuming from %s failed (%s); joining the group "
                              "again in %.1fs", self._where(), failed, backoff)
            self._topics.clear()  # a new cluster may need them created again
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    async def _retire(self, consumer: Any, tracker: OffsetTracker) -> None:
        tracker.consumer = None
        self._consumers.discard(consumer)
        await _stop_quietly(consumer)
        if self._tracker is tracker:
            self._tracker = None

    async def _finish_draining(self) -> None:
        """Commit what the consumers of ended consume() calls saw finish
        since, then stop them (close(), or a new consume(): an idle member
        of the group would hold partitions nobody reads)."""
        draining, self._draining = self._draining, []
        for consumer, tracker in draining:
            with contextlib.suppress(KafkaError, OSError):
                await tracker.commit()
            await self._retire(consumer, tracker)

    async def _start_consumer(self, topics: list[str]) -> tuple[Any, OffsetTracker]:
        await self._finish_draining()
        tracker = OffsetTracker(self._freed, self._partitions_assigned, self.losses.reaching)
        c = AIOKafkaConsumer(**self.settings.client_options(self.client_id),
                             group_id=self.settings.group, enable_auto_commit=False,
                             auto_offset_reset="earliest",
                             fetch_max_wait_ms=self.settings.fetch_max_wait_ms,
                             session_timeout_ms=self.settings.session_timeout_ms,
                             metadata_max_age_ms=30000,
                             # At least every second: a rebalance (a dead peer
                             # dropped from the group, see take_over) is noticed
                             # within one.
                             heartbeat_interval_ms=max(
                                 100, min(1000, self.settings.session_timeout_ms // 3)))
        c.subscribe(topics, listener=tracker)
        self._consumers.add(c)  # close() stops it even if start() is interrupted
        try:
            await c.start()
        except BaseException as exc:
            self._consumers.discard(c)
            await _stop_quietly(c)
            if isinstance(exc, KafkaError | OSError):
                raise BrokerError(f"{self._where()}: joining group {self.settings.group!r} "
                                  f"failed: {exc!r}") from exc
            raise
        tracker.consumer = c
        self._tracker = tracker
        return c, tracker

    async def _read(self, consumer: Any, tracker: OffsetTracker, by_topic: dict[str, str],
                    prefetch: int) -> AsyncIterator[Delivery]:
        committer = asyncio.create_task(self._committer(tracker))
        self._tasks.add(committer)
        committer.add_done_callback(self._tasks.discard)
        paused = False
        try:
            while True:
                now = time.monotonic()
                while self._deferred and self._deferred[0][0] <= now:
                    yield heapq.heappop(self._deferred)[2]
                room = prefetch - self._in_flight
                if room <= 0:
                    if not paused:
                        consumer.pause(*consumer.assignment())
                        paused = True
                elif paused:
                    consumer.resume(*consumer.assignment())
                    paused = False
                if tracker.truncated:
                    raise Truncated("a partition holds fewer messages than were read from "
                                     "it: the topic was deleted or the cluster replaced")
                wait = 1.0
                if self._deferred:
                    wait = min(wait, max(0.0, self._deferred[0][0] - now))
                if paused:
                    self._freed.clear()
                    # Keep polling while paused: aiokafka counts the time
                    # between polls against max_poll_interval_ms.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._freed.wait(), min(wait, 0.5))
                    # A rebalance assigns partitions afresh, unpaused: pause
                    # them too.  What the poll returns anyway is handed out,
                    # never dropped: the position has moved past it, and the
                    # commit would follow once a later offset finished.
                    consumer.pause(*consumer.assignment())
                    got = await consumer.getmany(timeout_ms=0)
                else:
                    got = await consumer.getmany(timeout_ms=int(wait * 1000),
                                                 max_records=max(1, room))
                for tp, msgs in got.items():
                    for m in msgs:
                        if tp not in consumer.assignment():
                            # Revoked while this batch was handed out: whoever
                            # owns it now reads it from the committed offset.
                            # Tracking it here would commit for a partition
                            # this consumer no longer owns.
                            break
                        gen = tracker.received(tp, m.offset)
                        self._in_flight += 1
                        self.received += 1
                        yield self.delivery(
                            m.value or b"", raw=(tp, m.offset, gen, tracker),
                            extra={"queue": by_topic.get(tp.topic, tp.topic),
                                   "topic": tp.topic, "partition": tp.partition,
                                   "offset": m.offset, "key": m.key,
                                   "headers": dict(m.headers or ()), "body": m.value})
        finally:
            committer.cancel()
            await asyncio.gather(committer, return_exceptions=True)

    async def _committer(self, tracker: OffsetTracker) -> None:
        while True:
            await tracker.dirty.wait()
            tracker.dirty.clear()
            await tracker.commit()
            await asyncio.sleep(_COMMIT_EVERY)

    def _settle(self, delivery: Delivery) -> None:
        raw = delivery.raw
        if not (isinstance(raw, tuple) and len(raw) == 4):
            return
        tp, offset, gen, tracker = raw
        tracker.finished(tp, offset, gen)
        self._in_flight = max(0, self._in_flight - 1)
        self._freed.set()

    async def ack(self, delivery: Delivery) -> None:
        """The handler finished: the offset may be committed once every
        earlier offset of its partition is finished too."""
        self._settle(delivery)

    async def reject(self, delivery: Delivery, reason: str) -> None:
        if delivery.message is None:
            await self._dead_letter(delivery, reason)
        elif reason == "locked":  # the row was busy, not gone: look again shortly
            await self.defer(delivery, 1.0)
            return
        self._settle(delivery)

    async def defer(self, delivery: Delivery, seconds: float) -> bool:
        """Kafka cannot hide a message: hold it here, its offset uncommitted,
        and hand it out again after ``seconds`` (a crash meanwhile redelivers
        it from Kafka)."""
        heapq.heappush(self._deferred, (time.monotonic() + max(0.0, seconds), next(self._seq),
                                        delivery))
        return True

    async def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Keep a message that is not a duebox message in ``PREFIX + dead-letter``."""
        try:
            topic = self.settings.topic(_DEAD_LETTER)
            await self.ensure_topics([topic])
            p = await self.producer()
            await p.send_and_wait(topic, delivery.extra.get("body") or b"",
                                  key=delivery.extra.get("key"),
                                  headers=[("duebox-reason", reason[:1000].encode()),
                                           ("duebox-source-topic",
                                            str(delivery.extra.get("topic", "?")).encode())])
        except (KafkaError, BrokerError, OSError) as exc:
            log.warning("%s: could not keep a rejected message in %s: %s", self._where(),
                        _DEAD_LETTER, exc)
