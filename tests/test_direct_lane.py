"""``sql://``: the batch lane locks due rows itself (consumers/runner.py
``pull``, consumers/batch.py ``Kind.DUE``, core/leases/batch_sql.py
``lock_due``): a job it runs goes SCHEDULED → SUCCEEDED in the transaction
that runs it, with no claim written.

On real PostgreSQL and MariaDB (the lane does not run on SQLite).  Each test
checks that the path it is about really ran — ``stats.direct`` counts the
jobs the lane locked itself, and such a job's row has no ``claimed_at``,
which every claim writes — and then what must hold whatever the path: each
effect once, one attempt row per run, never early, a cancel or another
transaction's lock respected, expired jobs expired, other tasks' jobs run
the usual way."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import (
    Running,
    all_final,
    attempt_rows,
    effect_rows,
    effect_values,
    effects,
    job_row,
    make_app,
    row_locked,
)

import duebox
from duebox.metrics import Metrics
from duebox.tables import job

pytestmark = pytest.mark.usefixtures("roomy_group_budget")


def _known_short(r: Running, *tasks: str) -> None:
    """As if these tasks had run short handlers here already (the lane
    takes a task's jobs only once it knows them to be short)."""
    for w in r.workers:
        for name in tasks:
            w.runner.policy.task_pace[name] = 0.0001


async def _leading(r: Running, app: duebox.Duebox) -> None:
    """Run one short job so the lane leads (it does once a delivery of a
    short task reached it): later due jobs are the lane's to lock."""
    warm = _due(app, 1)
    await r.wait(lambda: all_final(app.engine, warm), timeout=30, what="a warm-up job")
    claims = r.workers[0].broker.lane_claims()
    assert claims is not None
    assert claims.leading


# Slower than InnoDB's 0.1 s cache of innodb_trx (see _lock_waits).
LOCK_POLL = 0.15


def _lock_waits(app: duebox.Duebox) -> int:
    """Transactions of this database waiting for a row lock right now.

    MariaDB's ``information_schema.innodb_trx`` is a cache that InnoDB
    refreshes only when it has not been read for 0.1 s: polled faster, it
    shows the moment before the first read for ever (the cancel's wait was
    never seen, and the lane's transaction hit its idle bound).  Poll it
    with :data:`LOCK_POLL`."""
    with app.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            sql = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                   "AND datname = current_database()")
        else:
            sql = "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
        return int(conn.execute(sa.text(sql)).scalar_one())


def _due(app: duebox.Duebox, n: int, task: str = "effect", **kw: Any) -> list[uuid.UUID]:
    first = datetime.now(UTC) - timedelta(seconds=1)
    with app.engine.begin() as conn:
        return [app.schedule(conn, task, {"n": i}, at=first + timedelta(milliseconds=i), **kw)
                for i in range(n)]


def _unclaimed(app: duebox.Duebox, ids: list[uuid.UUID]) -> int:
    """Jobs that finished without a claim ever being written for them."""
    with app.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(job).where(
            job.c.id.in_(ids), job.c.state == "SUCCEEDED", job.c.claimed_at.is_(None)
        )).scalar_one())


