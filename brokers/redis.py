"""``redis://`` — a due-time sorted set in front of a stream with consumer groups.

Redis is an index here, never the source of truth: the job table is.  Per
queue (all keys of one queue share the hash tag ``{queue}``):

``PREFIX:{Q}:due``   sorted set, member = job id, score = visible-at (epoch ms)
``PREFIX:{Q}:msg``   hash, job id → encoded message, for members of ``due``
``PREFIX:{Q}:ready`` stream read with the consumer group ``group``
``PREFIX:{Q}:held``  hash, job id → ``"VERSION|LOCATION"`` where LOCATION is
                     ``z`` (parked in ``due``) or the stream entry id
``PREFIX:{Q}:wake``  pub/sub channel: a new earliest due time was parked

The relay publishes with one Lua call per queue and batch: a message already
due goes straight onto the stream, a later one is parked in ``due``.  The
member is the job id, so a reschedule replaces the parked entry in place and a
duplicate publish of a parked job adds nothing.  Workers run the *mover*: each
sleeps until the earliest score (woken early on ``wake``) and a Lua script
moves due members atomically onto the stream; several workers may run it at
once.  Workers read with ``XREADGROUP``; ``ack`` is ``XACK`` + ``XDEL``.
Entries left unacknowledged longer than ``claim_idle`` (their worker died) are
taken over with ``XAUTOCLAIM`` and delivered again; the version-checked start
and the SQL dedupe store drop what already ran or is still running.

``held`` is what reconciliation reads: the relay asks, for the jobs the
database says are ``ENQUEUED``, which ones Redis no longer holds, and publishes
those again.  The key ``PREFIX:alive`` is a sentinel: when it is gone (Redis
restarted without persistence, ``FLUSHALL``) the relay reconciles at once.

URL: ``redis://[:password@]host:port/db?prefix=duebox&horizon=3600&group=duebox
&claim_idle=30&max_delay=...``; other query parameters go to redis-py.

A Redis Cluster (``cluster=1``, or several seeds ``redis://h1:p1,h2:p2/0``)
goes through redis-py's ``RedisCluster``: each script touches one queue's
keys (one slot), a worker keeps one read per queue in flight (one
``XREADGROUP`` cannot span slots), and ``data_lost`` also says so after a
failover (brokers/redis_shards.py).  docs/brokers.md, "Redis Cluster".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from duebox.batched_calls import Batched
from duebox.errors import (
    BrokerError,
    ConfigurationError,
    MissingDependencyError,
    ValidationError,
)
from duebox.observability.logs import CollapsedLog
from duebox.wait_any import wait_any

from . import redis_scripts as scripts
from .base import (
    BrokerContext,
    Capabilities,
    Delivery,
    Durability,
    Ordering,
    Outgoing,
    PublishingBroker,
    PublishResult,
    buffer_size,
    refused,
)
from .redis_mover import (
    FAILED,
    IDLE_WAKE,
    MOVE_LIMIT,
    Client,
    Mover,
    passing,
    reraise_lost_cancel,
    text,
)
from .redis_reads import EachQueue
from .redis_settings import Keys, RedisSettings
from .redis_shards import ShardView, shard_view, shards_changed

try:
    import redis.asyncio as aioredis
    from redis.exceptions import ResponseError
except ImportError as exc:  # pragma: no cover - exercised by a test with the module hidden
    raise MissingDependencyError("redis", "redis") from exc

if TYPE_CHECKING:
    from duebox.leases.recovery import EnqueuedRef

log = logging.getLogger("duebox.brokers.redis")

_PUBLISH_CHUNK = 1000
# Acks wait this long for others to go with them (the slot is free at once).
_ACK_LINGER = 0.002
_REFILL_PART = 8  # read again once this part of the prefetch is free
_PRUNE_EVERY = 600.0  # seconds between sweeps for consumers that left long ago
# A failing read waits at most this long before the next (seconds).  A
# cluster's is short: a failover ends within seconds, and a worker's other
# queues, on other shards, wait behind it.
_BACKOFF_CAP = 5.0
_CLUSTER_BACKOFF_CAP = 1.0
_SHARDS_EVERY = 0.5  # seconds between two looks at a cluster's shards (data_lost)


class RedisBroker(PublishingBroker):
    capabilities = Capabilities(
        name="redis",
        max_delay=3600.0,
        delay_precision=0.001,
        cancel=True,
        ordering=Ordering.DUE,
        ordering_note="by due time, ties by job id, within a queue; concurrent workers interleave",
        durability=Durability.BROKER,
        durability_note="Redis's own: none without AOF; the database is the source of truth and "
                        "the relay's reconciliation publishes again what Redis lost",
        payload_limit=512 * 1024 * 1024,
        redelivers_unacked=True,
        prompt_redelivery=True,
        in_flight_after_cancel="broker.cancel() removes a parked or unread entry; one already "
                               "read is discarded by the version check; a reschedule replaces "
                               "the parked entry in place",
    )

    def __init__(self, url: str, context: BrokerContext) -> None:
        self.settings = RedisSettings.from_url(url)
        self.capabilities = replace(type(self).capabilities, max_delay=self.settings.horizon)
        super().__init__(url, context)
        self.consumer = context.worker_name
        self.reclaimed = 0  # deliveries taken over from idle consumers (tests, metrics)
        self._client: Client | None = None
        # A cluster's shards as last seen: slot ranges -> (primary's node id,
        # its replication offset); see data_lost.
        self._shards: ShardView | None = None
        self._shards_due = 0.0
        self._queues_told: set[str] = set()  # queues added to PREFIX:queues (publish)
        self._scripts: dict[str, Any] = {}
        self._in_flight: dict[str, str] = {}  # stream entry id -> queue
        self._freed = asyncio.Event()
        self._cursors: dict[str, str] = {}
        # Acks that queue up while one is on its way go together, one
        # script call per queue (a round trip per ack cost a quarter of a
        # busy worker's CPU).
        self._acks: dict[str, Batched[tuple[str, str], None]] = {}
        # Deliveries a stopping worker gives back (release), on their way.
        self._releasing: set[asyncio.Task[bool]] = set()
        # Defers that failed, tried again (_defer_again).
        self._deferring: set[asyncio.Task[None]] = set()
        self._log = CollapsedLog(log)
        # A cluster's reads: one per queue in flight (brokers/redis_reads.py).
        self._each = EachQueue(self.settings.group, self.consumer,
                               lambda q: self.keys(q).ready, self._where(), self._log,
                               self._backoff_cap())

    @classmethod
    def check_queue_name(cls, url: str, name: str) -> None:
        """No braces: a queue's keys share the hash tag ``{queue}`` (one
        cluster slot, so its scripts may touch them all)."""
        if "{" in name or "}" in name:
            raise ValidationError("queue", "must not contain '{' or '}' on Redis (its keys "
                                  "keep a queue in one cluster slot with a {queue} hash tag)",
                                  name)

    # --- connection -----------------------------------------------------------

    def _where(self) -> str:
        if self.settings.cluster:
            return "redis cluster at " + ",".join(f"{h}:{p}" for h, p in self.settings.seeds)
        parts = urlsplit(self.settings.client_url)
        host = parts.hostname or "localhost"
        return f"redis at {host}:{parts.port or 6379}{parts.path or ''}"

    def _connect(self, options: dict[str, Any]) -> Client:
        if not self.settings.cluster:
            return aioredis.Redis.from_url(self.settings.client_url, **options)
        from redis.asyncio.cluster import ClusterNode

        # Every host of the URL is a seed: the cluster is found through any
        # that answers.  MOVED and ASK are followed by redis-py.
        return aioredis.RedisCluster.from_url(
            self.settings.client_url, **options,
            startup_nodes=[ClusterNode(h, p) for h, p in self.settings.seeds[1:]])

    async def open(self) -> None:
        if self._client is not None:
            return
        options: dict[str, Any] = {"protocol": 2}
        if "client_name" not in urlsplit(self.settings.client_url).query:
            # CLIENT LIST then shows which duebox process holds a connection.
            options["client_name"] = "".join(
                c if c.isalnum() or c in "-_.:#" else "_"
                for c in f"{self.settings.prefix}:{self.consumer}")
        try:
            client = self._connect(options)
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"broker_url: {exc}") from exc
        try:
            if isinstance(client, aioredis.RedisCluster):
                # The slot map, from any seed (a PING would go to every node,
                # and fail while one is down).
                await client.initialize()
            else:
                await client.ping()
        except FAILED as exc:
            await client.aclose()
            raise BrokerError(f"{self._where()} is not reachable: {exc}") from exc
        self._scripts = {name: client.register_script(scripts.source(name))
                         for name in scripts.NAMES}
        self._client = client
        with contextlib.suppress(*FAILED):  # CONFIG may be disabled (managed Redis)
            # On a cluster, one node's answer stands for all (set them alike).
            target = ({"target_nodes": aioredis.RedisCluster.RANDOM}
                      if isinstance(client, aioredis.RedisCluster) else {})
            reply = await client.config_get("maxmemory-policy", **target)
            policy = reply.get("maxmemory-policy") if isinstance(reply, dict) else None
            if policy and text(policy).startswith("allkeys"):
                log.warning("%s evicts keys under memory pressure (maxmemory-policy=%s): "
                            "use noeviction; duebox keys carry no TTL", self._where(),
                            text(policy))

    async def close(self) -> None:
        if self._releasing:
            await asyncio.wait(set(self._releasing))
        # Still failing: their entries stay pending, taken over after claim_idle.
        for task in self._deferring:
            task.cancel()
        if self._deferring:
            await asyncio.wait(set(self._deferring), timeout=2.0)
        for acks in self._acks.values():  # those still lingering go out first
            await acks.flush()
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*FAILED, OSError):
                await client.aclose()

    async def _redis(self) -> Client:
        if self._client is None:
            await self.open()
        assert self._client is not None
        return self._client

    def keys(self, queue: str) -> Keys:
        return Keys.of(self.settings.prefix, queue)

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self._scripts[name](keys=keys, args=args)

    # --- relay side -------------------------------------------------------------

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        client = await self._redis()
        by_queue: dict[str, list[int]] = {}
        for i, out in enumerate(batch):
            by_queue.setdefault(out.message.queue, []).append(i)
        results: list[PublishResult | None] = [None] * len(batch)
        for queue, indexes in list(by_queue.items()):
            try:
                self.check_queue_name(self.url, queue)
            except ValidationError as exc:
                for i in indexes:
                    results[i] = refused(batch[i].message.job_id, exc)
                del by_queue[queue]
        sends = [self._publish_queue(client, queue, indexes, batch, results)
                 for queue, indexes in by_queue.items()]
        if isinstance(client, aioredis.RedisCluster):
            # Each queue's shard at once: one failing over holds up no other.
            outcomes = [e for errors in await asyncio.gather(*sends) for e in errors]
        else:
            outcomes = [e for send in sends for e in await send]
        errors = [e for e in outcomes if e is not None]
        if errors and len(errors) == len(outcomes):  # nothing got through: an outage
            raise BrokerError(f"{self._where()} refused the publish: {errors[0]}") from errors[0]
        return [r for r in results if r is not None]

    async def _publish_queue(self, client: Client, queue: str, indexes: list[int],
                             batch: Sequence[Outgoing], results: list[PublishResult | None]
                             ) -> list[Exception | None]:
        """One queue's share of a batch, a script call per chunk; fills in
        ``results``; returns each call's error (None: it went through)."""
        k = self.keys(queue)
        outcomes: list[Exception | None] = []
        for start in range(0, len(indexes), _PUBLISH_CHUNK):
            chunk = indexes[start:start + _PUBLISH_CHUNK]
            now_ms = self.context.clock.now().timestamp() * 1000.0
            args: list[Any] = [math.floor(now_ms), k.wake]
            for i in chunk:
                out = batch[i]
                # Delay 0 means already due: straight onto the stream.  A
                # later one is parked, rounded up to the millisecond.
                score = (math.floor(now_ms) if out.delay <= 0
                         else math.ceil(now_ms + out.delay * 1000.0))
                args += [out.message.id_text, out.message.version, score,
                         out.message.encode()]
            try:
                placed = await self._run("publish", [k.due, k.msg, k.ready, k.held], args)
                if queue not in self._queues_told:
                    # The queue names, for cancel(); told again once Redis
                    # may have lost them (data_lost).  Best effort: on a
                    # cluster this key's shard may be down while the queue's
                    # serves (cancel is optional; the version check discards
                    # what it leaves).
                    with contextlib.suppress(*FAILED):
                        await client.sadd(f"{self.settings.prefix}:queues", queue)
                        self._queues_told.add(queue)
            except FAILED as exc:
                outcomes.append(exc)
                for i in chunk:
                    results[i] = PublishResult(batch[i].message.job_id, False, error=str(exc))
                continue
            outcomes.append(None)
            for i, where in zip(chunk, placed, strict=True):
                where = text(where)
                results[i] = PublishResult(batch[i].message.job_id, True,
                                           None if where in ("z", "stale") else where)
        return outcomes

    async def cancel(self, job_ids: Sequence[uuid.UUID]) -> int:
        """Drop cancelled jobs' entries: parked ones and stream entries no worker
        has read (one being read is discarded by the worker's version check)."""
        if not job_ids:
            return 0
        client = await self._redis()
        ids = [str(j) for j in job_ids]
        try:
            queues = await client.smembers(f"{self.settings.prefix}:queues")
            total = 0
            for q in sorted(text(q) for q in queues):
                k = self.keys(q)
                total += int(await self._run("cancel", [k.due, k.msg, k.ready, k.held], ids))
        except FAILED as exc:
            raise BrokerError(f"{self._where()}: cancel failed: {exc}") from exc
        return total

    async def missing(self, jobs: Sequence[EnqueuedRef]) -> list[uuid.UUID]:
        await self._redis()
        by_queue: dict[str, list[EnqueuedRef]] = {}
        for ref in jobs:
            by_queue.setdefault(ref.queue, []).append(ref)
        gone: list[uuid.UUID] = []
        try:
            for queue, refs in by_queue.items():
                k = self.keys(queue)
                args: list[Any] = []
                for ref in refs:
                    args += [str(ref.id), str(ref.version)]
                found = await self._run("missing", [k.due, k.ready, k.held], args)
                gone += [uuid.UUID(text(x)) for x in found]
        except FAILED as exc:
            raise BrokerError(f"{self._where()}: reconciliation failed: {exc}") from exc
        return gone

    async def data_lost(self) -> bool:
        """True once after the sentinel key vanished (and on first use against
        an empty Redis, when reconciling is cheap and harmless).  On a
        cluster, also once after a shard's primary changed or went back (see
        :meth:`_shards_changed`)."""
        client = await self._redis()
        if isinstance(client, aioredis.RedisCluster):
            lost = await self._cluster_lost(client)
        else:
            try:
                lost = bool(await client.set(f"{self.settings.prefix}:alive", "1", nx=True))
            except FAILED as exc:
                raise BrokerError(f"{self._where()}: {exc}") from exc
        if lost:
            self._queues_told.clear()  # PREFIX:queues may be gone too
        return lost

    async def _cluster_lost(self, client: aioredis.RedisCluster) -> bool:
        """The sentinel lives on one shard; any other may fail over alone, so
        the shards are looked at too (brokers/redis_shards.py).  While a
        shard does not answer this says False: the relay's pass goes on with
        the shards that do, and a later look sees the new primary."""
        now = time.monotonic()
        if now < self._shards_due:
            return False
        self._shards_due = now + _SHARDS_EVERY
        try:
            fresh = bool(await client.set(f"{self.settings.prefix}:alive", "1", nx=True))
            shards = shard_view(await client.cluster_shards())
        except FAILED as exc:
            self._log.warning("shards", "%s: cannot look at the cluster now (%s); again "
                              "shortly", self._where(), exc)
            return False
        seen, self._shards = self._shards, shards
        # The first look reconciles too: a relay (re)started during a
        # failover has nothing to compare with.
        return fresh or seen is None or shards_changed(seen, shards)

    def queue_name(self, queue: str) -> str:
        self.check_queue_name(self.url, queue)
        return self.keys(queue).ready

    async def declare(self, queues: Sequence[str]) -> list[str]:
        """The ready streams and their consumer group (the URL's ``group``):
        a consumer of your own reads them with ``XREADGROUP``."""
        names = [self.queue_name(q) for q in queues]
        try:
            await self._ensure_groups(await self._redis(), list(queues))
        except FAILED as exc:
            raise BrokerError(f"{self._where()}: declaring {', '.join(queues)} failed: "
                              f"{exc}") from exc
        return names

    async def serve_own_queues(self, queues: Sequence[str], stop: asyncio.Event) -> None:
        """The mover a duebox worker runs, for queues no duebox worker reads:
        parked messages reach the ready stream as they come due."""
        if queues:
            await self._mover(await self._redis()).run(list(queues), stop)

    def _mover(self, client: Client) -> Mover:
        return Mover(client, self.keys, self._run, self.context.clock, self._where(), self._log,
                     backoff_cap=self._backoff_cap())

    def _backoff_cap(self) -> float:
        return _CLUSTER_BACKOFF_CAP if self.settings.cluster else _BACKOFF_CAP

    def locate(self, job: EnqueuedRef, now: datetime) -> str:
        if job.due_at > now:
            return "in the Redis index (sorted set by due time)"
        return f"in the Redis ready stream of {job.queue}"

    # --- worker side ------------------------------------------------------------

    async def consume(self, queues: Sequence[str], prefetch: int,
                      wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        names = list(queues) or ["default"]
        client = await self._redis()
        stop = asyncio.Event()
        mover = asyncio.create_task(
            self._mover(client).run(names, stop), name="duebox-redis-mover")
        ready = False
        next_reclaim = next_prune = 0.0
        backoff = 0.1
        cap = self._backoff_cap()
        batch: list[Delivery] = []
        try:
            while True:
                reraise_lost_cancel()
                size = buffer_size(prefetch, wanted)
                # Reads still in flight (a cluster's) may bring what they asked for.
                room = size - len(self._in_flight) - self._each.asked()
                # With most of the prefetch in hand, wait for a few slots
                # to free up: refilling one slot per read cost a round trip
                # per message.
                if not self._each.reads and (room <= 0 or (room < size // _REFILL_PART
                                                      and self._in_flight)):
                    await wait_any(IDLE_WAKE, self._freed)
                    self._freed.clear()
                    continue
                try:
                    if not ready:
                        await self._ensure_groups(client, names)
                        ready = True
                    if time.monotonic() >= next_reclaim:
                        next_reclaim = time.monotonic() + self.settings.claim_idle / 2
                        batch = await self._reclaim(client, names, room)
                    if time.monotonic() >= next_prune:
                        next_prune = time.monotonic() + _PRUNE_EVERY
                        with contextlib.suppress(*FAILED):  # housekeeping only
                            await self._prune_consumers(client, names)
                    if not batch:
                        block = max(1, int(min(1.0, next_reclaim - time.monotonic()) * 1000))
                        batch = await self._read(client, names, room, block)
                    backoff = 0.1
                except FAILED as exc:
                    if isinstance(exc, ResponseError) and str(exc).startswith(
                            ("NOGROUP", "UNBLOCKED")):
                        # Redis lost the stream and its group (or a failover
                        # unblocked the read): make them again.
                        ready = False
                        continue
                    if isinstance(exc, ResponseError) and not passing(exc):
                        raise BrokerError(f"{self._where()}: {exc}") from exc
                    reraise_lost_cancel()
                    self._log.warning("read", "%s: read failed (%s); retrying in %.1fs",
                                      self._where(), exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, cap)
                    continue
                reraise_lost_cancel()
                batch.reverse()
                while batch:  # what is left if the worker stops: given back below
                    yield batch.pop()
        finally:
            for unread in batch:  # read, never handed to the worker
                self.release(unread)
            for q, eid, fields in await self._each.cancel():  # read in flight, never handed on
                self.release(self._delivery(q, eid, fields, redelivered=False))
            stop.set()
            mover.cancel()
            await asyncio.wait({mover}, timeout=2.0)

    async def _ensure_groups(self, client: Client, names: list[str]) -> None:
        for q in names:
            try:
                # From "0", not "$": entries added before the group existed
                # (after Redis lost everything) are delivered too.
                await client.xgroup_create(self.keys(q).ready, self.settings.group, id="0",
                                           mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _delivery(self, queue: str, eid: bytes | str, fields: dict[Any, Any] | None,
                  redelivered: bool) -> Delivery:
        entry = text(eid)
        fields = fields or {}
        self._in_flight[entry] = queue
        job = text(fields.get(b"id", b""))
        return self.delivery(fields.get(b"body", b""), raw=entry, redelivered=redelivered,
                                  extra={"queue": queue, "entry": entry, "job": job})

    async def _read(self, client: Client, names: list[str], room: int,
                    block_ms: int) -> list[Delivery]:
        if isinstance(client, aioredis.RedisCluster) and len(names) > 1:
            return [self._delivery(q, eid, fields, redelivered=False) for q, eid, fields
                    in await self._each.read(client, names, room, block_ms)]
        streams = {self.keys(q).ready: ">" for q in names}
        by_stream = {self.keys(q).ready: q for q in names}
        count = max(1, room // len(names))
        reply: Any = await client.xreadgroup(self.settings.group, self.consumer,
                                             streams,  # type: ignore[arg-type]
                                             count=count, block=block_ms)
        out = []
        for stream, entries in reply or []:
            queue = by_stream[text(stream)]
            for eid, fields in entries:
                out.append(self._delivery(queue, eid, fields, redelivered=False))
        return out

    async def _reclaim(self, client: Client, names: list[str],
                       room: int) -> list[Delivery]:
        """Take over entries unacknowledged for longer than ``claim_idle``: their
        worker died, or its handler is still running (then the start finds the
        job RUNNING and the redelivery is discarded), or it failed to settle
        them.  Our own such entries are delivered again too."""
        idle_ms = int(self.settings.claim_idle * 1000)
        out: list[Delivery] = []
        for q in names:
            if len(out) >= room:
                break
            reply = await client.xautoclaim(self.keys(q).ready, self.settings.group,
                                            self.consumer, idle_ms,
                                            start_id=self._cursors.get(q, "0-0"),
                                            count=room - len(out))
            self._cursors[q] = text(reply[0])
            for eid, fields in reply[1]:
                if not fields:  # deleted meanwhile (Redis < 7 reports them so)
                    continue
                self.reclaimed += 1
                log.info("took over entry %s of queue %s from an idle consumer", text(eid), q)
                out.append(self._delivery(q, eid, fields, redelivered=True))
        return out

    async def take_over(self, worker: str, info: Mapping[str, Any]) -> int:
        """A dead worker's pending entries go back on their streams now, for
        live consumers to read, instead of after ``claim_idle``."""
        await self._redis()
        total = 0
        queues = info.get("queues")
        for q in [q for q in queues or [] if isinstance(q, str)] or ["default"]:
            k = self.keys(q)
            while True:
                try:
                    looked, handed = await self._run(
                        "hand_on", [k.ready, k.held], [self.settings.group, worker,
                                                       MOVE_LIMIT])
                except ResponseError as exc:
                    if str(exc).startswith("NOGROUP"):
                        break  # no stream or group: nothing was pending
                    raise BrokerError(f"{self._where()}: {exc}") from exc
                except FAILED as exc:
                    raise BrokerError(f"{self._where()}: {exc}") from exc
                total += int(handed)
                if int(looked) < MOVE_LIMIT:
                    break
        return total

    async def _prune_consumers(self, client: Client, names: list[str]) -> None:
        """Forget consumers with nothing pending that were idle for an hour (or
        ten claim periods): dead workers' names would pile up otherwise."""
        limit_ms = max(3600.0, 10 * self.settings.claim_idle) * 1000
        for q in names:
            stream = self.keys(q).ready
            for c in await client.xinfo_consumers(stream, self.settings.group):
                name = text(c["name"])
                if name != self.consumer and not c["pending"] and c["idle"] > limit_ms:
                    await client.xgroup_delconsumer(stream, self.settings.group, name)

    # --- settling a delivery ------------------------------------------------------

    def _settle(self, delivery: Delivery) -> tuple[Keys, str, str] | None:
        entry = delivery.extra.get("entry")
        queue = delivery.extra.get("queue")
        if entry is None or queue is None:
            return None
        if self._in_flight.pop(entry, None) is not None:
            self._freed.set()
        return self.keys(queue), entry, delivery.extra.get("job", "")

    async def ack(self, delivery: Delivery) -> None:
        settled = self._settle(delivery)
        if settled is None:
            return
        k, entry, job = settled
        acks = self._acks.get(k.ready)
        if acks is None:
            acks = self._acks[k.ready] = Batched(
                "acking", functools.partial(self._ack_many, k), lanes=1, linger=_ACK_LINGER)
        try:
            await acks.call((entry, job))
        except FAILED as exc:
            # The entry stays pending; it is taken over after claim_idle and
            # the redelivery is discarded by the version check.
            self._log.warning("ack", "%s: ack of %s failed: %s", self._where(), entry, exc)

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """One ack script per stream for all of these (no linger: they are
        all here already)."""
        by_stream: dict[str, tuple[Keys, list[tuple[str, str]]]] = {}
        for delivery in deliveries:
            settled = self._settle(delivery)
            if settled is not None:
                k, entry, job = settled
                by_stream.setdefault(k.ready, (k, []))[1].append((entry, job))
        for k, acks in by_stream.values():
            try:
                await self._ack_many(k, acks)
            except FAILED as exc:  # pending: taken over after claim_idle, then discarded
                self._log.warning("ack", "%s: ack of %d entries failed: %s", self._where(),
                                  len(acks), exc)

    async def _ack_many(self, k: Keys, acks: list[tuple[str, str]]) -> list[None]:
        """XACK + XDEL each (stream entry, job id), and drop the job's index
        entry if it still points at that entry: one script, atomic."""
        await self._run("ack", [k.ready, k.held],
                        [self.settings.group, *itertools.chain.from_iterable(acks)])
        return [None] * len(acks)

    async def reject(self, delivery: Delivery, reason: str) -> None:
        if reason == "locked":  # the row was busy, not gone: look again shortly
            await self.defer(delivery, 1.0)
        else:
            await self.ack(delivery)

    def release(self, delivery: Delivery) -> None:
        """A stopping worker will never handle it: parked again as due now
        (as hand_back), for another consumer's mover to put back on the
        stream at once — not left pending until ``claim_idle`` passes."""
        task = asyncio.get_running_loop().create_task(self.defer(delivery, 0.0))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def hand_back(self, delivery: Delivery) -> bool:
        """Another consumer should have it: parked again with a due time of
        now, which the mover puts back on the stream for any consumer."""
        return await self.defer(delivery, 0.0)

    async def defer(self, delivery: Delivery, seconds: float) -> bool:
        """Park the message again for ``seconds`` (XACK + XDEL + ZADD,
        atomically).  If that fails it is tried again in the background
        (:meth:`_defer_again`); failing still, the entry stays pending and
        is taken over after ``claim_idle``: Redis's own bounded retry."""
        msg = delivery.message
        if msg is None:
            await self.ack(delivery)
            return True
        settled = self._settle(delivery)
        if settled is None:
            return True
        k, entry, job = settled
        now_ms = self.context.clock.now().timestamp() * 1000.0
        score = math.ceil(now_ms + max(0.0, seconds) * 1000.0)
        keys = [k.due, k.msg, k.ready, k.held]
        args = [self.settings.group, entry, job or str(msg.job_id), msg.version, score,
                msg.encode(), k.wake]
        try:
            await self._run("defer", keys, args)
        except FAILED as exc:
            self._log.warning("defer", "%s: defer of %s failed: %s; trying again", self._where(),
                              entry, exc)
            task = asyncio.get_running_loop().create_task(self._defer_again(entry, keys, args))
            self._deferring.add(task)
            task.add_done_callback(self._deferring.discard)
        return True

    async def _defer_again(self, entry: str, keys: list[str], args: list[Any]) -> None:
        """A defer that failed, tried again until Redis takes it: on a
        cluster its shard may be failing over, and the entry left pending
        waited ``claim_idle`` and a reclaim period (30-45 s) after a failover
        of seconds.  For half of ``claim_idle`` at most: after that the
        entry may be another consumer's (``XAUTOCLAIM``), and stays pending."""
        until = time.monotonic() + self.settings.claim_idle / 2
        backoff = 0.1
        while time.monotonic() < until:
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._backoff_cap())
            try:
                await self._run("defer", keys, args)
            except FAILED as exc:
                reraise_lost_cancel()
                if isinstance(exc, ResponseError) and not passing(exc):
                    break
                continue
            log.info("%s: defer of %s done after all", self._where(), entry)
            return
        self._log.warning("defer-again", "%s: defer of %s still failing; the entry stays "
                          "pending until claim_idle", self._where(), entry)
