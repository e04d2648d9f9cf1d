"""The design's invariants 1-5, end to end in one process, on the ``sql://``
path (workers claim rows) and the relay -> ``memory://`` broker path, on
SQLite and PostgreSQL.  Invariant 6 (bad input) is tests/test_bad_input.py;
the multi-process crash test is tests/test_processes.py.

Every wait polls the database (or a counter) for a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import (
    Running,
    all_final,
    attempt_rows,
    cancel_committed,
    check_no_early_start,
    count,
    effect_rows,
    effect_values,
    effects,
    job_row,
    make_app,
    memory_url,
    schedule_committed,
    us,
)

import duebox
from duebox import FakeClock, JobState
from duebox.brokers.base import Delivery
from duebox.brokers.memory import MemoryBroker, reset_hubs
from duebox.consumers import Worker
from duebox.leases import claims, dispatch_marks, jobstore, recovery
from duebox.tables import job, processed

PATHS = {
    "sql": "sql://",
    # The broker delays every message itself.
    "memory": "memory",
    # No native delay: the relay holds near-due jobs and publishes at due time.
    "memory-hold": "memory?max_delay=0",
    # A short ceiling: later jobs stay parked in the table until they come near.
    "memory-park": "memory?max_delay=0.4",
}


def broker_url(path: str) -> str:
    spec = PATHS[path]
    if spec.startswith("memory"):
        return memory_url() + spec[len("memory"):]
    return spec


@pytest.fixture
def database_url(database_url_all: str) -> str:
    """The invariants hold on MariaDB too, so they run there as well."""
    return database_url_all


BY_HANDLER = pytest.mark.parametrize("task_name", ["effect", "effect_async"])


@pytest.fixture(autouse=True)
def _fresh_hubs() -> Any:
    yield
    reset_hubs()


@pytest.fixture(params=["sql", "memory"])
async def app(request: pytest.FixtureRequest, database_url: str) -> AsyncIterator[duebox.Duebox]:
    a = make_app(database_url, broker_url(request.param))
    yield a
    await a.adispose()


def message_for(app: duebox.Duebox, job_id: uuid.UUID) -> duebox.JobMessage:
    r = job_row(app.engine, job_id)
    return duebox.JobMessage(job_id=r.id, task=r.task, queue=r.queue, version=r.version,
                             attempt=r.attempt, due_at=r.due_at, payload=r.payload,
                             headers=dict(r.headers or {}))


def in_states(app: duebox.Duebox, ids: list[uuid.UUID], wanted: set[str]) -> bool:
    with app.engine.connect() as conn:
        got = conn.execute(sa.select(job.c.state).where(job.c.id.in_(ids))).scalars().all()
    return len(got) == len(ids) and set(got) <= wanted


def assert_one_effect_each(app: duebox.Duebox, ids: list[uuid.UUID]) -> None:
    rows = effect_rows(app.engine)
    assert set(rows) == {str(i) for i in ids}
    calls = app.calls  # type: ignore[attr-defined]
    twice = [i for i in ids if calls.count(i) != 1]
    # Say which job, with which leases, and what its attempts recorded: a
    # second call is a bug to find, and this is where to start.
    assert not twice, "a handler ran twice: " + "; ".join(
        f"{i}: calls (job, lease generation) {[c for c in calls.log if c[0] == str(i)]}, "
        f"attempts {_attempts(app, i)}" for i in twice)


def _attempts(app: duebox.Duebox, job_id: uuid.UUID) -> list[tuple[Any, ...]]:
    return [(a.number, a.worker, a.lease_generation, a.outcome, a.error)
            for a in attempt_rows(app.engine, job_id)]


# --- invariant 1: never before due_at -------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
async def test_invariant_1_no_job_starts_before_its_due_time(
    database_url: str, path: str
) -> None:
    app = make_app(database_url, broker_url(path))
    try:
        now = datetime.now(UTC)
        ids = [schedule_committed(app, "effect" if i % 3 else "effect_async", {"i": i},
                                  delay=0.8 + i * 0.0371)
               for i in range(40)]
        # Due in the past already, and due at sub-millisecond offsets.
        ids.append(schedule_committed(app, "effect", at=now - timedelta(hours=1)))
        ids += [schedule_committed(app, "effect", at=now + timedelta(seconds=1.2, microseconds=k))
                for k in (1, 499, 999)]
        async with Running(app, workers=2) as r:
            await r.wait(lambda: all_final(app.engine, ids), timeout=30,
                         what="every job to succeed")
        check_no_early_start(app.engine)
        assert_one_effect_each(app, ids)
    finally:
        await app.adispose()


# --- invariant 2: a committed job is never lost ---------------------------------------


def fake_claim(app: duebox.Duebox, job_id: uuid.UUID, stage: str, lease: float = 0.3) -> int:
    """A process claims ``job_id`` the way the real ones do, then "dies":
    nothing it holds will ever be released by it.  Returns its lease generation."""
    now = datetime.now(UTC)
    until = now + timedelta(seconds=lease)
    with app.engine.begin() as conn:
        if stage == "worker-claimed":  # sql://: a worker's claim, RUNNING
            [rec] = claims.claim_for_run(conn, owner="dead-worker#1", now=now, limit=1,
                                           lease_until=until, queues=None, worker="dead-worker")
            return rec.lease_generation
        [rec] = claims.claim_for_dispatch(conn, owner="dead-relay#1", horizon=now, limit=1,
                                            now=now, lease_until=until)
        if stage == "relay-claimed":  # died before publishing: DISPATCHING
            return rec.lease_generation
        # Published, marked ENQUEUED, and the broker lost the message (memory://
        # lives in the dead process).
        assert dispatch_marks.mark_enqueued(conn, owner="dead-relay#1", ids=[job_id], now=now) == 1
        if stage == "message-lost":
            return rec.lease_generation
        assert stage == "worker-started"  # a worker started it, then died: RUNNING
        started = jobstore.start(conn, message=rec.to_message(), owner="dead-worker#2",
                                 now=now, lease_until=until, worker="dead-worker")
        assert started is not None
        return started.lease_generation


@pytest.mark.parametrize(
    ("path", "stage"),
    [("sql", "worker-claimed"), ("memory", "relay-claimed"), ("memory", "message-lost"),
     ("memory", "worker-started")],
)
async def test_invariant_2_a_job_whose_claimer_died_still_runs_once(
    database_url: str, path: str, stage: str
) -> None:
    app = make_app(database_url, broker_url(path), redeliver_after=0.3)
    try:
        orphan = schedule_committed(app, "effect", {"orphan": True})
        dead_generation = fake_claim(app, orphan, stage)
        others = [schedule_committed(app, "effect", delay=i * 0.05) for i in range(10)]
        assert job_row(app.engine, orphan).state != JobState.SCHEDULED
        async with Running(app) as r:
            await r.wait(lambda: all_final(app.engine, [orphan, *others]), timeout=20,
                         what="the orphaned job and the others to succeed")
            recovered = sum(x.totals.recovered for x in r.relays)
        assert recovered >= 1
        assert_one_effect_each(app, [orphan, *others])
        effect = effect_rows(app.engine)[str(orphan)]
        assert not effect.worker.startswith("dead-")
        assert effect.lease_generation > dead_generation
        outcomes = [a.outcome for a in attempt_rows(app.engine, orphan)]
        if stage.startswith("worker"):
            assert outcomes == ["lost", "succeeded"]
        else:
            assert outcomes == ["succeeded"]
        check_no_early_start(app.engine)
    finally:
        await app.adispose()


# --- invariant 3: one effect per job id ------------------------------------------------


@pytest.mark.usefixtures("roomy_group_budget")  # every copy counted as run or discarded
async def test_invariant_3_duplicate_messages_have_one_effect(database_url: str) -> None:
    """The broker delivers every message four times, to two competing workers."""
    app = make_app(database_url, memory_url())
    try:
        ids = [schedule_committed(app, "effect" if i % 2 else "effect_async", delay=0.6)
               for i in range(12)]
        async with Running(app, workers=2, concurrency=6) as r:
            await r.wait(lambda: in_states(app, ids, {"ENQUEUED", "RUNNING", "SUCCEEDED"}),
                         timeout=10, what="the relay to publish every job")
            injector = app.broker("injector")
            assert isinstance(injector, MemoryBroker)
            for job_id in ids:
                body = message_for(app, job_id).encode()
                for _ in range(3):
                    await injector.inject("default", body)
            await r.wait(lambda: all_final(app.engine, ids), timeout=15, what="all to succeed")

            def settled() -> bool:
                return r.worker_total("succeeded") + sum(r.discarded.values()) >= 4 * len(ids)

            await r.wait(settled, timeout=15, what="every copy to be handled")
            discarded = r.discarded
            succeeded = r.worker_total("succeeded")
        assert_one_effect_each(app, ids)
        assert (succeeded, sum(discarded.values())) == (len(ids), 3 * len(ids))
        assert set(discarded) <= {"already_running", "already_succeeded", "locked"}
        assert count(app.engine, processed) == len(ids)
        check_no_early_start(app.engine)
    finally:
        await app.adispose()


@BY_HANDLER
async def test_invariant_3_the_dedupe_store_skips_an_effect_already_committed(
    app: duebox.Duebox, task_name: str
) -> None:
    """The job's outbox id is already in the consumer inbox (its effect
    committed once, e.g. by an earlier attempt): the handler must not run again."""
    job_id = schedule_committed(app, task_name)
    fresh = schedule_committed(app, task_name)
    with app.engine.begin() as conn:
        conn.execute(processed.insert().values(consumer="duebox", message_id=str(job_id),
                                               processed_at=datetime.now(UTC)))
    async with Running(app) as r:
        await r.wait(lambda: all_final(app.engine, [job_id, fresh]), timeout=15,
                     what="both jobs to complete")
    # Whether the handler is skipped or runs and is rolled back, nothing of
    # it may commit a second time.
    assert set(effect_rows(app.engine)) == {str(fresh)}
    assert [a.outcome for a in attempt_rows(app.engine, job_id)] == ["duplicate"]
    assert count(app.engine, processed) == 2


async def test_invariant_3_a_start_twice_runs_once(app: duebox.Duebox) -> None:
    """The same delivery handed to the worker twice, concurrently."""
    job_id = schedule_committed(app, "effect")
    msg = message_for(app, job_id)
    worker = Worker(app, name="twice")
    await asyncio.gather(worker.handle(Delivery(message=msg)),
                         worker.handle(Delivery(message=msg)))
    assert_one_effect_each(app, [job_id])
    assert worker.stats.succeeded == 1
    assert sum(worker.stats.discarded.values()) == 1
    assert job_row(app.engine, job_id).state == JobState.SUCCEEDED


# --- invariant 4: a cancelled or rescheduled job's stale message never runs -------------


async def test_invariant_4_cancel_after_publish_discards_the_message(database_url: str) -> None:
    app = make_app(database_url, memory_url())
    try:
        ids = [schedule_committed(app, "effect", delay=2.0 + i * 0.02) for i in range(12)]
        cancel, keep = ids[::2], ids[1::2]
        async with Running(app) as r:
            await r.wait(lambda: in_states(app, ids, {"ENQUEUED"}), timeout=10,
                         what="every job to sit in the broker, not yet due")
            for job_id in cancel:
                assert cancel_committed(app, job_id) is True
            # Bounds for a loaded machine (CI at load 30 passed 15 s once).
            await r.wait(lambda: r.discarded.get("cancelled", 0) == len(cancel), timeout=60,
                         what="the in-flight messages of the cancelled jobs to arrive")
            await r.wait(lambda: all_final(app.engine, keep), timeout=60, what="the rest to run")
        assert_one_effect_each(app, keep)
        assert all_final(app.engine, cancel, "CANCELLED")
        assert {job_row(app.engine, i).version for i in cancel} == {2}
        check_no_early_start(app.engine)
    finally:
        await app.adispose()


async def test_invariant_4_reschedule_after_publish_runs_once_at_the_new_time(
    database_url: str,
) -> None:
    app = make_app(database_url, memory_url())
    try:
        ids = [schedule_committed(app, "effect", delay=2.0) for _ in range(6)]
        async with Running(app) as r:
            await r.wait(lambda: in_states(app, ids, {"ENQUEUED"}), timeout=10,
                         what="every job to sit in the broker")
            new_due = {}
            with app.engine.begin() as conn:
                for n, job_id in enumerate(ids):
                    app.reschedule(conn, job_id, delay=2.8 + n * 0.05)
            for job_id in ids:
                new_due[job_id] = job_row(app.engine, job_id).due_at
            await r.wait(lambda: r.discarded.get("stale_version", 0) == len(ids), timeout=15,
                         what="the stale messages to arrive and be dropped")
            assert effect_rows(app.engine) == {}
            await r.wait(lambda: all_final(app.engine, ids), timeout=15, what="the new runs")
        assert_one_effect_each(app, ids)
        rows = effect_rows(app.engine)
        for job_id in ids:
            assert rows[str(job_id)].started_us >= us(new_due[job_id])
            assert job_row(app.engine, job_id).version == 2
        check_no_early_start(app.engine)
    finally:
        await app.adispose()


async def test_invariant_4_on_sql_cancel_and_reschedule_are_exact(database_url: str) -> None:
    app = make_app(database_url, "sql://")
    try:
        gone = [schedule_committed(app, "effect", delay=0.7) for _ in range(4)]
        later = [schedule_committed(app, "effect", delay=0.5) for _ in range(4)]
        sooner = [schedule_committed(app, "effect", delay=3600) for _ in range(2)]
        # Done before the workers start, so no race can make them fail; a
        # cancel or reschedule that did not take would still show: the old
        # due times fall inside the wait below.
        for job_id in gone:
            assert cancel_committed(app, job_id)
        with app.engine.begin() as conn:
            for job_id in later:
                app.reschedule(conn, job_id, delay=1.5)
            for job_id in sooner:
                app.reschedule(conn, job_id, delay=0.2)
        due = {i: job_row(app.engine, i).due_at for i in later + sooner}
        async with Running(app) as r:
            await r.wait(lambda: all_final(app.engine, later + sooner), timeout=15,
                         what="the rescheduled jobs to run")
        assert_one_effect_each(app, later + sooner)
        rows = effect_rows(app.engine)
        for job_id, due_at in due.items():
            assert rows[str(job_id)].started_us >= us(due_at)
        assert all_final(app.engine, gone, "CANCELLED")
        check_no_early_start(app.engine)
    finally:
        await app.adispose()


# --- invariant 5: a late completion from a lost lease changes nothing ------------------


def start_as(app: duebox.Duebox, msg: duebox.JobMessage, worker: str) -> jobstore.JobRecord:
    """A worker's version-checked start, as ``Worker`` does it."""
    now = app.clock.now()
    with app.engine.begin() as conn:
        rec = jobstore.start(conn, message=msg, owner=f"{worker}#1", now=now, worker=worker,
                             lease_until=now + timedelta(seconds=app.settings.lease_seconds))
    assert rec is not None
    return rec


