"""The liveness lock (core/processes/liveness.py) and the takeover (core/processes/takeover.py)
on every database, the owner-prefix recovery's fencing, and Redis's hand-on
of a dead consumer's pending entries.

The lock's one promise is checked with a real process really killed: while
the process lives its lock is held, the moment it dies the lock is free.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from backends import Keys
from helpers import attempt_rows, job_row, make_app

import duebox
from duebox import FakeClock, JobState
from duebox.leases import claims, jobstore, recovery
from duebox.processes.liveness import DeathWatch, SessionLock, free_names
from duebox.processes.takeover import Takeover
from duebox.tables import lease

T0 = datetime(2030, 1, 1, tzinfo=UTC)

HOLDER = """
import sys, time
from sqlalchemy import create_engine
from duebox.processes.liveness import SessionLock
lock = SessionLock(create_engine(sys.argv[1]), sys.argv[2])
print("held" if lock.acquire() else "not held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def app(database_url_all: str) -> Iterator[duebox.Duebox]:
    a = make_app(database_url_all, clock=FakeClock(T0))
    yield a
    a.dispose()


def looks_free(app: duebox.Duebox, *names: str) -> set[str]:
    with app.engine.connect() as conn:
        return free_names(conn, list(names))


def test_a_lock_is_held_while_its_process_lives_and_free_the_moment_it_is_killed(
    app: duebox.Duebox
) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(app.engine.url.render_as_string(
        hide_password=False)), "proc-a"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        assert looks_free(app, "proc-a", "proc-b") == {"proc-b"}
        # Looking takes nothing: the holder's lock is still seen held.
        assert looks_free(app, "proc-a") == set()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        deadline = time.monotonic() + 10
        while looks_free(app, "proc-a") != {"proc-a"}:  # the server ends the session
            assert time.monotonic() < deadline, "the dead process's lock is still held"
            time.sleep(0.05)
    finally:
        holder.kill()
        holder.wait(10)
        assert holder.stdout is not None
        holder.stdout.close()


def test_a_second_process_of_the_same_name_cannot_take_the_lock(app: duebox.Duebox) -> None:
    first, second = SessionLock(app.engine, "twin"), SessionLock(app.engine, "twin")
    try:
        assert first.acquire()
        assert not second.acquire()
        # The second keeps trying every KEEP_INTERVAL and takes the lock the
        # moment it is free (a busy machine's parallel run saw it do so
        # before the look below): it stops trying before the first lets go.
        second.release()
        first.release()
        assert looks_free(app, "twin") == {"twin"}
    finally:
        second.release()
        first.release()


@pytest.mark.postgres
def test_a_dropped_lock_connection_is_taken_again(pg_server_url: str) -> None:
    """pg_terminate_backend on the lock's session (as a database restart
    would): the process takes its lock again well within CONFIRM_AFTER, so a
    peer's second look finds it held."""
    from conftest import reset_tables

    reset_tables(pg_server_url)
    app = make_app(pg_server_url)
    lock = SessionLock(app.engine, "survivor")
    try:
        assert lock.acquire()
        assert lock._conn is not None
        pid = lock._conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with app.engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        watch = DeathWatch()
        deadline = time.monotonic() + 5
        while lock.retaken == 0:
            assert time.monotonic() < deadline, "the lock was not taken again"
            time.sleep(0.02)
        assert looks_free(app, "survivor") == set()
        with app.engine.connect() as conn:
            assert watch.dead(conn, ["survivor"]) == []
    finally:
        lock.release()
        app.dispose()


def test_a_death_is_confirmed_only_on_a_second_look(app: duebox.Duebox) -> None:
    watch = DeathWatch(confirm_after=0.3)
    held = SessionLock(app.engine, "alive")
    try:
        assert held.acquire()
        with app.engine.connect() as conn:
            assert watch.dead(conn, ["alive", "gone"]) == []  # "gone" is only suspected
            assert watch.next_look() is not None
            time.sleep(0.3)  # the confirmation period itself is what is tested
            assert watch.dead(conn, ["alive", "gone"]) == ["gone"]
    finally:
        held.release()


def test_recover_owned_takes_only_the_dead_process_jobs(app: duebox.Duebox) -> None:
    """Owners are ``<process>#<n>``: 'w_1' is not a pattern for 'wx1', and
    'w1' does not match 'w10'; a RUNNING job counts as a lost attempt."""
    ids = []
    with app.engine.begin() as conn:
        for _ in range(4):
            ids.append(app.schedule(conn, "effect"))
    owners = ["w_1#1", "wx1#1", "w_10#1", "w_1#2"]
    with app.engine.begin() as conn:
        for job_id, owner in zip(ids, owners, strict=True):
            claims.claim_for_run(conn, owner=owner, now=T0, limit=1, queues=None,
                                   lease_until=T0 + timedelta(seconds=30), worker=owner,
                                   ids=[job_id])
    with app.engine.begin() as conn:
        got = recovery.recover_owned(conn, process="w_1", now=T0, limit=100)
    assert (got.running, got.dispatching, got.dead) == (2, 0, 0)
    states = {o: job_row(app.engine, i).state for i, o in zip(ids, owners, strict=True)}
    assert states == {"w_1#1": JobState.SCHEDULED, "wx1#1": JobState.RUNNING,
                      "w_10#1": JobState.RUNNING, "w_1#2": JobState.SCHEDULED}
    assert [a.outcome for a in attempt_rows(app.engine, ids[0])] == ["lost"]
    assert "died" in (job_row(app.engine, ids[0]).last_error or "")


def test_a_late_completion_after_a_takeover_matches_nothing(app: duebox.Duebox) -> None:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "effect")
    with app.engine.begin() as conn:
        [rec] = claims.claim_for_run(conn, owner="ghost#1", now=T0, limit=1, queues=None,
                                       lease_until=T0 + timedelta(seconds=30), worker="ghost")
    with app.engine.begin() as conn:
        recovery.recover_owned(conn, process="ghost", now=T0, limit=100)
    with app.engine.begin() as conn:
        stmt, params = jobstore.complete_bound(rec, T0)
        assert conn.execute(stmt, params).rowcount == 0
    assert job_row(app.engine, job_id).state == JobState.SCHEDULED


