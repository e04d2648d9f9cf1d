"""The relay's re-routing step (core/reroute.py): jobs handed to a broker
that no longer serves their queue go back to ``SCHEDULED`` with a new
version, and the route that serves the queue now publishes them.

Routes change only with a process's configuration, so the step sweeps when
the relay starts, until nothing is left, and then once a minute for jobs
that a relay still on the old configuration handed over meanwhile (a
rolling deploy).  Each pass moves a bounded number of jobs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

from duebox import reroute
from duebox.db import db_errors
from duebox.processes import heartbeat

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.relay")

# Seconds between sweeps once a sweep found nothing left.
SWEEP_INTERVAL = 60.0


class Rerouting:
    def __init__(self, app: Duebox, batch_size: int, interval: float = SWEEP_INTERVAL, *,
                 active: bool = True) -> None:
        self.app = app
        self.active = active  # False: a relay given its broker, not following the routes
        self.batch_size = batch_size
        self.interval = interval
        self._last = -math.inf
        # A sweep that moved a full batch: go on next pass, not in a minute.
        self.pending = False

    async def step(self) -> int:
        """This pass's share: the number of jobs moved to their queue's route."""
        if not self.active or (not self.pending
                               and time.monotonic() - self._last < self.interval):
            return 0
        self._last = time.monotonic()
        moved = await asyncio.to_thread(self._sweep)
        self.pending = moved >= self.batch_size
        if moved:
            log.warning("%d enqueued jobs were on a broker that no longer serves their queue; "
                        "they go to the queue's route now (the old copies are stale)", moved)
        return moved

    @property
    def fingerprint(self) -> str:
        """This relay's routes, for its registry row: a peer on other
        settings leaves the jobs where they are while this one is alive."""
        return reroute.fingerprint(self.app.routes)

    def _sweep(self) -> int:
        own = self.fingerprint
        with db_errors("reroute"), self.app.engine.begin() as conn:
            now = self.app.clock.now()
            # A relay on other routes (the old settings, mid-deploy) would
            # move the jobs back each minute: wait until it is gone.
            others = sorted(p.name for p in heartbeat.alive(conn, now)
                            if p.role == "relay" and p.info.get("routing") not in (None, own))
            if others:
                log.warning("not moving jobs between routes while relay(s) on other routes "
                            "are alive: %s (stop the relays on the old settings)",
                            ", ".join(others[:5]))
                return 0
            return reroute.reroute(conn, routes=self.app.routes, now=now,
                                   limit=self.batch_size)


__all__ = ["Rerouting"]