@BY_HANDLER
@pytest.mark.parametrize("order", ["late-before-new", "late-after-new"])
async def test_invariant_5_late_completion_is_fenced_out(
    database_url: str, task_name: str, order: str
) -> None:
    """The old worker started the job, paused past its lease; recovery handed
    the job to a new worker.  Whether the old worker finishes before or after
    the new one, its completion matches no row and its writes roll back."""
    clock = FakeClock(datetime.now(UTC))
    app = make_app(database_url, clock=clock, lease_seconds=10, clock_skew_margin=1)
    try:
        job_id = schedule_committed(app, task_name)
        msg = message_for(app, job_id)
        old = start_as(app, msg, "old")
        clock.advance(12)  # the old worker paused longer than its lease
        with app.engine.begin() as conn:
            assert recovery.recover(conn, now=clock.now(), margin=1, redeliver_after=900,
                                    limit=10).running == 1
        new = start_as(app, msg, "new")
        old_worker, new_worker = Worker(app, name="old"), Worker(app, name="new")

        if order == "late-before-new":
            await old_worker.handle(Delivery(message=msg, claimed=old))
            # The handler ran, and everything it wrote rolled back with the
            # dedupe row: the new attempt is free to do the work.
            assert app.calls.count(job_id) == 1  # type: ignore[attr-defined]
            assert effect_rows(app.engine) == {}
            assert count(app.engine, processed) == 0
            assert job_row(app.engine, job_id).lease_owner == new.lease_owner
            await new_worker.handle(Delivery(message=msg, claimed=new))
        else:
            await new_worker.handle(Delivery(message=msg, claimed=new))
            before = job_row(app.engine, job_id)
            await old_worker.handle(Delivery(message=msg, claimed=old))
            assert job_row(app.engine, job_id) == before
        assert (old_worker.stats.lease_lost, old_worker.stats.succeeded) == (1, 0)
        assert (new_worker.stats.lease_lost, new_worker.stats.succeeded) == (0, 1)
        [effect] = effect_rows(app.engine).values()
        assert (effect.worker, effect.lease_generation) == ("new", new.lease_generation)
        row = job_row(app.engine, job_id)
        assert (row.state, row.lease_generation) == (JobState.SUCCEEDED, new.lease_generation)
        assert [a.outcome for a in attempt_rows(app.engine, job_id)] == ["lost", "succeeded"]
    finally:
        await app.adispose()


