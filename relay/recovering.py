"""The relay's recovery step: leases that ran out go back to ``SCHEDULED``
(core/recovery.py), and processes found dead by their liveness lock
(core/liveness.py) have their jobs taken over at once, the messages a dead
worker had received handed on by the broker."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

from duebox import recovery
from duebox.db import db_errors
from duebox.takeover import Takeover

if TYPE_CHECKING:
    from duebox.app import Duebox
    from duebox.brokers.base import Broker

log = logging.getLogger("duebox.relay")


class LeaseRecovery:
    def __init__(self, app: Duebox, broker: Broker, batch_size: int, name: str,
                 interval: float) -> None:
        self.app = app
        self.broker = broker
        self.batch_size = batch_size
        self.interval = interval
        self._last = -math.inf
        # Dead relays' and workers' jobs, taken over at once (core/takeover.py).
        self.takeover = Takeover(app.engine, app.clock, batch_size, name)

    def wait(self) -> float:
        """Seconds until the next recovery: every ``interval``, and as soon
        as a process suspected dead can be confirmed so."""
        wait = self.interval - (time.monotonic() - self._last)
        confirm = self.takeover.watch.next_look()
        return wait if confirm is None else min(wait, confirm)

    async def step(self) -> list[recovery.Recovered]:
        """Recover expired leases, then take over dead processes' jobs."""
        self._last = time.monotonic()
        return [await asyncio.to_thread(self._expired), await self._take_over()]

    def _expired(self) -> recovery.Recovered:
        s = self.app.settings
        with db_errors("recover"), self.app.engine.begin() as conn:
            rec = recovery.recover(
                conn, now=self.app.clock.now(), margin=s.clock_skew_margin,
                redeliver_after=s.redeliver_after, limit=self.batch_size,
            )
        if rec.total:
            log.info("recovered expired leases: %s", rec)
        return rec

    async def _take_over(self) -> recovery.Recovered:
        """Processes found dead by their liveness lock: their leased jobs back
        to SCHEDULED now (claimed again in this very pass), the messages a
        dead worker had received handed on by the broker, then its registry
        row dropped."""
        counts = [0, 0, 0]
        for dead in await asyncio.to_thread(self.takeover.find):
            got = await asyncio.to_thread(self.takeover.recover, dead)
            handed = 0
            if dead.role == "worker":
                handed = await self.broker.take_over(dead.name, dead.info)
            await asyncio.to_thread(self.takeover.forget, dead)
            counts = [counts[0] + got.dispatching, counts[1] + got.running, counts[2] + got.dead]
            log.warning("%s %s is gone (its database session ended): %d of its jobs recovered "
                        "now, %d received messages handed on", dead.role, dead.name,
                        got.total, handed)
        return recovery.Recovered(*counts)


__all__ = ["LeaseRecovery"]
