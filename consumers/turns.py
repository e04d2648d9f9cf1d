"""Handlers of one ordering key start in the order their messages arrived.

A worker has several deliveries in hand at once (group commit keeps more
than ``concurrency``), and each goes through awaits of its own (the start's
round trip, the hold to its due time, a re-read) before it reaches an
executor: two messages of one key that arrive a few milliseconds apart could
overtake each other there, against the order the backend delivered them in
(``Capabilities.ordering``).  So each delivery waits, just before it is
handed to an executor, until the one before it of the same key has been
handed over or dropped.  A job without an ``ordering_key`` header has its
own id as key: nothing ever waits for it.  A worker of concurrency 1 puts
every delivery in one line (docs/worker.md, "Order").
"""

from __future__ import annotations

import asyncio


class Turn:
    """One delivery's place in its key's line."""

    __slots__ = ("_before", "_mine")

    def __init__(self, before: asyncio.Future[None] | None, mine: asyncio.Future[None]) -> None:
        self._before = before
        self._mine = mine

    async def wait(self) -> None:
        """Until every earlier delivery of the key was handed over or dropped."""
        if self._before is not None and not self._before.done():
            await asyncio.shield(self._before)

    def pass_on(self) -> None:
        """This delivery was handed over, or dropped: the next may go once the
        ones before this one went (a dropped delivery keeps its place)."""
        before = self._before
        if before is None or before.done():
            _resolve(self._mine)
        else:
            before.add_done_callback(lambda _: _resolve(self._mine))


class Turns:
    """The line of deliveries per ordering key; a key leaves the map when its
    last delivery has passed on."""

    def __init__(self) -> None:
        self._last: dict[str, asyncio.Future[None]] = {}

    def take(self, key: str) -> Turn:
        """A place for a delivery of ``key``, behind those taken before it."""
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        before = self._last.get(key)
        self._last[key] = mine
        mine.add_done_callback(lambda f: self._forget(key, f))
        return Turn(before, mine)

    def _forget(self, key: str, done: asyncio.Future[None]) -> None:
        if self._last.get(key) is done:
            del self._last[key]

    def __len__(self) -> int:
        return len(self._last)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
