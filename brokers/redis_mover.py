"""The ``redis://`` mover: parked jobs onto their streams as they come due.

Every worker runs one per consumption.  It sleeps until the earliest score
in a queue's ``due`` set (woken early when a publish parks an earlier job,
through the queue's ``wake`` channel) and moves what is due onto the stream
with one Lua script; several movers may run at once (the script is atomic).
Also here: what every loop that calls Redis needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from duebox.clock import Clock
from duebox.errors import MissingDependencyError
from duebox.observability.logs import CollapsedLog
from duebox.timing import HANDOVER_GATHER, HANDOVER_LEAD_SECONDS
from duebox.wait_any import wait_any

from .redis_settings import Keys

try:
    import redis.asyncio as aioredis
    from redis.exceptions import (
        AskError,
        ClusterError,
        ReadOnlyError,
        RedisClusterException,
        RedisError,
        ResponseError,
        TryAgainError,
    )
except ImportError as exc:  # pragma: no cover - exercised by a test with the module hidden
    raise MissingDependencyError("redis", "redis") from exc

# A standalone Redis or a cluster (``?cluster=1``): the backend calls only
# commands both have, one slot per call.
Client = aioredis.Redis | aioredis.RedisCluster
# What a failing call raises: redis-py's cluster client raises a few errors
# (no node serves a slot, no node answers) outside RedisError.
FAILED = (RedisError, RedisClusterException)


def passing(exc: ResponseError) -> bool:
    """An error reply that a failover gives for a while: the cluster is down,
    a slot moved, the node became a replica.  Retried, never fatal."""
    return isinstance(exc, ClusterError | AskError | TryAgainError | ReadOnlyError) or str(
        exc).startswith(("CLUSTERDOWN", "MOVED", "ASK", "TRYAGAIN", "READONLY", "LOADING"))

log = logging.getLogger("duebox.brokers.redis")

MOVE_LIMIT = 1000  # members per mover call: bounds the time a script blocks Redis
IDLE_WAKE = 1.0  # the mover looks at least this often, in case a wake was missed
PART_RETRY = 0.25  # seconds before a queue whose move failed is tried again
# The mover hands a parked job to its stream this long before its score
# (core/timing.py HANDOVER_LEAD_SECONDS); the worker holds the handler to the due time.
MOVE_LEAD_MS = HANDOVER_LEAD_SECONDS * 1000.0
# ... together with what is due this much after it (core/timing.py).
MOVE_GATHER_MS = HANDOVER_GATHER.total_seconds() * 1000.0


def reraise_lost_cancel() -> None:
    """redis-py's asyncio client can swallow a cancellation that lands while a
    command is in flight (redis/redis-py#2028, #2551; still so in 8.1): the
    command returns normally and the task goes on.  Loops that call Redis
    check here so a cancelled consumer or mover really stops."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def text(value: bytes | str) -> str:
    # "replace": a stream entry's fields are anyone's bytes (a forger's
    # non-UTF-8 id must not raise out of the consumer).
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


@dataclass
class Mover:
    """``run`` the script ``"move"`` (see brokers/redis_scripts.py)."""

    client: Client
    keys: Callable[[str], Keys]
    run_script: Callable[[str, list[str], list[Any]], Awaitable[Any]]
    clock: Clock
    where: str
    log: CollapsedLog
    # The longest wait between two failing tries (seconds); a cluster's is
    # short (see brokers/redis.py _CLUSTER_BACKOFF_CAP).
    backoff_cap: float = 5.0

    async def run(self, names: list[str], stop: asyncio.Event) -> None:
        """Sleep until the earliest parked score, then move what is due onto the
        streams; a publish that parks an earlier job wakes this early (pub/sub)."""
        client = self.client
        wake = asyncio.Event()
        listener: asyncio.Task[None] | None = None
        pubsub: Any = None
        backoff = 0.1
        try:
            while not stop.is_set():
                reraise_lost_cancel()
                if listener is None or listener.done():
                    if pubsub is not None:
                        with contextlib.suppress(*FAILED, OSError):
                            await pubsub.aclose()
                    pubsub = client.pubsub()
                    try:
                        await pubsub.subscribe(*(self.keys(q).wake for q in names))
                        listener = asyncio.create_task(self._listen(pubsub, wake))
                    except FAILED as exc:
                        # Moving goes on without wake-ups (it looks every
                        # IDLE_WAKE); the next turn subscribes again.  On a
                        # cluster the node it went through may be the one down.
                        reraise_lost_cancel()
                        listener = None
                        self.log.warning("wake", "%s: no wake-ups for now (%s)",
                                         self.where, exc)
                try:
                    wait = await self.move_due(names)
                    await wait_any(wait, wake, stop)
                    wake.clear()
                    backoff = 0.1
                except FAILED as exc:
                    reraise_lost_cancel()
                    self.log.warning("mover", "%s: mover failed (%s); retrying in %.1fs",
                                     self.where, exc, backoff)
                    await wait_any(backoff, stop)
                    backoff = min(backoff * 2, self.backoff_cap)
        finally:
            if listener is not None:
                # redis-py may swallow a cancel during a pub/sub read; closing
                # the connection ends the read either way.
                listener.cancel()
                with contextlib.suppress(*FAILED, OSError):
                    await pubsub.aclose()
                await asyncio.wait({listener}, timeout=1.0)

    @staticmethod
    async def _listen(pubsub: Any, wake: asyncio.Event) -> None:
        try:
            while True:
                if await pubsub.get_message(ignore_subscribe_messages=True, timeout=None):
                    wake.set()
        except (*FAILED, OSError) as exc:  # the mover subscribes again
            log.debug("wake-up subscription ended: %s", exc)
            wake.set()

    async def move_due(self, queues: Sequence[str]) -> float:
        """Move every due parked member onto its stream; return the seconds until
        the next one is due (at most a second).  A queue whose call fails does
        not hold up the others (on a cluster, its shard may be failing over):
        it is tried again shortly; only when every queue failed is the
        failure raised."""
        wait = IDLE_WAKE
        failed: Exception | None = None
        failures = 0
        for q in queues:
            k = self.keys(q)
            try:
                while True:
                    now_ms = self.clock.now().timestamp() * 1000.0
                    moved, head = await self.run_script(
                        "move", [k.due, k.msg, k.ready, k.held],
                        [math.floor(now_ms + MOVE_LEAD_MS + MOVE_GATHER_MS), MOVE_LIMIT])
                    if int(moved) < MOVE_LIMIT:
                        break
            except FAILED as exc:
                failed, failures = failed or exc, failures + 1
                continue
            if head is not None:
                wait = min(wait, (float(head) - MOVE_LEAD_MS - now_ms) / 1000.0)
        if failed is not None:
            if failures == len(queues):
                raise failed
            self.log.warning("mover-part", "%s: moving %d of %d queues failed (%s); the "
                             "others go on", self.where, failures, len(queues), failed)
            wait = min(wait, PART_RETRY)
        return max(0.0, wait)