@pytest.mark.postgres
@pytest.mark.parametrize("path", ["sql", "memory"])
async def test_invariant_5_a_paused_worker_loses_its_job_and_its_writes(
    pg_server_url: str, path: str
) -> None:
    """Through the real loops: a handler stalls past its lease, the job is
    recovered and started again, then the stalled handler finishes."""
    from conftest import reset_tables

    reset_tables(pg_server_url)
    app = make_app(pg_server_url, broker_url(path), lease_seconds=30)
    entered, release = threading.Event(), threading.Event()
    generations: list[int] = []

    @app.task("stall")
    def stall(payload: Any, ctx: duebox.JobContext) -> None:
        generations.append(ctx.lease_generation)
        if not entered.is_set():
            entered.set()
            assert release.wait(30)
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    try:
        job_id = schedule_committed(app, "stall")
        async with Running(app, workers=2) as r:
            await r.wait(entered.is_set, timeout=10, what="the handler to start")
            # The pause outlasts the lease (a stop-the-world pause, a frozen VM).
            with app.engine.begin() as conn:
                conn.execute(sa.update(job).where(job.c.id == job_id)
                             .values(lease_until=datetime.now(UTC) - timedelta(seconds=60)))

            def restarted() -> bool:
                row = job_row(app.engine, job_id)
                return (row.state in (JobState.RUNNING, JobState.SUCCEEDED)
                        and row.lease_generation > generations[0])

            await r.wait(restarted, timeout=10, what="the job to be recovered and restarted")
            release.set()
            await r.wait(lambda: all_final(app.engine, [job_id]), timeout=15,
                         what="the new attempt to finish")
            await r.wait(lambda: r.worker_total("lease_lost") == 1, timeout=15,
                         what="the stalled attempt to find its lease gone")
        assert len(generations) == 2
        [effect] = effect_rows(app.engine).values()
        final = job_row(app.engine, job_id)
        assert effect.lease_generation == generations[1] == final.lease_generation
        assert [a.outcome for a in attempt_rows(app.engine, job_id)] == ["lost", "succeeded"]
    finally:
        release.set()
        await app.adispose()
