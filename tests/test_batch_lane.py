"""The batch lane (consumers/lane.py, core/unstarted.py): due deliveries of
groupable tasks locked, run and completed in one transaction, with no start
transaction before it.

Each test runs a real relay and worker on a real broker (Redis) and a real
database server (PostgreSQL and MariaDB: the lane does not run on SQLite),
checks that the lane ran the jobs (``stats.laned``) and then what must hold
whichever path a job took: its effect exactly once, one attempt row per
run, a failure retried with a new version, a cancelled or locked job never
run by the lane."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from backends import Keys
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
from duebox.consumers.lane import Lane
from duebox.tables import job
from duebox.tasks import RetryPolicy

FAST_RETRY = RetryPolicy(base=0.05, cap=0.1)


pytestmark = pytest.mark.usefixtures("roomy_group_budget")


def seen_short_handlers(r: Running) -> None:
    """As if every task had run short handlers here already: the lane takes a
    task's jobs only once it knows them to be short (the first ones go the
    usual way).  Call before the first await."""
    for w in r.workers:
        for name in w.app.tasks:
            w.executors.task_pace[name] = 0.0001


def _app(server_url: str, redis_keys: Keys) -> duebox.Duebox:
    return make_app(server_url, redis_keys.url())


def _schedule_due(app: duebox.Duebox, n: int, task: str = "effect",
                  **kw: Any) -> list[uuid.UUID]:
    first = datetime.now(UTC) - timedelta(seconds=1)
    with app.engine.begin() as conn:
        return [app.schedule(conn, task, {"n": i}, at=first + timedelta(milliseconds=i), **kw)
                for i in range(n)]


@pytest.mark.parametrize("broker", ["redis", "sql"])
async def test_a_backlog_runs_in_the_lane_each_job_once(server_url: str, redis_keys: Keys,
                                                        broker: str) -> None:
    """On a broker the lane starts nothing before it runs; on ``sql://`` the
    backend claimed the jobs and the lane runs them as groups."""
    app = make_app(server_url, redis_keys.url() if broker == "redis" else "sql://")
    ids = _schedule_due(app, 120)
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        seen_short_handlers(r)
        assert r.workers[0].lane is not None
        await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                     what="all 120 jobs to succeed")
    assert r.worker_total("laned") > 0
    assert sorted(app.calls.log) == sorted(set(app.calls.log))  # type: ignore[attr-defined]
    assert len(effect_rows(app.engine)) == 120
    attempts = attempt_rows(app.engine)
    assert len(attempts) == 120
    assert {a.outcome for a in attempts} == {"succeeded"}
    for job_id in ids:
        row = job_row(app.engine, job_id)
        assert row.state == "SUCCEEDED"
        assert row.attempt == 1
        assert row.lease_owner is None
        assert row.started_at >= row.due_at  # never early
        assert row.finished_at >= row.started_at
        (a,) = attempt_rows(app.engine, job_id)
        assert a.number == 1
        assert a.lease_generation == row.lease_generation
        assert a.started_at == row.started_at


async def test_a_failure_in_the_lane_is_retried_with_a_new_version(
        server_url: str, redis_keys: Keys) -> None:
    app = _app(server_url, redis_keys)
    tries: dict[int, int] = {}
    lock = threading.Lock()

    @app.task("flaky", retry=FAST_RETRY)
    def flaky(payload: Any, ctx: duebox.JobContext) -> None:
        with lock:
            tries[payload["n"]] = tries.get(payload["n"], 0) + 1
            first = tries[payload["n"]] == 1
        ctx.session.execute(effects.insert().values(effect_values(ctx)))
        if first and payload["n"] % 3 == 0:
            ctx.checkpoint({"at": payload["n"]})
            raise RuntimeError(f"first try of {payload['n']} fails")

    ids = _schedule_due(app, 30, "flaky")
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        seen_short_handlers(r)
        await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                     what="all 30 jobs to succeed, the failed ones on their retry")
    assert r.worker_total("laned") > 0
    assert len(effect_rows(app.engine)) == 30  # the failed tries' writes rolled back
    for n, job_id in enumerate(ids):
        row = job_row(app.engine, job_id)
        outcomes = [a.outcome for a in attempt_rows(app.engine, job_id)]
        if n % 3 == 0:
            assert outcomes == ["failed", "succeeded"]
            assert row.version == 2
            assert row.attempt == 2
            assert row.checkpoint == {"at": n}  # kept though its savepoint rolled back
            failed = attempt_rows(app.engine, job_id)[0]
            assert "first try of" in (failed.error or "")
        else:
            assert outcomes == ["succeeded"]
            assert row.version == 1
            assert row.attempt == 1


async def test_a_job_cancelled_after_publish_is_not_run(server_url: str,
                                                        redis_keys: Keys) -> None:
    """Published (ENQUEUED, its message on the stream), then cancelled before
    any worker runs: the lane's version-checked lock finds no startable row
    and the usual path discards the message."""
    app = _app(server_url, redis_keys)
    ids = _schedule_due(app, 20)
    async with Running(app, relays=1, workers=0) as r:
        await r.wait(lambda: _count(app, "ENQUEUED") == 20, timeout=30,
                     what="the relay to publish all 20 jobs")
    cancelled = ids[::2]
    with app.engine.begin() as conn:
        for job_id in cancelled:
            assert app.cancel(conn, job_id)
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        seen_short_handlers(r)
        await r.wait(lambda: all_final(app.engine, ids[1::2]), timeout=60,
                     what="the 10 jobs left to succeed")
        await r.wait(lambda: r.worker_total("duplicates") >= 10, timeout=30,
                     what="the 10 cancelled jobs' messages to be discarded")
    ran = {job_id for job_id, _ in app.calls.log}  # type: ignore[attr-defined]
    assert ran == {str(j) for j in ids[1::2]}
    assert all(job_row(app.engine, j).state == "CANCELLED" for j in cancelled)


async def test_a_row_locked_elsewhere_is_skipped_then_run_once(server_url: str,
                                                               redis_keys: Keys) -> None:
    """A job row another transaction holds is not waited for by the lane (SKIP
    LOCKED): it goes the usual way, which waits, and runs it once when the
    lock goes."""
    app = _app(server_url, redis_keys)
    ids = _schedule_due(app, 10)
    held = ids[4]
    async with Running(app, relays=1, workers=0) as r:
        await r.wait(lambda: _count(app, "ENQUEUED") == 10, timeout=30,
                     what="the relay to publish all 10 jobs")
    with row_locked(app.engine, held) as release:
        async with Running(app, relays=1, workers=1, concurrency=4) as r:
            seen_short_handlers(r)
            others = [j for j in ids if j != held]
            await r.wait(lambda: all_final(app.engine, others), timeout=60,
                         what="the 9 unlocked jobs to succeed")
            assert job_row(app.engine, held).state == "ENQUEUED"
            release()
            await r.wait(lambda: all_final(app.engine, [held]), timeout=60,
                         what="the once-locked job to succeed")
    assert r.worker_total("laned") > 0
    assert [c for c, _ in app.calls.log].count(str(held)) == 1  # type: ignore[attr-defined]
    assert len(effect_rows(app.engine)) == 10


async def test_jobs_with_an_ordering_key_keep_the_usual_path(server_url: str,
                                                             redis_keys: Keys) -> None:
    app = _app(server_url, redis_keys)
    first = datetime.now(UTC) - timedelta(seconds=1)
    with app.engine.begin() as conn:
        ids = [app.schedule(conn, "effect", {"n": i}, at=first + timedelta(milliseconds=i),
                            headers={"ordering_key": "account-7"}) for i in range(10)]
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        seen_short_handlers(r)
        await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                     what="all 10 keyed jobs to succeed")
    assert r.worker_total("laned") == 0
    ran = [c for c, _ in app.calls.log]  # type: ignore[attr-defined]
    # Each once.  (Their order is the usual path's, tested with the
    # backends' ordering contracts.)
    assert sorted(ran) == sorted(str(j) for j in ids)


def test_the_lane_runs_only_where_it_is_safe(redis_keys: Keys, tmp_path: Any) -> None:
    app = make_app(f"sqlite:///{tmp_path}/d.db", redis_keys.url())
    broker = app.broker("t")
    assert not Lane.enabled(broker, "sqlite", 8, 32)  # write lock after the read
    assert not Lane.enabled(broker, "postgresql", 1, 32)  # one line for every delivery
    assert not Lane.enabled(broker, "postgresql", 8, 1)  # group commit off
    assert Lane.enabled(broker, "postgresql", 8, 32)
    memory = make_app(f"sqlite:///{tmp_path}/m.db", "memory://lane").broker("t")
    assert not Lane.enabled(memory, "postgresql", 8, 32)  # no redelivery of the unacked
    sqs = make_app(f"sqlite:///{tmp_path}/s.db", "sqs://k:s@127.0.0.1:9?prefix=t").broker("t")
    assert not Lane.enabled(sqs, "postgresql", 8, 32)  # back only after a visibility timeout


def _count(app: duebox.Duebox, state: str) -> int:
    with app.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(job)
                                .where(job.c.state == state)).scalar_one())


async def test_a_task_not_known_to_be_short_keeps_the_usual_path(
        server_url: str, redis_keys: Keys) -> None:
    """Its handler would hold the batch's row locks (the leases) while it
    runs: a task whose handlers take longer than the group budget, or that
    has not run here yet, is started and heartbeated the usual way."""
    app = _app(server_url, redis_keys)
    ids = _schedule_due(app, 10)
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        r.workers[0].executors.task_pace["effect"] = 60.0  # beyond even the roomy budget
        await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                     what="all 10 slow-task jobs to succeed")
    assert r.worker_total("laned") == 0
    assert r.worker_total("succeeded") == 10