async def test_a_due_backlog_runs_with_no_claim_written(server_url: str) -> None:
    app = make_app(server_url)
    ids = _due(app, 300)
    metrics = Metrics()
    async with Running(app, relays=1, workers=1, concurrency=4,
                       worker_kw={"metrics": metrics}) as r:
        _known_short(r, "effect")
        await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                     what="all 300 jobs to succeed")
    direct = r.worker_total("direct")
    assert direct > 0
    # The claimer's first claim may run the usual (claimed) way before the
    # lane leads; every other job was locked by the lane and no claim written.
    assert _unclaimed(app, ids) == direct
    calls = [c for c, _ in app.calls.log]  # type: ignore[attr-defined]
    assert sorted(calls) == sorted(str(j) for j in ids)  # each handler called once
    assert len(effect_rows(app.engine)) == 300
    # Every job observed once, whichever path ran it (the lane observes a
    # batch's jobs together).
    labels = {"backend": "sql", "queue": "default"}
    value = metrics.registry.get_sample_value
    assert value("duebox_jobs_succeeded_total", labels) == 300
    for histogram in ("duebox_start_lateness_seconds", "duebox_queue_wait_seconds",
                      "duebox_end_to_end_latency_seconds"):
        assert value(f"{histogram}_count", labels) == 300, histogram
        assert value(f"{histogram}_bucket", {**labels, "le": "+Inf"}) == 300, histogram
    for job_id in ids:
        row = job_row(app.engine, job_id)
        assert (row.state, row.attempt, row.lease_owner) == ("SUCCEEDED", 1, None)
        assert row.started_at >= row.due_at  # never early
        (a,) = attempt_rows(app.engine, job_id)
        assert (a.number, a.outcome) == (1, "succeeded")
        assert a.lease_generation == row.lease_generation
        assert a.started_at == row.started_at


async def test_jobs_of_other_tasks_are_leased_and_run_the_usual_way(server_url: str) -> None:
    """Due rows the lane locks but may not run itself — a task not known to
    be short, an ordering key — are leased in its transaction and delivered;
    each runs once, with a claim written."""
    app = make_app(server_url)
    first = datetime.now(UTC) - timedelta(seconds=1)
    with app.engine.begin() as conn:
        short = [app.schedule(conn, "effect", {"n": i}, at=first + timedelta(milliseconds=2 * i))
                 for i in range(60)]
        slow = [app.schedule(conn, "noop", {"n": i}, at=first + timedelta(milliseconds=2 * i + 1))
                for i in range(20)]
        keyed = [app.schedule(conn, "effect", {"k": i}, at=first + timedelta(milliseconds=200),
                              headers={"ordering_key": "acct-1"}) for i in range(5)]
    async with Running(app, relays=1, workers=1, concurrency=4,
                       worker_kw={"queues": ["default", "other"]}) as r:
        _known_short(r, "effect")
        r.workers[0].runner.policy.task_pace["noop"] = 60.0  # far beyond the budget
        await r.wait(lambda: all_final(app.engine, short + slow + keyed), timeout=60,
                     what="all 85 jobs to succeed")
    assert r.worker_total("direct") > 0
    calls = [c for c, _ in app.calls.log]  # type: ignore[attr-defined]
    assert sorted(calls) == sorted(str(j) for j in short + slow + keyed)
    for job_id in slow + keyed:  # never run by the lane: claimed, then run
        row = job_row(app.engine, job_id)
        assert row.claimed_at is not None
        assert [a.outcome for a in attempt_rows(app.engine, job_id)] == ["succeeded"]


async def test_a_cancel_waits_for_the_lanes_commit_and_finds_the_job_done(
        server_url: str) -> None:
    """The lane's row lock is the job's lease: a cancel issued while the
    handler runs waits for the lane's transaction (seen waiting on the row
    lock before the handler returns), then finds the job finished: it
    reports nothing cancelled, and the effect happened once."""
    app = make_app(server_url)
    started = threading.Event()
    waited: list[int] = []

    @app.task("slowish")
    def slowish(payload: Any, ctx: duebox.JobContext) -> None:
        started.set()
        deadline = time.monotonic() + 20
        while not _lock_waits(app) and time.monotonic() < deadline:
            time.sleep(LOCK_POLL)  # polling the server: no event crosses into it
        waited.append(_lock_waits(app))
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    outcome: dict[str, bool] = {}

    def cancel(job_id: uuid.UUID) -> None:
        assert started.wait(30)
        with app.engine.begin() as conn:
            outcome["cancelled"] = app.cancel(conn, job_id)

    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        _known_short(r, "effect", "slowish")
        await _leading(r, app)
        ids = _due(app, 1, "slowish")
        canceller = asyncio.create_task(asyncio.to_thread(cancel, ids[0]))
        await r.wait(lambda: all_final(app.engine, ids), timeout=60, what="the job to finish")
        await canceller
    assert r.worker_total("direct") == 1
    assert waited
    assert waited[0] >= 1
    assert outcome == {"cancelled": False}
    assert job_row(app.engine, ids[0]).state == "SUCCEEDED"
    assert str(ids[0]) in effect_rows(app.engine)


