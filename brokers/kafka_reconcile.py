"""What a ``kafka://`` topic lost, for the relay's reconciliation.

Kafka keeps no "is this message still there" index, but a topic that was
deleted, wiped or cut by retention before its messages were read is
noticed: :meth:`LossWatch.data_lost` watches for a partition whose end
offset went below what this relay produced to it, and
:meth:`LossWatch.missing` names the ``ENQUEUED`` jobs published before the
oldest message the topic still holds.

An end offset below what was written is confirmed by fetching the last
record written (:meth:`LossWatch.reaching`) before it counts as a loss: a
Kafka's end offset is never below a record it serves, but tansu's memory
engine answers ListOffsets(latest) with the base offset of its newest
record batch plus one, below the rest of that batch.  Taken as a loss, each
multi-record batch made the relay republish and the worker rejoin its group.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from duebox.errors import BrokerError, MissingDependencyError

from .kafka_settings import KafkaSettings

try:
    from aiokafka import TopicPartition
    from aiokafka.errors import KafkaError
except ImportError as exc:  # pragma: no cover - exercised by a test with the module hidden
    raise MissingDependencyError("aiokafka", "kafka") from exc

if TYPE_CHECKING:
    from duebox.leases.recovery import EnqueuedRef

log = logging.getLogger("duebox.brokers.kafka")

# How long fetching records that should be there may take before their
# partitions count as cut short: a wiped topic is noticed up to this much
# later than before the fetch was asked (one look for all its partitions).
_HOLDS_WAIT = 1.0


# After a loss, how long until the relay looks again for what a publish on
# the old producer had under way (acknowledged, then marked, after the reset).
LOOK_AGAIN = 2.0

class LossWatch:
    """``probe``: the broker's group-less consumer, started on first use."""

    def __init__(self, settings: KafkaSettings, where: str,
                 probe: Callable[[], Awaitable[Any]],
                 start_over: Callable[[], Awaitable[None]]) -> None:
        self.settings = settings
        self.where = where
        self._probe = probe
        self._start_over = start_over  # the producer, after a loss
        self.produced: dict[Any, int] = {}  # partition -> highest offset produced + 1
        self._first_check = True
        # Epoch seconds: after a loss, every message published before it is
        # suspect (missing()), whatever the topic seems to hold.
        self._suspect_before = -float("inf")
        # When to look once more after a loss (time.monotonic()), or None.
        self._look_again: float | None = None
        self._last_check = time.monotonic()
        self._oldest: dict[str, tuple[float, float]] = {}  # topic -> (checked at, oldest ts)
        # The probe is assigned and seeked by one look at a time.
        self._probing = asyncio.Lock()

    async def data_lost(self) -> bool:
        """True once on first use (a relay that starts after an outage
        checks), then when a partition's end offset fell below what this
        process produced to it (the topic was deleted or wiped); looked at
        every ``check_interval`` seconds; and once more
        :data:`LOOK_AGAIN` seconds after a loss.  A publish under way on the
        old producer while it was started over can be acknowledged into
        nowhere and marked published after the first look: that look counts
        it as published before the loss.  What the new producer sent in
        between goes out twice; the worker drops the copy."""
        if self._first_check:
            self._first_check = False
            return True
        if self._look_again is not None and time.monotonic() >= self._look_again:
            self._look_again = None
            self._suspect_before = time.time()
            return True
        if not self.produced or time.monotonic() - self._last_check < \
                self.settings.check_interval:
            return False
        self._last_check = time.monotonic()
        try:
            probe = await self._probe()
            ends = await probe.end_offsets(list(self.produced))
        except (KafkaError, BrokerError, OSError) as exc:
            log.debug("%s: could not read end offsets (%s)", self.where, exc)
            if "UnknownTopicOrPartition" in repr(exc) or "not found" in str(exc):
                self.produced.clear()
                await self._noticed()
                return True
            return False
        short = {tp: self.produced[tp] - 1 for tp, end in ends.items()
                 if end < self.produced.get(tp, 0)}
        reached = await self.reaching(short)
        lost = [tp for tp in short if tp not in reached]
        if lost:
            log.warning("%s: partitions %s hold fewer messages than were produced to them; "
                        "republishing what they lost", self.where, lost)
            self.produced.clear()
            self._oldest.clear()
            await self._noticed()
        return bool(lost)

    async def _noticed(self) -> None:
        """The cluster lost what it held (restarted empty, the topic
        deleted).  The producer's metadata describes topics that may no
        longer exist, and a server that acknowledges a produce to a topic it
        does not have (tansu's memory engine does) would swallow every
        message sent with it: the producer starts over, to look the topics
        up and create them before its next send.  What was published before
        is suspect from now on (:meth:`missing`), even where the topic holds
        newer messages or cannot be read: publishing such a job again costs
        a duplicate message, which the worker drops; keeping it costs the
        job."""
        await self._start_over()
        self._suspect_before = time.time()
        self._look_again = time.monotonic() + LOOK_AGAIN

    async def reaching(self, wanted: Mapping[Any, int]) -> set[Any]:
        """The partitions of ``wanted`` (partition -> offset) that still
        reach their offset: a record at it (or, compacted, after it) can be
        fetched.  Asked only where the end offset said no, all at once; a
        broker that cannot be asked counts as no."""
        reached: set[Any] = set()
        if not wanted:
            return reached
        async with self._probing:
            try:
                probe = await self._probe()
                probe.assign(list(wanted))
                for tp, offset in wanted.items():
                    probe.seek(tp, offset)
                deadline = time.monotonic() + _HOLDS_WAIT
                open_ = set(wanted)
                try:
                    while open_ and time.monotonic() < deadline:
                        got = await probe.getmany(*open_, timeout_ms=200)
                        for tp, msgs in got.items():
                            if msgs and msgs[0].offset >= wanted[tp]:
                                reached.add(tp)
                        for tp in list(open_):
                            # Out of range: the probe moved it to its end.
                            if tp in reached or await probe.position(tp) != wanted[tp]:
                                open_.discard(tp)
                                probe.pause(tp)
                finally:
                    probe.assign([])
            except (KafkaError, BrokerError, OSError) as exc:
                log.debug("%s: could not fetch %s (%s)", self.where, dict(wanted), exc)
        return reached

    async def missing(self, jobs: Sequence[EnqueuedRef]) -> list[uuid.UUID]:
        """Jobs published before the oldest message their topic still holds
        (all of them when it holds none): deleted, wiped or expired unread;
        and after a loss, every job published before it was noticed
        (:meth:`_noticed`)."""
        gone: list[uuid.UUID] = []
        by_queue: dict[str, list[EnqueuedRef]] = {}
        for ref in jobs:
            by_queue.setdefault(ref.queue, []).append(ref)
        for queue, refs in by_queue.items():
            oldest = max(await self._oldest_timestamp(self.settings.topic(queue)),
                         self._suspect_before)
            for ref in refs:
                if ref.published_at is None or ref.published_at.timestamp() < oldest:
                    gone.append(ref.id)
        return gone

    async def _oldest_timestamp(self, topic: str) -> float:
        """Epoch seconds of the oldest message ``topic`` holds; +inf if none."""
        cached = self._oldest.get(topic)
        if cached is not None and time.monotonic() - cached[0] < 1.0:
            return cached[1]
        async with self._probing:
            oldest = await self._read_oldest(topic)
        self._oldest[topic] = (time.monotonic(), oldest)
        return oldest

    async def _read_oldest(self, topic: str) -> float:
        try:
            probe = await self._probe()
            parts = await asyncio.wait_for(self._partitions(probe, topic),
                                           self.settings.request_timeout_ms / 1000)
            oldest = float("inf")
            if parts:
                begins = await probe.beginning_offsets(parts)
                ends = await probe.end_offsets(parts)
                full = [tp for tp in parts if ends[tp] > begins[tp]]
                if full:
                    probe.assign(full)
                    for tp in full:
                        probe.seek(tp, begins[tp])
                    firsts: dict[Any, float] = {}
                    deadline = time.monotonic() + self.settings.request_timeout_ms / 1000
                    while len(firsts) < len(full) and time.monotonic() < deadline:
                        got = await probe.getmany(timeout_ms=200, max_records=len(full))
                        for tp, msgs in got.items():
                            if msgs and tp not in firsts:
                                firsts[tp] = msgs[0].timestamp / 1000.0
                                probe.pause(tp)
                    # Could not read them all: claim nothing is missing.
                    oldest = min(firsts.values()) if len(firsts) == len(full) else -oldest
                    probe.assign([])
        except (KafkaError, OSError, TimeoutError) as exc:
            raise BrokerError(f"{self.where}: reading topic {topic!r} failed: {exc}") from exc
        return oldest

    @staticmethod
    async def _partitions(probe: Any, topic: str) -> list[Any]:
        await probe._client.force_metadata_update()
        found = probe._client.cluster.partitions_for_topic(topic) or set()
        return [TopicPartition(topic, p) for p in sorted(found)]
