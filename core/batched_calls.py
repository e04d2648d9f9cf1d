"""Short calls made by many deliveries at once, batched.

Each delivery's version-checked start, each re-read of a job leased ahead
of its due time (one short statement each) and each Redis ack (one round
trip each): made one by one they bound a worker to a few hundred jobs/s.
Here at most ``lanes`` calls run at once; the deliveries that ask meanwhile
wait and the next call serves them all together (up to ``most``).  With
nothing waiting a delivery is served at once, so batching costs no latency.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .observability.logs import CollapsedLog, kind_of

log = logging.getLogger("duebox.worker")
# An outage fails every batch the same way: once per kind per interval.
_log = CollapsedLog(log)

I = TypeVar("I")  # noqa: E741 - the item type, as in the signature below
R = TypeVar("R")


@dataclass(eq=False)
class _Call(Generic[I, R]):
    item: I
    future: asyncio.Future[R]


class Batched(Generic[I, R]):
    """``call(item)`` → ``(await run(items))[i]``, with ``run`` made for as
    many waiting items as there are.  ``run`` must be all or nothing (one
    transaction, one script): if it raises for a batch, nothing of it
    happened and each item is tried again alone (a deadlock with another
    worker's batch, a dropped connection), so one bad item cannot fail the
    others.

    ``linger``: with no call running, wait this long for more items before
    the first call (for calls nobody waits on to start work: acks)."""

    def __init__(self, what: str, run: Callable[[list[I]], Awaitable[list[R]]],
                 lanes: int = 2, most: int = 256, linger: float = 0.0) -> None:
        self.what = what
        self.run = run
        self.lanes = lanes
        self.most = most
        self.linger = linger
        self._pending: list[_Call[I, R]] = []
        self._active = 0
        self._running: set[asyncio.Task[None]] = set()
        self._lingering: asyncio.TimerHandle | None = None

    async def call(self, item: I) -> R:
        loop = asyncio.get_running_loop()
        waiting: _Call[I, R] = _Call(item, loop.create_future())
        self._pending.append(waiting)
        if not self.linger:
            self._dispatch()
        elif self._lingering is None:
            self._lingering = loop.call_later(self.linger, self._linger_over)
        return await waiting.future

    async def flush(self) -> None:
        """Serve the waiting items now and wait until every call ended."""
        if self._lingering is not None:
            self._lingering.cancel()
            self._lingering = None
        self._dispatch()
        while self._running:
            await asyncio.wait(set(self._running))

    def _linger_over(self) -> None:
        self._lingering = None
        self._dispatch()

    def _dispatch(self) -> None:
        while self._pending and self._active < self.lanes:
            batch, self._pending = self._pending[:self.most], self._pending[self.most:]
            self._active += 1
            t = asyncio.create_task(self._serve(batch))
            self._running.add(t)
            t.add_done_callback(self._running.discard)

    async def _serve(self, batch: list[_Call[I, R]]) -> None:
        try:
            try:
                await self._attempt(batch)
            except Exception as exc:
                if len(batch) == 1:
                    raise
                _log.warning(f"{self.what}:{kind_of(exc)}", "%s for %d jobs together failed "
                             "(%s); trying each alone", self.what, len(batch), exc)
                for c in batch:
                    try:
                        await self._attempt([c])
                    except Exception as one:
                        if not c.future.done():
                            c.future.set_exception(one)
        except Exception as exc:
            for c in batch:
                if not c.future.done():
                    c.future.set_exception(exc)
        finally:
            self._active -= 1
            self._dispatch()

    async def _attempt(self, batch: list[_Call[I, R]]) -> None:
        results = await self.run([c.item for c in batch])
        for c, result in zip(batch, results, strict=True):
            if not c.future.done():
                c.future.set_result(result)
