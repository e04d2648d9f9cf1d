"""One RabbitMQ cluster failover, for tests/test_amqp_cluster.py and
bench/amqp_failover.py: a relay and a worker on the cluster, jobs published
into it, then ``kill -9`` of the node holding the queue leaders while every
job waits in it.

:func:`failover` runs it and returns what happened; the caller asserts
(the test) or reports (the bench).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from helpers import Running, all_final, effect_rows, schedule_committed, states
from services.rabbit_cluster import Cluster

import duebox
from duebox.clock import utcnow


def leader_node(cluster: Cluster) -> str:
    """The node most of duebox's queue leaders are on (all of them, when
    the relay declared them: RabbitMQ places a new quorum queue's leader on
    the declaring client's node)."""
    leaders = [n for q, n in cluster.leaders("/").items() if q.startswith("duebox.")]
    assert leaders, "duebox declared no queue on the cluster"
    return max(set(leaders), key=leaders.count)


@dataclass
class Failover:
    victim: str
    start: datetime
    killed_at: datetime
    first: uuid.UUID  # the job sent through before the batch
    ids: list[uuid.UUID]  # the batch
    done_after: float  # seconds from the kill to the last job's end

    def lateness(self, app: duebox.Duebox) -> list[tuple[str, list[float]]]:
        """The batch's lateness in ms: all of it, and the jobs due first
        (in the batch's first 5 s of due times: the nearest to the kill)."""
        rows = [e for e in effect_rows(app.engine).values() if e.job_id != str(self.first)]
        soon = min((e.due_us for e in rows), default=0) + 5_000_000
        return [("all", sorted((e.started_us - e.due_us) / 1000 for e in rows)),
                ("the first 5 s of due times",
                 sorted((e.started_us - e.due_us) / 1000 for e in rows if e.due_us < soon))]


def describe(ms: list[float]) -> str:
    if not ms:
        return "no jobs"
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return f"p50 {q[49]:.0f} ms, p99 {q[98]:.0f} ms, max {ms[-1]:.0f} ms ({len(ms)} jobs)"


async def failover(app: duebox.Duebox, cluster: Cluster, *, jobs: int, first_due: float,
                   spread: float, wait: float, **running: Any) -> Failover:
    """``jobs`` jobs due from ``first_due`` to ``first_due + spread`` seconds
    ahead; the kill as soon as all are ``ENQUEUED``; then up to ``wait``
    seconds for all to finish."""
    # near_window=0: every job goes into the broker's delays at once (not
    # held by the relay for its last 15 s), so all of them wait in the cluster.
    async with Running(app, relays=1, workers=1, concurrency=8,
                       relay_kw={"near_window": 0}, **running) as r:
        # One job through first: the relay and the worker have declared the
        # topology, so every queue leader is where it will be at the kill.
        first = schedule_committed(app)
        await r.wait(lambda: all_final(app.engine, [first]), timeout=60,
                     what="a first job through the cluster")
        victim = cluster.node(await asyncio.to_thread(leader_node, cluster))
        start = utcnow()
        ids = [schedule_committed(app, at=start + timedelta(
            seconds=first_due + spread * i / jobs)) for i in range(jobs)]
        await r.wait(lambda: states(app.engine).get("ENQUEUED", 0) == jobs, timeout=30,
                     what="every job published into the cluster")
        killed_at = utcnow()
        await asyncio.to_thread(cluster.kill, victim)
        t0 = time.monotonic()
        await r.wait(lambda: all_final(app.engine, ids), timeout=wait,
                     what=f"every job run after the node died (redeliver_after is "
                          f"{app.settings.redeliver_after:g} s)")
        return Failover(victim.name, start, killed_at, first, ids, time.monotonic() - t0)
