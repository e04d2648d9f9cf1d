"""A pipeline's at-scale controls in one place (docs/scale.md): the fair,
rate-limited claim, the fence of its route and of the relay's shards, and
backpressure.

Each is off, or idle, unless configured; a pipeline asks this object at a
few fixed points (claim, publish, mark, sleep, metrics) and nowhere else.
The relay resolves the dispatch policy and holds the shard leases
(relay/shards.py) for all its pipelines.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import ColumnElement, and_

from duebox.fairness.claim import FairPicker
from duebox.fairness.policy import DispatchPolicy
from duebox.leases import jobstore
from duebox.metrics import Metrics
from duebox.processes.heartbeat import ProcessRow

from .backpressure import Backpressure
from .shards import ShardOwner

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.relay")


class ScaleControls:
    def __init__(self, app: Duebox, policy: DispatchPolicy | None, shards: ShardOwner | None,
                 route: ColumnElement[bool] | None = None) -> None:
        self.app = app
        # A pipeline's route (relay/pipeline.py): every claim and mark
        # carries its queue condition, as it carries the shard fence.
        self.route = route
        self.policy = policy or DispatchPolicy.configured(app.settings)
        self.fair = FairPicker(self.policy) if self.policy.enabled else None
        self.shards = shards
        self.backpressure = Backpressure()
        self._throttled: dict[str, int] = {}

    # --- claim -----------------------------------------------------------------------

    def fence(self, now: datetime) -> ColumnElement[bool] | None:
        """The shard fence and route condition every claim and mark carries
        (None: neither sharded nor one route among several)."""
        shard = self.shards.fence(now) if self.shards is not None else None
        if self.route is None or shard is None:
            return shard if self.route is None else self.route
        return and_(shard, self.route)

    def reach(self, reach: float | None, hold_window: float) -> float | None:
        """How far ahead of due time (seconds; None: unbounded) the relay
        claims, given the broker's ``reach``.  Rate-limited: within a poll
        interval only, so a burst reaches the broker (native delay or not)
        at the limited rate instead of pre-staged in full."""
        if self.fair is None or not self.policy.limited:
            return reach
        soon = self.app.settings.poll_interval + hold_window
        return soon if reach is None else min(reach, soon)

    def wait(self) -> float:
        """Seconds due jobs must wait anyway: for tokens, or for the broker."""
        rate = self.fair.last.wait if self.fair is not None else 0.0
        return max(rate, self.backpressure.pause(self.app.settings.poll_interval))

    # --- shards ----------------------------------------------------------------------

    def still_owned(self, records: list[jobstore.JobRecord]
                    ) -> tuple[list[jobstore.JobRecord], int]:
        """Just before publishing: only jobs of shards this relay still holds
        by the database (a relay resumed after a pause must not publish)."""
        if self.shards is None:
            return records, 0
        valid = self.shards.verify(self.app.engine, self.app.clock.now())
        kept = [r for r in records if self.shards.shard_of_job(r.id) in valid]
        dropped = len(records) - len(kept)
        if dropped:
            log.warning("dropped %d claimed jobs before publishing: their shard lease was "
                        "lost (this relay paused or fell behind); their new owner publishes "
                        "them", dropped)
        return kept, dropped

    def observe_workers(self, processes: Iterable[ProcessRow], interval: float) -> None:
        """Workers report how many of their handlers failed as throttled (a
        downstream API's 429) in their registry rows; a count that rose
        since the last snapshot (every ``interval`` seconds) slows dispatch
        as a broker's overload does, held until the next snapshot."""
        rose = False
        for p in processes:
            if p.role != "worker":
                continue
            count = p.info.get("throttled")
            if not isinstance(count, int):
                continue
            last = self._throttled.get(p.name)
            rose = rose or (last is not None and count > last)
            self._throttled[p.name] = count
        if rose:
            self.backpressure.downstream(hold=interval)

    # --- metrics ---------------------------------------------------------------------

    def observe(self, m: Metrics) -> None:
        """Gauges for rate limiting and backpressure."""
        if self.fair is not None:
            last = self.fair.last
            for kind in ("global", "queue", "tenant"):
                m.rate_limited.labels(kind).set(
                    sum(1 for n in last.throttled if n.split(":", 1)[0] == kind))
            m.rate_wait.set(last.wait)
        m.backpressure.set(self.backpressure.factor)