def test_takeover_finds_a_registered_process_whose_lock_is_gone(app: duebox.Duebox) -> None:
    """A registry row that says it holds a lock, with no lock held: dead on
    the second look; its jobs come back and its row goes.  A live one and a
    row without liveness are left alone."""
    live = SessionLock(app.engine, "live-w")
    with app.engine.begin() as conn:
        for name, info in (("worker:dead-w", {"name": "dead-w", "liveness": True,
                                              "queues": ["default"]}),
                           ("worker:live-w", {"name": "live-w", "liveness": True}),
                           ("worker:old-w", {"name": "old-w"})):
            conn.execute(lease.insert().values(name=name, owner=name, epoch=0, info=info,
                                               expires_at=T0))
        job_id = app.schedule(conn, "effect")
        claims.claim_for_run(conn, owner="dead-w#7", now=T0, limit=1, queues=None,
                               lease_until=T0 + timedelta(seconds=30), worker="dead-w")
    takeover = Takeover(app.engine, app.clock, limit=10, own_name="relay-x")
    takeover.watch.confirm_after = 0.0
    try:
        assert live.acquire()
        takeover.find()  # the first look: suspects only
        [dead] = takeover.find()
        assert (dead.name, dead.role, dead.info["queues"]) == ("dead-w", "worker", ["default"])
        assert takeover.recover(dead).running == 1
        takeover.forget(dead)
        with app.engine.connect() as conn:
            rows = set(conn.execute(sa.select(lease.c.name)).scalars())
        assert rows == {"worker:live-w", "worker:old-w"}
        assert job_row(app.engine, job_id).state == JobState.SCHEDULED
        assert takeover.find() == []
    finally:
        live.release()


async def test_redis_hands_on_a_dead_consumers_pending_entries(redis_keys: Keys) -> None:
    """Entries a dead consumer read and never acked go back on the stream at
    once (not after claim_idle), the job index following them, and a live
    consumer reads them as new."""
    from duebox.brokers.base import BrokerContext, Outgoing
    from duebox.brokers.redis import RedisBroker
    from duebox.message import JobMessage

    app = make_app("sqlite://")
    url = redis_keys.url(claim_idle=600)
    dead = RedisBroker(url, BrokerContext(app.engine, app.clock, app.settings, "dead-w"))
    live = RedisBroker(url, BrokerContext(app.engine, app.clock, app.settings, "live-w"))
    relay = RedisBroker(url, BrokerContext(app.engine, app.clock, app.settings, "relay"))
    try:
        msgs = [JobMessage(uuid.uuid4(), "effect", "default", 1, 0, datetime.now(UTC))
                for _ in range(3)]
        await relay.publish([Outgoing(m, 0.0) for m in msgs])
        got = []
        async for d in dead.consume(["default"], 10):
            got.append(d)
            if len(got) == 3:
                break
        assert redis_keys.pending() == 3
        assert await relay.take_over("dead-w", {"queues": ["default"]}) == 3
        assert redis_keys.pending() == 0
        again = []
        async for d in live.consume(["default"], 10):
            again.append(d.message.job_id if d.message else None)
            await live.ack(d)
            if len(again) == 3:
                break
        assert sorted(again) == sorted(m.job_id for m in msgs)
        assert [redis_keys.held(m.job_id) for m in msgs] == [None] * 3  # acked: index gone
        assert await relay.take_over("dead-w", {"queues": ["default"]}) == 0
    finally:
        for b in (dead, live, relay):
            await b.close()
        await asyncio.sleep(0)
        app.dispose()
