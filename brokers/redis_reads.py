"""A worker's stream reads on a Redis Cluster: one blocking ``XREADGROUP``
per queue, all in flight at once (``redis://`` backend, brokers/redis.py).

One ``XREADGROUP`` may not read streams of several slots, and each queue's
keys are a slot of their own (the hash tag ``{queue}``).  So each queue has
its own read; :meth:`EachQueue.read` returns as soon as one brought entries
and leaves the others in flight for a later call.  A queue whose read fails
(its shard failing over) waits out a backoff of its own while the others
go on: a failing shard holds up no other queue's delivery.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from duebox.observability.logs import CollapsedLog

from .redis_mover import FAILED, passing

try:
    import redis.asyncio as aioredis
    from redis.exceptions import ResponseError
except ImportError as exc:  # pragma: no cover - exercised by a test with the module hidden
    from duebox.errors import MissingDependencyError

    raise MissingDependencyError("redis", "redis") from exc

#: (queue, stream entry id, the entry's fields) per entry read
Entry = tuple[str, Any, Any]

_FIRST_BACKOFF = 0.1


def fatal(exc: BaseException) -> bool:
    """Not a failover's passing error: raised to the consumer (which makes a
    lost group again on ``NOGROUP``/``UNBLOCKED``, and gives up on others)."""
    return isinstance(exc, ResponseError) and (
        str(exc).startswith(("NOGROUP", "UNBLOCKED")) or not passing(exc))


@dataclass
class EachQueue:
    """The reads in flight, and each failing queue's backoff."""

    group: str
    consumer: str
    stream: Callable[[str], str]  # queue -> its ready stream's key
    where: str
    log: CollapsedLog
    backoff_cap: float
    # queue -> (the read, the count it asked for)
    reads: dict[str, tuple[asyncio.Task[Any], int]] = field(default_factory=dict)
    # queue -> (monotonic time its next read may go, its backoff)
    resting: dict[str, tuple[float, float]] = field(default_factory=dict)
    # An error to raise at the next call (entries came with it this one).
    deferred: BaseException | None = None
    turn: int = 0  # which queue goes first when fewer slots are free than queues wait

    def asked(self) -> int:
        """Entries the reads in flight may still bring."""
        return sum(n for _, n in self.reads.values())

    async def read(self, client: aioredis.RedisCluster, names: list[str], room: int,
                   block_ms: int) -> list[Entry]:
        if self.deferred is not None:
            error, self.deferred = self.deferred, None
            raise error
        now = time.monotonic()
        idle = [q for q in names if q not in self.reads
                and self.resting.get(q, (0.0, 0.0))[0] <= now]
        if room > 0 and idle:
            self.turn = (self.turn + 1) % len(idle)
            idle = (idle[self.turn:] + idle[:self.turn])[:room]
            count = max(1, room // len(idle))
            for q in idle:
                read = client.xreadgroup(self.group, self.consumer, {self.stream(q): ">"},
                                         count=count, block=block_ms)
                self.reads[q] = (asyncio.ensure_future(read), count)
        # A resting queue's next read is due by then.
        until = min((at for at, _ in self.resting.values()), default=None)
        timeout = None if until is None else max(0.0, until - now)
        if not self.reads:
            await asyncio.sleep(timeout if timeout is not None else block_ms / 1000)
            return []
        await asyncio.wait([task for task, _ in self.reads.values()], timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
        return self._collect()

    def _collect(self) -> list[Entry]:
        out: list[Entry] = []
        error: BaseException | None = None
        for q, (task, _) in list(self.reads.items()):
            if not task.done():
                continue
            del self.reads[q]
            failed = task.exception()
            if failed is None:
                self.resting.pop(q, None)
                out += [(q, eid, fields) for _stream, entries in task.result() or []
                        for eid, fields in entries]
            elif fatal(failed) or not isinstance(failed, FAILED):
                error = error or failed
            else:
                backoff = min(self.resting.get(q, (0.0, _FIRST_BACKOFF / 2))[1] * 2,
                              self.backoff_cap)
                self.resting[q] = (time.monotonic() + backoff, backoff)
                self.log.warning("read", "%s: reading %s failed (%s); again in %.1fs, the "
                                 "other queues go on", self.where, q, failed, backoff)
        if error is not None:
            if not out:
                raise error
            self.deferred = error
        return out

    async def cancel(self) -> list[Entry]:
        """Stop every read in flight (the consumer is closing); returns what
        the reads that had finished brought, for the consumer to give back."""
        reads = dict(self.reads)
        self.reads.clear()
        for task, _ in reads.values():
            task.cancel()
        if reads:
            await asyncio.wait([task for task, _ in reads.values()], timeout=2.0)
        # A read may have finished before the cancel (or redis-py swallowed
        # it, see redis_mover.reraise_lost_cancel): its entries are pending.
        return [(q, eid, fields) for q, (task, _) in reads.items()
                if task.done() and not task.cancelled() and task.exception() is None
                for _stream, entries in task.result() or [] for eid, fields in entries]


__all__ = ["EachQueue", "Entry", "fatal"]