async def test_a_row_another_transaction_holds_is_skipped_then_run_once(
        server_url: str) -> None:
    app = make_app(server_url)
    ids = _due(app, 12)
    held = ids[5]
    with row_locked(app.engine, held) as release:
        async with Running(app, relays=1, workers=1, concurrency=4) as r:
            _known_short(r, "effect")
            others = [j for j in ids if j != held]
            await r.wait(lambda: all_final(app.engine, others), timeout=60,
                         what="the 11 unlocked jobs to succeed")
            assert job_row(app.engine, held).state == "SCHEDULED"
            release()
            await r.wait(lambda: all_final(app.engine, [held]), timeout=60,
                         what="the once-locked job to succeed")
    assert r.worker_total("direct") > 0
    assert [c for c, _ in app.calls.log].count(str(held)) == 1  # type: ignore[attr-defined]
    assert len(effect_rows(app.engine)) == 12


async def test_due_jobs_past_their_expiry_are_expired_not_run(server_url: str) -> None:
    app = make_app(server_url)
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        _known_short(r, "effect")
        await _leading(r, app)
        now = datetime.now(UTC)
        with app.engine.begin() as conn:
            gone = [app.schedule(conn, "effect", {"gone": i}, at=now - timedelta(seconds=2),
                                 expires_at=now - timedelta(seconds=1)) for i in range(10)]
        live = _due(app, 30)
        await r.wait(lambda: all_final(app.engine, live), timeout=60,
                     what="the 30 live jobs to succeed")
        await r.wait(lambda: all_final(app.engine, gone, "EXPIRED"), timeout=60,
                     what="the 10 expired jobs to be expired")
    assert r.worker_total("direct") > 0
    ran = {c for c, _ in app.calls.log}  # type: ignore[attr-defined]
    assert not ran & {str(j) for j in gone}
    assert {str(j) for j in live} <= ran


async def test_the_lane_hands_back_when_most_due_jobs_are_not_its_own(
        server_url: str) -> None:
    """Leading, the lane locks due rows of every task; when most of a batch
    were not its to run, it stops leading and the claimer claims again."""
    app = make_app(server_url)
    async with Running(app, relays=1, workers=1, concurrency=4,
                       worker_kw={"queues": ["default", "other"]}) as r:
        _known_short(r, "effect")
        r.workers[0].runner.policy.task_pace["noop"] = 60.0
        claims = r.workers[0].broker.lane_claims()
        assert claims is not None
        turns: list[bool] = []
        leads = claims.leads

        def recorded(on: bool) -> None:
            turns.append(on)
            leads(on)

        claims.leads = recorded  # type: ignore[method-assign]
        first = _due(app, 40)
        await r.wait(lambda: all_final(app.engine, first), timeout=60,
                     what="the short jobs to succeed")
        assert claims.leading
        turns.clear()
        slow = _due(app, 40, "noop")
        await r.wait(lambda: all_final(app.engine, slow), timeout=60,
                     what="the other task's jobs to succeed")
    # The lane let go once it had locked a batch mostly of the other task's
    # jobs (it may lead again later: a task's pace is learnt as it runs).
    assert turns[:1] == [False], turns
    assert all(job_row(app.engine, j).claimed_at is not None for j in slow)
    calls = [c for c, _ in app.calls.log]  # type: ignore[attr-defined]
    assert sorted(calls) == sorted(str(j) for j in first + slow)
