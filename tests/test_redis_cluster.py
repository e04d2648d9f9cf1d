"""``redis://`` on a Redis Cluster of the session's own (3 primaries, 3
replicas: tests/services/redis_cluster.py), beyond the contract suite
(tests/contract/test_redis.py runs every clause on it, clause 9 killing the
queue's primary) and the crash scenario (tests/test_recovery.py):

* a worker on queues in three slots (one read per queue: ``XREADGROUP``
  cannot span slots) runs each queue's jobs;
* a failover whose new primary lacks what its predecessor had acknowledged
  (Redis replicates asynchronously): the relay that watched the shards sees
  the new primary, reconciles at once and publishes the job again from the
  outbox; it runs once, never early;
* a worker killed with its shard's primary: the relay, which cannot hand on
  the messages the worker had read while the shard fails over, asks again
  until the new primary answers; the job runs within seconds of the
  failover, not after ``claim_idle`` (issue #35);
* a worker's defer (a hold, a hand-back, a busy row) that meets the
  failover is tried again: the message is parked once the replica serves,
  not left pending until ``claim_idle``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
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
    wait_for,
)

import duebox
from duebox.tables import lease

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


# Holds ``NAME``'s liveness lock on DATABASE_URL until killed: the process
# whose death the relay finds (core/processes/liveness.py).
HOLDER = """
import sys, time
from sqlalchemy import create_engine
from duebox.processes.liveness import SessionLock
lock = SessionLock(create_engine(sys.argv[1]), sys.argv[2])
print("held" if lock.acquire() else "not held", flush=True)
time.sleep(600)
"""


def hold_lock(database_url: str, name: str) -> subprocess.Popen[bytes]:
    """A process holding ``name``'s liveness lock (once this returns)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, database_url, name],
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    said = proc.stdout.readline().strip()
    proc.stdout.close()
    if said != b"held":
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"the lock holder said {said!r}")
    return proc


async def test_a_dead_workers_messages_are_handed_on_once_a_slow_failover_ends(
        pg_server_url: str, redis_cluster_nodes: Any, redis_cluster_keys: Keys,
        caplog: pytest.LogCaptureFixture) -> None:
    """The worker dies with the primary of its queue's shard, holding a
    message it read and never started (no lease brings that job back).  The
    relay's first hand-on meets the failing shard and fails; the failover
    ends only then (the replica is kept from taking over until the test
    says so).  The relay asks again, and the job runs within seconds —
    before the fix it waited for ``claim_idle`` (600 s here, 30 s by
    default)."""
    from conftest import reset_tables

    cluster, keys = redis_cluster_nodes, redis_cluster_keys
    reset_tables(pg_server_url)
    app = make_app(pg_server_url, keys.url(claim_idle=600))
    ready, group, dead = keys.k("ready"), "duebox", "dead-w"
    holder = None
    primary = cluster.primary_of(ready)
    replica = cluster.replica_of(primary)
    try:
        job_id = schedule_committed(app)
        async with Running(app, relays=1, workers=0) as r:
            await r.wait(lambda: job_row(app.engine, job_id).state == "ENQUEUED"
                         and keys.stream_len() == 1, timeout=20,
                         what="the job published onto the stream")
            # The dead worker: it read the message (as its XREADGROUP does)
            # and held its liveness lock, registered as a worker does.
            with contextlib.suppress(Exception):  # BUSYGROUP: made already
                keys.client.xgroup_create(ready, group, id="0", mkstream=True)
            assert keys.client.xreadgroup(group, dead, {ready: ">"}, count=10)
            assert keys.pending() == 1
            holder = await asyncio.to_thread(hold_lock, pg_server_url, dead)
            with app.engine.begin() as conn:
                conn.execute(lease.insert().values(
                    name=f"worker:{dead}", owner=f"worker:{dead}", epoch=0,
                    info={"name": dead, "liveness": True, "queues": ["default"]},
                    expires_at=app.clock.now()))
            replica.cli("config", "set", "cluster-replica-no-failover", "yes")
            with caplog.at_level(logging.WARNING, logger="duebox.broker"):
                cluster.kill(primary)
                holder.kill()
                holder.wait(10)
                await r.wait(lambda: any("could not hand on worker dead-w" in m
                                         for m in caplog.messages), timeout=30,
                             what="the relay's hand-on to fail on the failing shard")
            assert replica.cli("cluster", "failover", "takeover").strip() == "OK"
            await asyncio.to_thread(cluster.wait_failover, primary, ready)
            async with Running(app, relays=0, workers=1) as w:
                await w.wait(lambda: job_row(app.engine, job_id).state == "SUCCEEDED",
                             timeout=25, what="the dead worker's message to run its job")
        assert app.calls.count(job_id) == 1  # type: ignore[attr-defined]
        check_no_early_start(app.engine)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(10)
        replica.cli("config", "set", "cluster-replica-no-failover", "no")
        if not primary.alive():
            await asyncio.to_thread(cluster.restart, primary)
        app.dispose()


async def test_a_defer_that_meets_a_failover_is_done_once_the_replica_serves(
        redis_cluster_nodes: Any, redis_cluster_keys: Keys) -> None:
    """A worker parks a message again just as its queue's primary dies, and
    the failover outlasts redis-py's retries (the replica is kept from
    taking over until the defer has failed): the defer is tried again and
    the message is parked once the replica serves — before the fix it
    stayed pending until ``claim_idle`` (600 s here, 30 s by default)."""
    from duebox.brokers.base import BrokerContext, Outgoing
    from duebox.brokers.redis import RedisBroker
    from duebox.message import JobMessage

    cluster, keys = redis_cluster_nodes, redis_cluster_keys
    app = make_app("sqlite://")
    broker = RedisBroker(keys.url(claim_idle=600),
                         BrokerContext(app.engine, app.clock, app.settings, "w"))
    ready = keys.k("ready")
    primary = cluster.primary_of(ready)
    replica = cluster.replica_of(primary)
    try:
        msg = JobMessage(uuid.uuid4(), "effect", "default", 1, 0, datetime.now(UTC))
        await broker.publish([Outgoing(msg, 0.0)])
        deliveries = broker.consume(["default"], 10)
        delivery = await anext(deliveries)
        await deliveries.aclose()
        assert keys.pending() == 1
        replica.cli("config", "set", "cluster-replica-no-failover", "yes")
        cluster.kill(primary)
        assert await broker.defer(delivery, 0.0)  # failed: the shard is down
        assert replica.cli("cluster", "failover", "takeover").strip() == "OK"
        await asyncio.to_thread(cluster.wait_failover, primary, ready)
        await wait_for(lambda: keys.score(msg.job_id) is not None and keys.pending() == 0,
                       timeout=15, what="the defer to be done on the new primary")
    finally:
        await broker.close()
        replica.cli("config", "set", "cluster-replica-no-failover", "no")
        if not primary.alive():
            await asyncio.to_thread(cluster.restart, primary)
        app.dispose()
