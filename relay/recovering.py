"""The relay's recovery step: leases that ran out go back to ``SCHEDULED``
(core/leases/recovery.py), and processes found dead by their liveness lock
(core/processes/liveness.py) have their jobs taken over at once, the messages a dead
worker had received handed on by each broker the relay publishes to.

A broker that cannot hand them on when the death is found (down, or its
shard failing over: a Redis Cluster's failover can outlast redis-py's own
retries) is asked again on later passes, until it answers or for at most
:data:`_HAND_ON_FOR`.  Those messages' jobs were never started (a batch
the worker had in hand, its prefetch): no lease brings them back, and left
to the broker's own redelivery they waited Redis's ``claim_idle`` and its
reclaim period — about 41 s instead of the failover plus a second
(bench/recovery.py on a Redis Cluster, issue #35).  This relay remembers
them, in memory: the dead worker's registry row expires and is pruned,
and a relay that restarts meanwhile leaves them to that redelivery.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from duebox.brokers.routed import hand_on
from duebox.db import db_errors
from duebox.leases import recovery
from duebox.processes.takeover import Takeover

if TYPE_CHECKING:
    from duebox.app import Duebox
    from duebox.brokers.base import Broker

log = logging.getLogger("duebox.relay")

# A hand-on that failed is tried again this long after, the wait doubling
# up to _RETRY_MOST: a job then starts at most that long after its broker
# is back (a Redis take_over also waits out a few seconds of failover in
# redis-py's retries), and a broker that hangs holds up the relay's own
# steps (each try bounded by brokers/routed.py's _TAKE_OVER_SECONDS) only
# part of the time.
_RETRY_FIRST = 1.0
_RETRY_MOST = 4.0
# Tried again for this long after the first try, then left to the broker's
# own redelivery (Redis's claim_idle, SQS's visibility timeout, Kafka's
# session timeout have long come by then).
_HAND_ON_FOR = 120.0


@dataclass(frozen=True)
class _Retry:
    """A dead worker whose messages some brokers still have to hand on."""

    brokers: tuple[Broker, ...]
    info: dict[str, Any]  # its registry row's (queues, ...), for Broker.take_over
    at: float  # monotonic time of the next try
    wait: float  # seconds from this try to the next, should it fail too
    until: float  # monotonic time after which no more tries


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
        # Dead workers' messages a broker could not hand on yet: name -> retry.
        self._retries: dict[str, _Retry] = {}

    def wait(self) -> float:
        """Seconds until the next recovery: every ``interval``, and as soon
        as a process suspected dead can be confirmed so, or a hand-on that
        failed is to be tried again."""
        now = time.monotonic()
        waits = [self.interval - (now - self._last),
                 *(retry.at - now for retry in self._retries.values())]
        confirm = self.takeover.watch.next_look()
        return min(waits) if confirm is None else min(*waits, confirm)

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
        its registry row dropped.  A broker that failed to hand them on is
        asked again on later passes (:meth:`_hand_on_again`): the row, which
        expires and is pruned, is no place to remember that."""
        await self._hand_on_again()
        counts = [0, 0, 0]
        for dead in await asyncio.to_thread(self.takeover.find):
            got = await asyncio.to_thread(self.takeover.recover, dead)
            handed, later = 0, ""
            if dead.role == "worker":
                result = await hand_on(self.brokers, dead.name, dead.info)
                handed = result.handed
                if result.failed:
                    now = time.monotonic()
                    self._retries[dead.name] = _Retry(result.failed, dict(dead.info),
                                                      now + _RETRY_FIRST, _RETRY_FIRST,
                                                      now + _HAND_ON_FOR)
                    later = (f", the rest once the broker answers (asked again in "
                             f"{_RETRY_FIRST:.0f} s)")
            await asyncio.to_thread(self.takeover.forget, dead)
            counts = [counts[0] + got.dispatching, counts[1] + got.running, counts[2] + got.dead]
            log.warning("%s %s is gone (its database session ended): %d of its jobs recovered "
                        "now, %d received messages handed on%s", dead.role, dead.name,
                        got.total, handed, later)
        return recovery.Recovered(*counts)

    async def _hand_on_again(self) -> None:
        """Ask the brokers that could not hand on a dead worker's messages
        again, those whose time has come; after :data:`_HAND_ON_FOR`, leave
        them to the broker's own redelivery."""
        for name, retry in list(self._retries.items()):
            if time.monotonic() < retry.at:
                continue
            # Quiet: the first failure was said, and the end is.
            result = await hand_on(retry.brokers, name, retry.info, quiet=True)
            now = time.monotonic()
            if not result.failed:
                del self._retries[name]
                log.warning("worker %s's received messages handed on after all: %d", name,
                            result.handed)
            elif now >= retry.until:
                del self._retries[name]
                log.warning("worker %s's received messages could not be handed on for %.0f s: "
                            "left to the broker's own redelivery", name, _HAND_ON_FOR)
            else:
                wait = min(retry.wait * 2, _RETRY_MOST)
                self._retries[name] = _Retry(result.failed, retry.info, now + wait, wait,
                                             retry.until)


__all__ = ["LeaseRecovery"]
