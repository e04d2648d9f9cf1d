"""``redis://`` on a Redis Cluster of the session's own (3 primaries, 3
replicas: tests/services/redis_cluster.py), beyond the contract suite
(tests/contract/test_redis.py runs every clause on it, clause 9 killing the
queue's primary) and the crash scenario (tests/test_recovery.py):

* a worker on queues in three slots (one read per queue: ``XREADGROUP``
  cannot span slots) runs each queue's jobs;
* a failover whose new primary lacks what its predecessor had acknowledged
  (Redis replicates asynchronously): the relay that watched the shards sees
  the new primary, reconciles at once and publishes the job again from the
  outbox; it runs once, never early.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from backends import Keys
from helpers import (
    Running,
    check_no_early_start,
    effect_rows,
    effect_values,
    effects,
    job_row,
    make_app,
    schedule_committed,
)

import duebox

pytestmark = [pytest.mark.postgres, pytest.mark.backend_redis]

QUEUES = ["mail", "sms", "push"]


@pytest.fixture
def app(pg_server_url: str, redis_cluster_keys: Keys) -> Iterator[duebox.Duebox]:
    from conftest import reset_tables

    reset_tables(pg_server_url)
    a = make_app(pg_server_url, redis_cluster_keys.url(claim_idle=5))
    yield a
    a.dispose()


def slots(cluster: Any, keys: Keys, queues: list[str]) -> set[int]:
    node = cluster.live()[0]
    return {int(node.cli("cluster", "keyslot", keys.k("ready", q))) for q in queues}


async def test_a_worker_on_queues_in_several_slots_runs_each_queues_jobs(
        app: duebox.Duebox, redis_cluster_nodes: Any, redis_cluster_keys: Keys) -> None:
    assert len(slots(redis_cluster_nodes, redis_cluster_keys, QUEUES)) == len(QUEUES)
    for q in QUEUES:
        @app.task(f"effect_{q}", queue=q)
        def effect(payload: Any, ctx: duebox.JobContext) -> None:
            app.calls.log.append((str(ctx.job_id), ctx.lease_generation))  # type: ignore[attr-defined]
            ctx.session.execute(effects.insert().values(effect_values(ctx)))

    ids = [schedule_committed(app, f"effect_{q}", delay=d) for q in QUEUES for d in (0.0, 0.3)]
    async with Running(app, relays=1, workers=1, worker_kw={"queues": QUEUES}) as r:
        await r.wait(lambda: len(effect_rows(app.engine)) == len(ids), timeout=30,
                     what="every queue's jobs to run")
    assert sorted(effect_rows(app.engine)) == sorted(str(j) for j in ids)
    assert all(app.calls.count(j) == 1 for j in ids)  # type: ignore[attr-defined]
    check_no_early_start(app.engine)


async def test_a_write_the_failover_lost_is_published_again_from_the_outbox(
        app: duebox.Duebox, redis_cluster_nodes: Any, redis_cluster_keys: Keys) -> None:
    cluster, keys = redis_cluster_nodes, redis_cluster_keys
    job_id = schedule_committed(app, delay=2.0)
    # A periodic sweep would find the loss too; an hour makes the test prove
    # the prompt path (the relay watching the shards).
    async with Running(app, relays=1, workers=0,
                       relay_kw={"reconcile_interval": 3600}) as r:
        await r.wait(lambda: keys.held(job_id) is not None
                     and job_row(app.engine, job_id).state == "ENQUEUED"
                     and r.relays[0].totals.passes >= 3, timeout=20,
                     what="the job parked in Redis and marked ENQUEUED")
        before = r.relays[0].totals.reconciled
        # What the dead primary acknowledged and never replicated: the
        # parked job is not on the replica that takes over.
        for part in ("due", "msg", "held"):
            keys.client.execute_command("ZREM" if part == "due" else "HDEL", keys.k(part),
                                        str(job_id))
        ready = keys.k("ready")
        primary = cluster.primary_of(ready)
        cluster.kill(primary)
        try:
            await asyncio.to_thread(cluster.wait_failover, primary, ready)
            await r.wait(lambda: keys.held(job_id) is not None, timeout=30,
                         what="the relay to publish the lost job again")
        finally:
            await asyncio.to_thread(cluster.restart, primary)
        assert r.relays[0].totals.reconciled > before
    async with Running(app, relays=1, workers=1) as r:
        await r.wait(lambda: job_row(app.engine, job_id).state == "SUCCEEDED", timeout=30,
                     what="the republished job to run")
    assert app.calls.count(job_id) == 1  # type: ignore[attr-defined]
    check_no_early_start(app.engine)
