"""The near-due hold: claimed jobs waiting in memory for their release time.

Two places hold a claimed (leased) job until a precise moment: the relay
publishes a near-due job just before its due time instead of through the
broker's coarse delay (relay/relay.py), and a ``sql://`` worker hands a job
it claimed ahead over just before its due time (brokers/sql.py).  Both keep
them here, earliest release first; the lease in the job table is what makes
a crash lose nothing, not this.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from datetime import datetime
from typing import Generic, TypeVar

T = TypeVar("T")


class Hold(Generic[T]):
    """Items by release time, earliest first; equal times keep arrival order."""

    def __init__(self) -> None:
        self._heap: list[tuple[datetime, int, T]] = []
        self._seq = itertools.count()

    def push(self, release_at: datetime, item: T) -> bool:
        """Hold ``item`` until ``release_at``; True when it is now the
        earliest (a timer sleeping until the earliest must wake)."""
        earliest = not self._heap or release_at < self._heap[0][0]
        heapq.heappush(self._heap, (release_at, next(self._seq), item))
        return earliest

    def earliest(self) -> datetime | None:
        return self._heap[0][0] if self._heap else None

    def take(self, now: datetime) -> T | None:
        """The earliest item if its release time has come (removed), else None."""
        if self._heap and self._heap[0][0] <= now:
            return heapq.heappop(self._heap)[2]
        return None

    def take_all(self, now: datetime) -> list[T]:
        """Every item whose release time has come, earliest first (removed)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def count_due(self, now: datetime) -> int:
        return sum(1 for at, _, _ in self._heap if at <= now)

    def drain(self) -> list[T]:
        """Everything held, in no particular order (emptied)."""
        items = [item for _, _, item in self._heap]
        self._heap.clear()
        return items

    def __iter__(self) -> Iterator[T]:
        return (item for _, _, item in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
