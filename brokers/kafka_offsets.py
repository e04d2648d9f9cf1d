"""Which Kafka offsets a ``kafka://`` consumer may commit (see
:mod:`duebox.brokers.kafka`).

Messages of a partition finish out of order (handlers run concurrently), but
a committed offset says everything below it is done: per partition the
tracker keeps the received offsets not yet finished and commits the lowest
of them (or the next offset after the last one received), across
rebalances.  A position beyond a partition's end means it was truncated
under the consumer (the topic deleted, the cluster replaced): nothing is
committed and the consumer starts over.  The end offset is confirmed by a
fetch first (``reaching``, brokers/kafka_reconcile.py): tansu's lags the log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from duebox.errors import MissingDependencyError

try:
    from aiokafka.abc import ConsumerRebalanceListener
    from aiokafka.errors import KafkaError
    from aiokafka.structs import OffsetAndMetadata
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("aiokafka", "kafka") from exc

log = logging.getLogger("duebox.brokers.kafka")


@dataclass
class Partition:
    """Offsets of one assigned partition: received and not finished ones, and
    the next offset after the last one received."""

    generation: int
    pending: set[int] = field(default_factory=set)
    upto: int = -1  # next offset after the highest received
    committed: int = -1

    def position(self) -> int:
        """What may be committed: everything below it is finished."""
        return min(self.pending) if self.pending else self.upto


class Truncated(Exception):
    """A consumed partition was truncated: start the consumer over."""


class OffsetTracker(ConsumerRebalanceListener):  # type: ignore[misc]
    """Which offsets may be committed, per partition, across rebalances."""

    def __init__(self, freed: asyncio.Event,
                 on_assigned: Callable[[], None] | None = None,
                 reaching: Callable[[Mapping[Any, int]], Awaitable[set[Any]]] | None = None
                 ) -> None:
        self.freed = freed  # set when revoked partitions free prefetch slots
        self.on_assigned = on_assigned
        # Which partitions still reach an offset, fetched: asked before an
        # end offset below a position counts as truncation.
        self.reaching = reaching
        self.parts: dict[Any, Partition] = {}
        self.generations = itertools.count(1)
        self.dirty = asyncio.Event()
        self.consumer: Any = None
        self.truncated = False

    def received(self, tp: Any, offset: int) -> int:
        part = self.parts.get(tp)
        if part is None:
            part = self.parts[tp] = Partition(next(self.generations))
        part.pending.add(offset)
        part.upto = max(part.upto, offset + 1)
        return part.generation

    def finished(self, tp: Any, offset: int, generation: int) -> bool:
        part = self.parts.get(tp)
        if part is None or part.generation != generation:
            return False  # the partition moved to another consumer meanwhile
        part.pending.discard(offset)
        self.dirty.set()
        return True

    def to_commit(self, tps: Sequence[Any] | None = None) -> dict[Any, Any]:
        out = {}
        for tp, part in self.parts.items():
            if tps is not None and tp not in tps:
                continue
            pos = part.position()
            if pos >= 0 and pos != part.committed:
                out[tp] = (part, pos)
        return out

    async def commit(self, tps: Sequence[Any] | None = None) -> None:
        """Commit finished positions.  A position beyond the partition's end
        means the partition was truncated under us (the topic was deleted or
        the cluster replaced): nothing is committed then and the consumer
        starts over, or it would skip the new incarnation's first messages."""
        todo = self.to_commit(tps)
        consumer = self.consumer
        if not todo or consumer is None:
            return
        try:
            ends = await consumer.end_offsets(list(todo))
            if self.consumer is not consumer:
                # Retired while we asked (a failed consume, KafkaBroker._retire):
                # after a failure nothing is committed.  This ran as a
                # rebalance's revoke callback beside it and used to raise
                # AttributeError on the cleared consumer.
                return
            short = {tp: pos - 1 for tp, (_, pos) in todo.items() if ends.get(tp, 0) < pos}
            if short and (self.reaching is None or await self.reaching(short) != set(short)):
                self.truncated = True
                return
            if self.consumer is not consumer:
                return
            await consumer.commit({tp: OffsetAndMetadata(pos, "")
                                   for tp, (_, pos) in todo.items()})
        except KafkaError as exc:
            log.info("offset commit failed (%s); the messages may be delivered again", exc)
            if "UnknownTopicOrPartition" in type(exc).__name__:
                self.truncated = True
            return
        for part, pos in todo.values():
            part.committed = pos

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.commit(list(revoked))
        for tp in revoked:
            self.parts.pop(tp, None)
        self.freed.set()

    async def on_partitions_assigned(self, assigned: Any) -> None:
        # A new member id: the worker's registry row should say so now
        # (KafkaBroker.registry_info), not at its next beat.
        if self.on_assigned is not None:
            self.on_assigned()
