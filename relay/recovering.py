"""The relay's recovery step: leases that ran out go back to ``SCHEDULED``
(core/leases/recovery.py), and processes found dead by their liveness lock
(core/processes/liveness.py) have their jobs taken over at once, the messages a dead
worker had received handed on by each broker the relay publishes to."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from duebox.brokers.routed import hand_on
from duebox.db import db_errors
from duebox.leases import recovery
from duebox.processes.takeover import Takeover

if TYPE_CHECKING:
    from duebox.app import Duebox
    from duebox.brokers.base import Broker

log = logging.getLogger("duebox.relay")


class LeaseRecovery:
    def __init__(self, app: Duebox, brokers: Sequence[Broker], batch_size: int, name: str,
                 interval: float) -> None:
        self.app = app
        self.brokers = brokers
        self.batch_size = batch_size
        self.interval = interval
        self._last = -math.inf
        # Dead relays' and workers' jobs, taken over at once (core/processes/takeover.py).
        self.name = name
        self.takeover = Takeover(app.engine, app.clock, batch_size, name)

    def wait(self) -> float:
        """Seconds until the next recovery: every ``interval``, and as soon
        as a process suspected dead can be confirmed so."""
        wait = self.interval - (time.monotonic() - self._last)
        confirm = self.takeover.watch.next_look()
        return wait if confirm is None else min(wait, confirm)

    async def step(self, working_since: datetime | None = None) -> list[recovery.Recovered]:
        """Recover expired leases, then take over dead processes' jobs.
        ``working_since``: when the oldest pass of this relay's pipelines still
        going began; the claims they took since then are theirs to settle,
        however slow their broker (recovery.claimed_since)."""
        self._last = time.monotonic()
        return [await asyncio.to_thread(self._expired, working_since), await self._take_over()]

    def _expired(self, working_since: datetime | None) -> recovery.Recovered:
        s = self.app.settings
        spare = (recovery.claimed_since(self.name, working_since)
                 if working_since is not None else None)
        with db_errors("recover"), self.app.engine.begin() as conn:
            rec = recovery.recover(
                conn, now=self.app.clock.now(), margin=s.clock_skew_margin,
                redeliver_after=s.redeliver_after, limit=self.batch_size, spare=spare,
            )
        if rec.total:
            log.info("recovered expired leases: %s", rec)
        return rec

    async def _take_over(self) -> recovery.Recovered:
        """Processes found dead by their liveness lock: their leased jobs back
        to SCHEDULED now (the relay wakes its pipelines to claim them), the
        messages a dead worker had received handed on by the brokers, then
        its registry row dropped."""
        counts = [0, 0, 0]
        for dead in await asyncio.to_thread(self.takeover.find):
            got = await asyncio.to_thread(self.takeover.recover, dead)
            handed = 0
            if dead.role == "worker":
                handed = await hand_on(self.brokers, dead.name, dead.info)
            await asyncio.to_thread(self.takeover.forget, dead)
            counts = [counts[0] + got.dispatching, counts[1] + got.running, counts[2] + got.dead]
            log.warning("%s %s is gone (its database session ended): %d of its jobs recovered "
                        "now, %d received messages handed on", dead.role, dead.name,
                        got.total, handed)
        return recovery.Recovered(*counts)


__all__ = ["LeaseRecovery"]
