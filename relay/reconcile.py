"""Reconciliation: jobs the database says are ``ENQUEUED`` but the broker no
longer holds (Redis restarted empty) go back to ``SCHEDULED``, fenced by
version and publish time, and the relay publishes them again in the same
pass.  At once when the broker reports it may have lost data, else on a
slow sweep; a sweep walks every ``ENQUEUED`` job in bounded pages, a few per
pass.  Brokers that cannot tell what they hold (``missing`` returns None)
are never asked again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from duebox.db import db_errors
from duebox.leases import recovery
from duebox.observability.logs import CollapsedLog

if TYPE_CHECKING:
    from duebox.app import Duebox
    from duebox.brokers.base import Broker

log = logging.getLogger("duebox.relay")
# One for the process: a relay with many pipelines meets each broker's state
# as new when it starts (1,000 routes: 1,000 lines), and says so once, counted.
_routine = CollapsedLog(log)

# Reconciliation pages (of ``batch_size`` jobs) per pass while a sweep runs.
_SWEEP_PAGES_PER_PASS = 4


class Reconciler:
    def __init__(self, app: Duebox, broker: Broker, batch_size: int, interval: float,
                 covers: Callable[[str], bool]) -> None:
        self.app = app
        # A pipeline asks its broker about its route's queues only: another
        # broker's jobs are not missing from this one.
        self.covers = covers
        self.broker = broker
        self.batch_size = batch_size
        self.interval = interval
        self.active = True  # False once the broker said it cannot tell
        self.sweeping = False
        self._last = -float("inf")
        self._sweep: tuple[datetime, uuid.UUID] | None = None

    async def step(self) -> int:
        """One pass's share of reconciliation: the number of jobs requeued."""
        _routine.flush()
        if not self.active:
            return 0
        if not self.sweeping:
            lost = await self.broker.data_lost()
            if not lost and time.monotonic() - self._last < self.interval:
                return 0
            if lost:
                # INFO: on a broker's first use this is routine; the sweep
                # warns if it finds messages actually missing.
                _routine.info("new state", "the broker's state is new to this relay (its "
                              "first use, or it restarted empty): checking that every "
                              "enqueued job is still there")
            self._last = time.monotonic()
            self.sweeping, self._sweep = True, None
        requeued = 0
        for _ in range(_SWEEP_PAGES_PER_PASS):
            page = await asyncio.to_thread(self._page, self._sweep)
            refs = [r for r in page if self.covers(r.queue)]
            missing = await self.broker.missing(refs) if refs or not page else []
            if missing is None:
                self.active = self.sweeping = False
                return 0
            if missing:
                gone = set(missing)
                requeued += await asyncio.to_thread(
                    self._requeue, [r for r in refs if r.id in gone])
            if len(page) < self.batch_size:
                self.sweeping = False
                break
            self._sweep = (page[-1].due_at, page[-1].id)
        if requeued:
            log.warning("%d enqueued jobs were missing from the broker; publishing them again",
                        requeued)
        return requeued

    def _page(self, after: tuple[datetime, uuid.UUID] | None) -> list[recovery.EnqueuedRef]:
        with db_errors("reconcile"), self.app.engine.connect() as conn:
            return recovery.enqueued_page(conn, after=after, limit=self.batch_size)

    def _requeue(self, refs: list[recovery.EnqueuedRef]) -> int:
        with db_errors("reconcile"), self.app.engine.begin() as conn:
            return recovery.requeue_lost(conn, refs=refs, now=self.app.clock.now())


__all__ = ["Reconciler"]
