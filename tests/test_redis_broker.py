"""The ``redis://`` backend against a real Redis (never fakeredis).

Every test works under its own key prefix and deletes only its own keys, so
tests share the server safely.  "Redis lost its data" is simulated by deleting
every key under the test's prefix: for this backend that is exactly what a
``FLUSHALL`` or a restart without persistence does.  Under ``CI=true`` an
unreachable Redis fails the tests instead of skipping them.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from backends import REDIS, Keys
from helpers import (
    Running,
    attempt_rows,
    cancel_committed,
    check_no_early_start,
    effect_rows,
    effect_values,
    effects,
    job_row,
    make_app,
    memory_url,
    observer,
    schedule_committed,
    us,
)

import duebox
from duebox import MissingDependencyError
from duebox.brokers import redis_mover
from duebox.brokers.base import BrokerContext, Outgoing
from duebox.clock import SystemClock
from duebox.consumers import Worker
from duebox.errors import ConfigurationError
from duebox.leases import jobstore, recovery
from duebox.message import JobMessage
from duebox.registry import broker_class
from duebox.relay import Relay
from duebox.tables import job


@pytest.fixture
def keys(redis_keys: Keys) -> Keys:
    return redis_keys


def url(keys: Keys, **params: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"prefix": keys.prefix, **params}.items())
    return f"{REDIS}?{query}"


@pytest.fixture
def app(database_url: str, keys: Keys) -> Iterator[duebox.Duebox]:
    a = make_app(database_url, url(keys, claim_idle=5))
    yield a
    a.dispose()


async def publish_pass(app: duebox.Duebox) -> Any:
    """One relay pass: claim, publish, mark."""
    relay = Relay(app, recover_interval=0.1)
    try:
        return await relay.run_pass()
    finally:
        for pipeline in relay.pipelines:
            await pipeline.broker.close()


def ready_message(app: duebox.Duebox, job_id: uuid.UUID) -> JobMessage:
    with app.engine.connect() as conn:
        r = conn.execute(sa.select(job).where(job.c.id == job_id)).one()
    return JobMessage(job_id=r.id, task=r.task, queue=r.queue, version=r.version,
                      attempt=r.attempt, due_at=r.due_at, payload=r.payload,
                      headers=dict(r.headers or {}))


async def until(running: Running | None, predicate: Callable[[], Any], *, seconds: float,
                what: str, check: Callable[[], None] | None = None) -> Any:
    """Poll ``predicate`` (in a thread: it may query the database) until it is
    truthy; fail naming ``what`` after ``seconds``, or at once if a relay or
    worker of ``running`` died."""
    deadline = time.monotonic() + seconds
    while True:
        if running is not None:
            running.check()
        if check is not None:
            check()
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds}s waiting for {what}")
        await asyncio.sleep(0.05)


# --- configuration ------------------------------------------------------------------


def test_rediss_is_redis_over_tls() -> None:
    ctx = BrokerContext(sa.create_engine("sqlite://"), SystemClock(), duebox.Settings())
    cls = broker_class("rediss://h")
    assert cls is broker_class("redis://h")
    b = cls("rediss://h:6380/0?prefix=app", ctx)
    assert b.settings.prefix == "app"


def test_url_parameters_and_capabilities() -> None:
    ctx = BrokerContext(sa.create_engine("sqlite://"), SystemClock(), duebox.Settings())
    cls = broker_class("redis://h")
    b = cls("redis://h:6380/2?prefix=app&horizon=600&group=g&claim_idle=5&"
            "max_delay=120&socket_timeout=3", ctx)
    assert (b.settings.prefix, b.settings.group) == ("app", "g")
    assert (b.settings.horizon, b.settings.claim_idle) == (600.0, 5.0)
    assert b.capabilities.max_delay == 600.0
    assert b.max_delay == 120.0
    assert b.capabilities.cancel
    assert b.capabilities.redelivers_unacked
    assert b.capabilities.delay_precision == 0.001
    # duebox's own parameters are not handed to redis-py; the others are.
    assert b.settings.client_url == "redis://h:6380/2?socket_timeout=3"
    assert cls("redis://h", ctx).max_delay == 3600.0
    for bad, field in [("horizon=-1", "horizon"), ("horizon=soon", "horizon"),
                       ("claim_idle=0", "claim_idle"), ("prefix=", "prefix"),
                       ("prefix=a:b", "prefix"), ("group={x}", "group"),
                       ("horizon=60&max_delay=61", "max_delay")]:
        with pytest.raises(ConfigurationError, match=field):
            cls(f"redis://h?{bad}", ctx)


def test_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("redis", "redis.asyncio", "redis.exceptions"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "duebox.brokers.redis", raising=False)
    with pytest.raises(MissingDependencyError, match=r"duebox\[redis\]"):
        importlib.import_module("duebox.brokers.redis")
    monkeypatch.delitem(sys.modules, "duebox.brokers.redis", raising=False)
    with pytest.raises(MissingDependencyError):
        duebox.Duebox("sqlite://", "redis://127.0.0.1")


def test_the_installed_package_finds_every_lua_script() -> None:
    """The scripts are package data (pyproject.toml), read through
    importlib.resources from wherever duebox is installed: every one the
    backend registers is there, and none it would leave unused."""
    from importlib import resources

    from duebox.brokers import redis_scripts

    folder = resources.files("duebox.brokers") / "lua"
    shipped = {f.name for f in folder.iterdir() if f.name.endswith(".lua")}
    assert shipped == {f"redis_{name}.lua" for name in redis_scripts.NAMES}
    for name in redis_scripts.NAMES:
        assert "redis.call(" in redis_scripts.source(name), name


async def test_unreachable_redis_is_a_broker_error() -> None:
    ctx = BrokerContext(sa.create_engine("sqlite://"), SystemClock(), duebox.Settings())
    b = broker_class("redis://")("redis://127.0.0.1:1/0?socket_connect_timeout=1", ctx)
    with pytest.raises(duebox.BrokerError, match=r"127\.0\.0\.1:1"):
        await b.open()


# --- the index itself ---------------------------------------------------------------


async def test_index_bookkeeping(keys: Keys) -> None:
    """Publish parks or streams; a newer version is never replaced by an older
    one; missing() tells what Redis does not hold; cancel removes entries."""
    ctx = BrokerContext(sa.create_engine("sqlite://"), SystemClock(), duebox.Settings(), "w")
    b = broker_class("redis://")(url(keys), ctx)
    now = datetime.now(UTC)

    def msg(job_id: uuid.UUID, version: int, delay: float) -> Outgoing:
        return Outgoing(JobMessage(job_id, "t", "default", version, 0,
                                   now + timedelta(seconds=delay)), delay)

    a, c, d = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    try:
        res = await b.publish([msg(a, 2, 60), msg(c, 1, 0), msg(d, 1, 60)])
        assert all(r.ok for r in res)
        assert keys.held(a) == "2|z"
        assert keys.score(a) is not None
        assert keys.stream_len() == 1
        assert keys.held(c) == f"1|{res[1].broker_message_id}"
        # A stale publish (version 1 after 2) changes nothing.
        await b.publish([msg(a, 1, 5)])
        assert keys.held(a) == "2|z"
        # The job id is the member: a republish replaces the score in place.
        before = keys.score(a)
        await b.publish([msg(a, 3, 120)])
        assert keys.parked() == 2
        assert keys.score(a) > before

        def ref(job_id: uuid.UUID, version: int) -> recovery.EnqueuedRef:
            return recovery.EnqueuedRef(job_id, version, "default", now)

        lost = uuid.uuid4()
        assert set(await b.missing([ref(a, 3), ref(c, 1), ref(d, 1), ref(a, 4),
                                    ref(lost, 1)])) == {a, lost}
        assert await b.cancel([d, c]) == 2
        assert keys.parked() == 1
        assert keys.stream_len() == 0
        assert keys.held(d) is None
        assert keys.held(c) is None
        assert set(await b.missing([ref(c, 1), ref(d, 1)])) == {c, d}
        # The sentinel: set once; gone again after a flush.
        assert await b.data_lost() is True
        assert await b.data_lost() is False
        keys.wipe()
        assert await b.data_lost() is True
    finally:
        await b.close()


async def test_broker_delivers_at_the_due_millisecond(keys: Keys) -> None:
    """Without a database in the way: a parked message reaches a waiting
    consumer at its due time, at most the mover's lead before it (the mover
    sleeps until the earliest score less the lead and is woken by the publish
    that parks an earlier one; the worker holds the handler the rest)."""
    engine = sa.create_engine("sqlite://")
    publisher = broker_class("redis://")(url(keys), BrokerContext(
        engine, SystemClock(), duebox.Settings(), "p"))
    consumer = broker_class("redis://")(url(keys), BrokerContext(
        engine, SystemClock(), duebox.Settings(), "c"))
    start = datetime.now(UTC)
    dues = [start + timedelta(seconds=0.4 + 0.013 * i) for i in range(40)]
    random.Random(3).shuffle(dues)
    late: list[float] = []

    async def read() -> None:
        async for d in consumer.consume(["default"], 64):
            assert d.message is not None
            late.append(time.time() - d.message.due_at.timestamp())
            await consumer.ack(d)
            if len(late) == len(dues):
                return

    reader = asyncio.create_task(read())
    try:
        await asyncio.sleep(0.2)  # the consumer is waiting, its mover asleep
        for due in dues:  # one by one, so most publishes park a new earliest
            now = datetime.now(UTC)
            delay = math.ceil((due - now).total_seconds() * 1000) / 1000
            await publisher.publish([Outgoing(JobMessage(
                uuid.uuid4(), "t", "default", 1, 0, due), max(0.0, delay))])
        await asyncio.wait_for(reader, 10)
    finally:
        reader.cancel()
        await asyncio.wait({reader}, timeout=5)
        await publisher.close()
        await consumer.close()
    late.sort()
    lead = (redis_mover.MOVE_LEAD_MS + redis_mover.MOVE_GATHER_MS) / 1000
    assert late[0] >= -lead - 0.001, late  # the score is rounded up to the ms
    assert late[len(late) // 2] < 0.05, late


async def test_a_stopping_consumer_gives_back_what_it_read_and_never_started(
        keys: Keys) -> None:
    """#36 (Low): a graceful stop left the messages a consumer had read and
    not handed on pending in its group until ``claim_idle`` passed (32 s
    late in the hostile round).  Closed, its consume gives them back, and
    a release (the worker's, for one it took but will not start) too:
    another consumer reads all of them at once, with ``claim_idle`` at 120 s."""
    engine = sa.create_engine("sqlite://")

    def broker(name: str) -> Any:
        return broker_class("redis://")(url(keys, claim_idle=120), BrokerContext(
            engine, SystemClock(), duebox.Settings(), name))

    first, second = broker("first"), broker("second")
    now = datetime.now(UTC)
    ids = {uuid.uuid4() for _ in range(10)}
    try:
        await first.publish([Outgoing(JobMessage(i, "t", "default", 1, 0, now), 0.0)
                             for i in ids])
        stream = first.consume(["default"], 10)
        taken = await anext(stream)  # the rest stay read, in its buffer
        assert len(first._in_flight) == 10
        await stream.aclose()
        first.release(taken)
        await first.close()

        got: set[uuid.UUID] = set()

        async def read() -> None:
            async for d in second.consume(["default"], 10):
                assert d.message is not None
                got.add(d.message.job_id)
                await second.ack(d)
                if got == ids:
                    return

        await asyncio.wait_for(read(), 20)  # not the 120 s of claim_idle
    finally:
        await first.close()
        await second.close()
    assert got == ids


# --- end to end (delays, ordering: in the shared contract, tests/contract/) -----------


async def test_duplicate_publish_runs_once(app: duebox.Duebox, keys: Keys) -> None:
    job_id = schedule_committed(app, delay=0)
    await publish_pass(app)
    assert keys.stream_len() == 1
    extra = broker_class(app.settings.broker_url)(
        app.settings.broker_url, BrokerContext(app.engine, app.clock, app.settings))
    try:
        message = ready_message(app, job_id)
        # Already due: straight onto the stream, twice more.
        for _ in range(2):
            assert (await extra.publish([Outgoing(message, 0.0)]))[0].ok
    finally:
        await extra.close()
    assert keys.stream_len() == 3
    assert keys.parked() == 0
    async with Running(app, relays=0, workers=2, concurrency=2) as r:
        await until(r, lambda: sum(r.discarded.values()) >= 1 and effect_rows(app.engine),
                    seconds=10, what="the job to run and the duplicate to be discarded")
        await until(r, lambda: keys.stream_len() == 0 and keys.pending() == 0, seconds=10,
                    what="every entry acknowledged and deleted")
    assert len(effect_rows(app.engine)) == 1
    assert app.calls.count(job_id) == 1  # type: ignore[attr-defined]
    assert set(r.discarded) <= {"already_running", "already_succeeded"}
    assert keys.held(job_id) is None


async def test_cancel_before_delivery(app: duebox.Duebox, keys: Keys) -> None:
    gone, kept, stale = (schedule_committed(app, delay=2.0) for _ in range(3))
    await publish_pass(app)
    assert keys.parked() == 3
    assert cancel_committed(app, gone)
    assert cancel_committed(app, stale)
    broker = app.broker()
    try:
        # After the commit, broker.cancel drops the parked entry itself ...
        assert await broker.cancel([gone]) == 1
    finally:
        await broker.close()
    assert keys.score(gone) is None
    assert keys.held(gone) is None
    assert keys.parked() == 2
    # ... and without it, the stale entry is delivered and discarded.
    async with Running(app, relays=1, workers=1) as r:
        await until(r, lambda: effect_rows(app.engine) and r.discarded.get("cancelled"),
                    seconds=10, what="the kept job to run and the cancelled one discarded")
        await until(r, lambda: keys.parked() == 0 and keys.stream_len() == 0, seconds=5,
                    what="Redis to hold nothing")
    assert list(effect_rows(app.engine)) == [str(kept)]
    assert set(r.discarded) == {"cancelled"}
    for j in (gone, stale):
        assert app.calls.count(j) == 0  # type: ignore[attr-defined]
        assert job_row(app.engine, j).state == "CANCELLED"


async def test_reschedule_runs_once_at_the_new_time(app: duebox.Duebox, keys: Keys) -> None:
    parked = schedule_committed(app, delay=2.0)
    streamed = schedule_committed(app, delay=0.0)
    await publish_pass(app)
    assert keys.parked() == 1
    assert keys.stream_len() == 1
    first = keys.score(parked)
    for j in (parked, streamed):
        with app.engine.begin() as conn:
            app.reschedule(conn, j, delay=2.5)
    await publish_pass(app)
    # The parked entry was replaced in place (the member is the job id); the
    # streamed one is still there, at the old version.
    assert keys.parked() == 2
    assert keys.stream_len() == 1
    new_due = us(job_row(app.engine, parked).due_at) / 1000
    assert keys.score(parked) >= new_due > first  # type: ignore[operator]
    async with Running(app, workers=1) as r:
        await until(r, lambda: len(effect_rows(app.engine)) == 2, seconds=10,
                    what="both jobs to run")
    assert r.discarded.get("stale_version") == 1
    assert set(r.discarded) <= {"stale_version", "already_running", "already_succeeded"}
    check_no_early_start(app.engine)
    for j in (parked, streamed):
        assert app.calls.count(j) == 1  # type: ignore[attr-defined]
        assert job_row(app.engine, j).version == 2


async def test_far_jobs_stay_parked_in_the_database(database_url: str, keys: Keys) -> None:
    app = make_app(database_url, url(keys, max_delay=2, claim_idle=1))
    try:
        assert app.broker().max_delay == 2.0
        ids = [schedule_committed(app, delay=d) for d in (5, 6, 7, 8)]
        stats = await publish_pass(app)
        assert stats.published == 0
        assert keys.parked() == 0
        assert all(job_row(app.engine, j).state == "SCHEDULED" for j in ids)
        most = 0

        def watch() -> bool:
            nonlocal most
            most = max(most, keys.parked())
            return len(effect_rows(app.engine)) == len(ids)

        async with Running(app, workers=1) as r:
            await until(r, watch, seconds=15, what="every far job to run")
        check_no_early_start(app.engine)
        assert most <= 3  # only jobs within 2 s of their due time were in Redis
        for j in ids:
            row = job_row(app.engine, j)
            ahead = (row.due_at - row.published_at).total_seconds()
            assert 0 <= ahead <= 2.1, f"published {ahead:.2f}s before due"
            assert app.calls.count(j) == 1  # type: ignore[attr-defined]
    finally:
        app.dispose()


async def test_dead_consumers_entry_is_taken_over(database_url: str, keys: Keys) -> None:
    """A consumer reads an entry and vanishes without acking: after claim_idle
    another consumer takes the entry over and the job runs."""
    app = make_app(database_url, url(keys, claim_idle=1))
    job_id = schedule_committed(app, delay=0.0)
    await publish_pass(app)
    doomed = app.broker("doomed")
    stream = doomed.consume(["default"], 1)
    delivery = await asyncio.wait_for(anext(stream), 5)
    assert delivery.message is not None
    assert delivery.message.job_id == job_id
    await stream.aclose()  # gone, holding the entry
    await doomed.close()
    assert keys.pending() == 1
    async with Running(app, relays=1, workers=1) as r:
        await until(r, lambda: effect_rows(app.engine), seconds=10, what="the job to run")
        await until(r, lambda: keys.pending() == 0, seconds=5, what="the entry to be acked")
    assert r.workers[0].broker.reclaimed >= 1  # type: ignore[attr-defined]
    assert app.calls.count(job_id) == 1  # type: ignore[attr-defined]
    app.dispose()


VICTIM = textwrap.dedent("""
    import asyncio, sys, time
    import sqlalchemy as sa
    import duebox
    from duebox.consumers import Worker

    db_url, broker_url, name = sys.argv[1:4]
    app = duebox.Duebox(db_url, broker_url, settings=duebox.Settings(
        lease_seconds=3.0, clock_skew_margin=0.3, poll_interval=0.05))

    @app.task("slow")
    def slow(payload, ctx):
        ctx.session.execute(sa.text(
            "INSERT INTO effects (job_id, due_us, started_us, worker, attempt, "
            "lease_generation) VALUES (:j, 0, 0, :w, :a, :g)"),
            {"j": str(ctx.job_id), "w": ctx.worker, "a": ctx.attempt,
             "g": ctx.lease_generation})
        time.sleep(120)  # killed here, its transaction never commits

    asyncio.run(Worker(app, name=name, concurrency=1).run())
""")


@pytest.mark.slow
async def test_consumer_killed_mid_message(database_url: str, keys: Keys,
                                           tmp_path: Any) -> None:
    """SIGKILL a worker process while its handler runs: its pending entry is
    taken over — handed on by the relay once the worker is known dead
    (core/processes/liveness.py), or claimed by another consumer after ``claim_idle``
    — and the job runs again, once in effect, as a lost attempt then a
    success."""
    settings = {"lease_seconds": 3.0, "clock_skew_margin": 0.3}
    app = make_app(database_url, url(keys, claim_idle=1), **settings)

    @app.task("slow")
    def slow(payload: Any, ctx: duebox.JobContext) -> None:
        app.calls.log.append((str(ctx.job_id), ctx.lease_generation))  # type: ignore[attr-defined]
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    look = observer(database_url)
    try:
        job_id = schedule_committed(app, "slow", delay=0.2)
        victim_name = f"victim-{uuid.uuid4().hex[:6]}"
        log = (tmp_path / "victim.log").open("w")
        # The victim never takes entries over itself (claim_idle=60).
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", VICTIM, database_url, url(keys, claim_idle=60), victim_name,
            stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            async with Running(app, relays=1, workers=0):
                def victim_running() -> bool:
                    # SQLite: the victim's handler holds the write lock; look
                    # through a plain engine that does not ask for it.
                    rows = attempt_rows(look, job_id)
                    return bool(rows) and rows[0].worker == victim_name \
                        and job_row(look, job_id).state == "RUNNING"

                await until(None, victim_running, seconds=20, what="the victim to start the job",
                            check=lambda: _alive(proc, tmp_path))
                await asyncio.sleep(0.3)
                proc.send_signal(signal.SIGKILL)
                await asyncio.wait_for(proc.wait(), 5)
                assert keys.pending() == 1
                worker = Worker(app, name="survivor", concurrency=2)
                stop = asyncio.Event()
                task = asyncio.create_task(worker.run(stop))
                try:
                    await until(None, lambda: effect_rows(app.engine), seconds=20,
                                what="the job to run after its lease expired",
                                check=lambda: _done_ok(task))
                    await until(None, lambda: keys.pending() == 0 and keys.stream_len() == 0,
                                seconds=5, what="every entry acknowledged")
                finally:
                    stop.set()
                    await task
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            log.close()
        rows = effect_rows(app.engine)
        assert list(rows) == [str(job_id)]
        assert rows[str(job_id)].worker == "survivor"
        assert app.calls.count(job_id) == 1  # type: ignore[attr-defined]
        row = job_row(app.engine, job_id)
        assert (row.state, row.attempt) == ("SUCCEEDED", 2)
        assert [a.outcome for a in attempt_rows(app.engine, job_id)] == ["lost", "succeeded"]
    finally:
        look.dispose()
        app.dispose()


def _alive(proc: asyncio.subprocess.Process, tmp_path: Any) -> None:
    if proc.returncode is not None:
        raise AssertionError("the victim worker exited early:\n"
                             + (tmp_path / "victim.log").read_text())


def _done_ok(task: asyncio.Task[None]) -> None:
    if task.done():
        task.result()
        raise AssertionError("the worker stopped on its own")


async def test_dropped_connections_are_survived(app: duebox.Duebox, keys: Keys) -> None:
    """Kill every Redis connection of this test's relay and worker mid-run
    (a network blip, a Redis failover): they reconnect and every job runs once."""
    ids = [schedule_committed(app, delay=0.1 + 0.05 * i) for i in range(20)]
    async with Running(app, workers=1) as r:
        await until(r, lambda: len(effect_rows(app.engine)) >= 3, seconds=10,
                    what="a first part of the jobs to run")
        mine = [c for c in keys.client.client_list()
                if c["name"].startswith(f"{keys.prefix}:")]
        assert mine
        for c in mine:
            keys.client.client_kill_filter(_id=c["id"])
        await until(r, lambda: len(effect_rows(app.engine)) == len(ids), seconds=15,
                    what="every job to run after the connections dropped")
    check_no_early_start(app.engine)
    assert all(app.calls.count(j) == 1 for j in ids)  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_redis_losing_its_data_mid_run(app: duebox.Duebox, keys: Keys) -> None:
    """Delete every key of this backend while jobs are parked, streamed and
    running (a FLUSHALL or a restart without persistence): the relay notices
    the missing sentinel, reconciles, and every job still runs exactly once."""
    ids = [schedule_committed(app, delay=0.2 + 0.15 * i) for i in range(40)]
    # A periodic sweep would find the loss too; an hour makes the test prove
    # the prompt path (the sentinel).
    async with Running(app, workers=2, relay_kw={"reconcile_interval": 3600}) as r:
        await until(r, lambda: len(effect_rows(app.engine)) >= 5, seconds=10,
                    what="a first part of the jobs to run")
        assert keys.parked() > 0
        wiped = keys.wipe()
        assert wiped >= 3
        await until(r, lambda: len(effect_rows(app.engine)) == len(ids), seconds=20,
                    what="every job to run after the data loss")
        reconciled = sum(x.totals.reconciled for x in r.relays)
    assert reconciled > 0
    check_no_early_start(app.engine)
    assert all(app.calls.count(j) == 1 for j in ids)  # type: ignore[attr-defined]
    with app.engine.connect() as conn:
        assert jobstore.counts_by_state(conn) == {"SUCCEEDED": len(ids)}


async def test_relay_ignores_brokers_that_cannot_reconcile(database_url: str) -> None:
    app = make_app(database_url, memory_url())
    try:
        relay = Relay(app)
        await relay.run_pass()
        (pipeline,) = relay.pipelines
        assert pipeline.reconciler.active is False
    finally:
        app.dispose()
