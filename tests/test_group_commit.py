"""Group commit: a backlog of short jobs run several per transaction, each
handler in its own savepoint (consumers/batch.py, consumers/runner.py).

Every test builds a backlog (jobs due before the worker starts, or queued
behind a handler that blocks the worker's only executor) so that groups
form, checks that they did (``stats.grouped``), and then checks the
invariants: each job's effect exactly once, a failure rolled back alone, a
duplicate or a cancelled job never run."""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import (
    Running,
    all_final,
    attempt_rows,
    cancel_committed,
    effect_rows,
    effect_values,
    effects,
    job_row,
    make_app,
    us,
)

import duebox
from duebox.consumers import batch, policy
from duebox.errors import DatabaseError
from duebox.tables import processed
from duebox.tasks import RetryPolicy

FAST_RETRY = RetryPolicy(base=0.05, cap=0.1)


pytestmark = pytest.mark.usefixtures("roomy_group_budget")


@pytest.fixture(autouse=True)
def small_groups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups from two waiting jobs on, so the tests of what a group does can
    form one with a few jobs (the test of the threshold keeps its own)."""
    if "keeps_group_least" not in request.keywords:
        monkeypatch.setattr(policy, "GROUP_LEAST", 2)


def schedule_due(app: duebox.Duebox, jobs: list[tuple[str, Any]]) -> list[uuid.UUID]:
    """``(task, payload)`` jobs already due, in this order (1 ms apart), committed."""
    first = datetime.now(UTC) - timedelta(seconds=1)
    with app.engine.begin() as conn:
        return [app.schedule(conn, name, payload, at=first + timedelta(milliseconds=i))
                for i, (name, payload) in enumerate(jobs)]


def schedule_backlog(app: duebox.Duebox, n: int) -> list[uuid.UUID]:
    return schedule_due(app, [("effect", None)] * n)


def seen_short_handlers(r: Running) -> None:
    """As if the worker had run short handlers already: it then takes in a
    full group's worth per executor from the start (it begins cautious, one
    per executor, until it knows its handlers' pace).  Call before the first
    await, before the worker claims anything."""
    for w in r.workers:
        w.runner.policy.pace = 0.0001


class Gate:
    """A handler that holds the worker's only executor until released, so the
    jobs behind it queue up and run as groups."""

    def __init__(self, app: duebox.Duebox) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

        @app.task("gate")
        def gate(payload: Any, ctx: duebox.JobContext) -> None:
            self.entered.set()
            assert self.release.wait(30), "the test never released the gate"

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 30), "the gate job never started"


async def run_behind_gate(app: duebox.Duebox, gate: Gate, job_ids: list[uuid.UUID], *,
                          grouped: int, what: str, duplicates: int = 0) -> None:
    """One worker with one executor: the gate job holds it while the others
    queue, then is released; wait until every job is final and the worker
    counted ``grouped`` grouped jobs (and ``duplicates`` duplicates)."""
    async with Running(app, relays=0, workers=1, concurrency=1,
                       worker_kw={"group_commit": 16}) as r:
        seen_short_handlers(r)
        await gate.wait_entered()
        gate.release.set()
        await r.wait(lambda: all_final(app.engine, job_ids), timeout=30, what=what)
        await r.wait(lambda: r.worker_total("grouped") >= grouped, timeout=10,
                     what="the worker to count grouped jobs")
        await r.wait(lambda: r.worker_total("duplicates") >= duplicates, timeout=10,
                     what="the worker to count duplicate jobs")


async def test_a_backlog_runs_in_groups_and_each_job_once(database_url: str) -> None:
    app = make_app(database_url)
    try:
        ids = schedule_backlog(app, 60)
        async with Running(app, relays=0, workers=1, concurrency=2,
                           worker_kw={"group_commit": 8}) as r:
            seen_short_handlers(r)
            await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                         what="all 60 jobs to succeed")
            await r.wait(lambda: r.worker_total("grouped") >= 30, timeout=10,
                         what="30 or more of the 60 jobs to have run in groups")
        effects_by_job = effect_rows(app.engine)
        assert sorted(effects_by_job) == sorted(str(i) for i in ids)
        assert sorted(app.calls.log) == sorted(set(app.calls.log))  # type: ignore[attr-defined]
        with app.engine.connect() as conn:
            seen = conn.execute(sa.select(sa.func.count()).select_from(processed)).scalar()
        assert seen == 60
        outcomes = {a.outcome for i in ids for a in attempt_rows(app.engine, i)}
        assert outcomes == {"succeeded"}
    finally:
        await app.adispose()


@pytest.mark.keeps_group_least
async def test_fewer_waiting_jobs_than_the_group_threshold_run_alone(
        database_url: str) -> None:
    """Behind one busy executor, five jobs wait (fewer than _GROUP_LEAST):
    each runs alone, in its own transaction, since a group that small costs
    more than its jobs alone; with six or more waiting they are grouped."""
    assert policy.GROUP_LEAST == 6
    app = make_app(database_url)
    gate = Gate(app)
    try:
        gate_id, *few = schedule_due(app, [("gate", None)] + [("effect", None)] * 5)
        async with Running(app, relays=0, workers=1, concurrency=1,
                           worker_kw={"group_commit": 16}) as r:
            seen_short_handlers(r)
            await gate.wait_entered()
            await r.wait(lambda: sum(len(w.runner._leased) for w in r.workers) == 5,
                         timeout=10, what="five jobs to wait behind the gate")
            gate.release.set()
            await r.wait(lambda: all_final(app.engine, [gate_id, *few]), timeout=30,
                         what="the five jobs to succeed")
            assert r.worker_total("grouped") == 0
            many = schedule_due(app, [("gate", None)] + [("effect", None)] * 6)
            gate.release.clear()
            gate.entered.clear()
            await gate.wait_entered()
            await r.wait(lambda: sum(len(w.runner._leased) for w in r.workers) == 6,
                         timeout=10, what="six jobs to wait behind the gate")
            gate.release.set()
            await r.wait(lambda: all_final(app.engine, many), timeout=30,
                         what="the six jobs to succeed")
            await r.wait(lambda: r.worker_total("grouped") == 6, timeout=10,
                         what="the six waiting jobs to run as one group")
    finally:
        gate.release.set()
        await app.adispose()


async def test_group_commit_1_runs_every_job_alone(database_url: str) -> None:
    app = make_app(database_url)
    try:
        ids = schedule_backlog(app, 20)
        async with Running(app, relays=0, workers=1, concurrency=2,
                           worker_kw={"group_commit": 1}) as r:
            seen_short_handlers(r)
            await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                         what="all 20 jobs to succeed")
            assert r.worker_total("grouped") == 0
        assert len(effect_rows(app.engine)) == 20
    finally:
        await app.adispose()


async def test_a_failing_handler_rolls_back_alone_and_retries(database_url: str) -> None:
    app = make_app(database_url)

    @app.task("flaky", retry=FAST_RETRY)
    def flaky(payload: Any, ctx: duebox.JobContext) -> None:
        # The write comes first: a failure must take it back with it.
        ctx.session.execute(effects.insert().values(effect_values(ctx)))
        if payload["fail"] and ctx.attempt == 1:
            raise ConnectionError("downstream unavailable")

    try:
        ids = schedule_due(app, [("flaky", {"fail": i % 5 == 2}) for i in range(40)])
        failing = {ids[i] for i in range(40) if i % 5 == 2}
        async with Running(app, relays=0, workers=1, concurrency=1,
                           worker_kw={"group_commit": 8}) as r:
            seen_short_handlers(r)
            await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                         what="all 40 jobs to succeed, the failing ones on their retry")
            await r.wait(lambda: r.worker_total("grouped") >= 20, timeout=10,
                         what="the worker to count grouped jobs")
        rows = effect_rows(app.engine)
        assert sorted(rows) == sorted(str(i) for i in ids)
        for job_id in ids:
            expected = 2 if job_id in failing else 1
            assert rows[str(job_id)].attempt == expected, job_id
            outcomes = [a.outcome for a in attempt_rows(app.engine, job_id)]
            assert outcomes == (["failed", "succeeded"] if job_id in failing
                                else ["succeeded"]), (job_id, outcomes)
    finally:
        await app.adispose()


async def test_a_job_seen_before_is_closed_without_running(database_url: str) -> None:
    app = make_app(database_url)
    gate = Gate(app)
    try:
        gate_id, *ids = schedule_due(app, [("gate", None)] + [("effect", None)] * 10)
        with app.engine.begin() as conn:
            # Its effect already committed under this id (a redelivery after
            # a crash between the commit and the ack, say).
            conn.execute(processed.insert().values(consumer="duebox", message_id=str(ids[3]),
                                                   processed_at=datetime.now(UTC)))
        await run_behind_gate(app, gate, [gate_id, *ids], grouped=9,
                              what="every job to finish", duplicates=1)
        assert str(ids[3]) not in effect_rows(app.engine)
        assert str(ids[3]) not in {c[0] for c in app.calls.log}  # type: ignore[attr-defined]
        assert [a.outcome for a in attempt_rows(app.engine, ids[3])] == ["duplicate"]
        assert len(effect_rows(app.engine)) == 9
    finally:
        gate.release.set()
        await app.adispose()


async def test_a_job_cancelled_while_queued_behind_a_busy_worker_never_runs(
        database_url: str) -> None:
    app = make_app(database_url)
    gate = Gate(app)
    try:
        gate_id, *ids = schedule_due(app, [("gate", None)] + [("effect", None)] * 10)
        async with Running(app, relays=0, workers=1, concurrency=1,
                           worker_kw={"group_commit": 16}) as r:
            seen_short_handlers(r)
            await gate.wait_entered()
            # Claimed (RUNNING) and queued behind the gate: the cancel commits
            # before any of them starts.
            assert job_row(app.engine, ids[1]).state == "RUNNING"
            assert cancel_committed(app, ids[1])
            gate.release.set()
            others = [i for i in ids if i != ids[1]]
            await r.wait(lambda: all_final(app.engine, [gate_id, *others]), timeout=30,
                         what="the other jobs to finish")
            await r.wait(lambda: r.discarded.get("cancelled", 0) >= 1, timeout=10,
                         what="the worker to drop the cancelled job")
            await r.wait(lambda: r.worker_total("grouped") >= 9, timeout=10,
                         what="the worker to count grouped jobs")
        assert job_row(app.engine, ids[1]).state == "CANCELLED"
        assert str(ids[1]) not in {c[0] for c in app.calls.log}  # type: ignore[attr-defined]
        assert sorted(effect_rows(app.engine)) == sorted(str(i) for i in others)
    finally:
        gate.release.set()
        await app.adispose()


async def test_a_slow_handler_gives_back_the_jobs_its_group_did_not_start(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "BUDGET", 0.05)
    app = make_app(database_url)
    gate = Gate(app)

    @app.task("slow")
    def slow(payload: Any, ctx: duebox.JobContext) -> None:
        threading.Event().wait(4 * policy.BUDGET)
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    try:
        gate_id, slow_id, *ids = schedule_due(
            app, [("gate", None), ("slow", None)] + [("effect", None)] * 6)
        async with Running(app, relays=0, workers=1, concurrency=1,
                           worker_kw={"group_commit": 16}) as r:
            seen_short_handlers(r)
            await gate.wait_entered()
            gate.release.set()
            await r.wait(lambda: all_final(app.engine, [gate_id, slow_id, *ids]), timeout=30,
                         what="every job to finish")
        rows = effect_rows(app.engine)
        assert sorted(rows) == sorted(str(i) for i in [slow_id, *ids])
        # Not started in the slow job's group: each began after that group
        # committed (the slow job's finished_at is stamped at its commit).
        slow_finished = us(job_row(app.engine, slow_id).finished_at)
        assert all(rows[str(i)].started_us >= slow_finished for i in ids), (
            slow_finished, [rows[str(i)].started_us for i in ids])
    finally:
        gate.release.set()
        await app.adispose()


async def test_a_checkpoint_survives_its_handler_failing_in_a_group(database_url: str) -> None:
    app = make_app(database_url)
    gate = Gate(app)
    seen: dict[int, Any] = {}

    @app.task("resumable", retry=FAST_RETRY)
    def resumable(payload: Any, ctx: duebox.JobContext) -> None:
        seen[ctx.attempt] = ctx.checkpoint_state
        if ctx.attempt == 1:
            assert ctx.checkpoint({"done": 3})
            raise TimeoutError("stopped half way")

    try:
        gate_id, before, job_id = schedule_due(
            app, [("gate", None), ("effect", None), ("resumable", None)])
        await run_behind_gate(app, gate, [gate_id, before, job_id], grouped=2,
                              what="the resumable job to succeed on its retry")
        assert seen == {1: None, 2: {"done": 3}}
    finally:
        gate.release.set()
        await app.adispose()


async def test_a_group_that_fails_as_a_whole_runs_each_job_alone(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(database_url)
    real = batch.jobstore.complete_locked
    failures = []

    def fail_once(*args: Any, **kw: Any) -> None:
        if not failures:
            failures.append(1)
            raise DatabaseError("complete: connection lost (injected)")
        real(*args, **kw)

    monkeypatch.setattr(batch.jobstore, "complete_locked", fail_once)
    try:
        ids = schedule_backlog(app, 20)
        async with Running(app, relays=0, workers=1, concurrency=1,
                           worker_kw={"group_commit": 8}) as r:
            seen_short_handlers(r)
            await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                         what="all 20 jobs to succeed")
            reran = r.worker_total("reran")
        assert failures == [1]
        calls = [c[0] for c in app.calls.log]  # type: ignore[attr-defined]
        assert len(calls) > len(set(calls)) == 20  # the failed group's handlers ran again...
        assert reran == len(calls) - 20  # ...each one counted
        assert sorted(effect_rows(app.engine)) == sorted(str(i) for i in ids)  # ...once in effect
    finally:
        await app.adispose()


async def test_a_failing_handlers_orm_objects_are_not_flushed_with_its_group(
        database_url: str) -> None:
    from sqlalchemy.orm import registry

    class Effect:
        pass

    mapper_registry = registry()
    mapper_registry.map_imperatively(Effect, effects)
    app = make_app(database_url)
    gate = Gate(app)

    @app.task("orm", retry=FAST_RETRY)
    def orm(payload: Any, ctx: duebox.JobContext) -> None:
        row = Effect()
        for name, value in effect_values(ctx).items():
            setattr(row, name, value)
        ctx.session.add(row)  # pending: flushed only when its savepoint is released
        if ctx.attempt == 1 and payload["fail"]:
            raise ConnectionError("downstream unavailable")

    try:
        gate_id, *ids = schedule_due(
            app, [("gate", None)] + [("orm", {"fail": i == 1}) for i in range(4)])
        await run_behind_gate(app, gate, [gate_id, *ids], grouped=4,
                              what="every job to succeed")
        rows = effect_rows(app.engine)
        assert sorted(rows) == sorted(str(i) for i in ids)
        assert rows[str(ids[1])].attempt == 2  # attempt 1's pending row was discarded
    finally:
        gate.release.set()
        mapper_registry.dispose()
        await app.adispose()


async def test_a_savepoint_is_paid_only_by_handlers_that_use_the_session(
        database_url: str) -> None:
    """The savepoint of a handler that never touches ``ctx.session`` is never
    emitted (no round trips for it); one that does gets its own, and a
    failure on either side of it still rolls back only its own writes."""
    app = make_app(database_url)
    gate = Gate(app)
    savepoints: list[str] = []

    @app.task("mixed", retry=FAST_RETRY)
    def mixed(payload: Any, ctx: duebox.JobContext) -> None:
        if payload["writes"]:
            ctx.session.execute(effects.insert().values(effect_values(ctx)))
        if payload["fail"] and ctx.attempt == 1:
            raise ConnectionError("downstream unavailable")

    sa.event.listen(app.engine, "savepoint", lambda conn, name: savepoints.append(name))
    # no write + fail, write + fail, write, no write, write, no write + fail
    shapes = [(False, True), (True, True), (True, False), (False, False), (True, False),
              (False, True)]
    try:
        gate_id, *ids = schedule_due(
            app, [("gate", None)] + [("mixed", {"writes": w, "fail": f}) for w, f in shapes])
        await run_behind_gate(app, gate, [gate_id, *ids], grouped=len(shapes),
                              what="every job to succeed, the failing ones on their retry")
        writers = [i for i, (w, _) in zip(ids, shapes, strict=True) if w]
        rows = effect_rows(app.engine)
        assert sorted(rows) == sorted(str(i) for i in writers)
        for job_id, (w, f) in zip(ids, shapes, strict=True):
            if w:
                assert rows[str(job_id)].attempt == (2 if f else 1), job_id
            outcomes = [a.outcome for a in attempt_rows(app.engine, job_id)]
            assert outcomes == (["failed", "succeeded"] if f else ["succeeded"]), job_id
        # One savepoint per run of a writing handler (3 in the group, then the
        # retry of the one that failed, alone or grouped): none for the others.
        assert len(savepoints) <= 4, savepoints
        assert len(savepoints) >= 3, savepoints
    finally:
        gate.release.set()
        await app.adispose()


async def test_a_stopping_worker_gives_back_the_jobs_waiting_for_an_executor(
        database_url: str) -> None:
    app = make_app(database_url)
    gate = Gate(app)
    try:
        gate_id, *ids = schedule_due(app, [("gate", None)] + [("effect", None)] * 5)
        async with Running(app, relays=0, workers=1, concurrency=1,
                           worker_kw={"group_commit": 16}) as r:
            seen_short_handlers(r)
            await gate.wait_entered()
            await r.wait(lambda: all(job_row(app.engine, i).state == "RUNNING" for i in ids),
                         timeout=10, what="the five to be claimed behind the gate")
            r.stop.set()  # the gate's handler still runs: the five wait for it
            await r.wait(lambda: all(job_row(app.engine, i).state == "SCHEDULED" for i in ids),
                         timeout=10, what="the waiting five to be given back at once")
            gate.release.set()
        assert job_row(app.engine, gate_id).state == "SUCCEEDED"
        for job_id in ids:
            assert job_row(app.engine, job_id).attempt == 0
            assert attempt_rows(app.engine, job_id) == []
        assert effect_rows(app.engine) == {}
    finally:
        gate.release.set()
        await app.adispose()
