"""The batch lane (consumers/runner.py, consumers/batch.py,
core/leases/batch_sql.py): due deliveries of
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
from duebox.brokers.base import BrokerContext, Outgoing
from duebox.consumers.runner import Runner
from duebox.message import JobMessage
from duebox.registry import broker_class
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
            w.runner.policy.task_pace[name] = 0.0001


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
        assert r.workers[0].runner.lane
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
    assert not Runner.lane_enabled(broker, "sqlite", 8, 32)  # write lock after the read
    assert not Runner.lane_enabled(broker, "postgresql", 1, 32)  # one line for every delivery
    assert not Runner.lane_enabled(broker, "postgresql", 8, 1)  # group commit off
    assert Runner.lane_enabled(broker, "postgresql", 8, 32)
    memory = make_app(f"sqlite:///{tmp_path}/m.db", "memory://lane").broker("t")
    assert not Runner.lane_enabled(memory, "postgresql", 8, 32)  # no redelivery of the unacked
    sqs = make_app(f"sqlite:///{tmp_path}/s.db", "sqs://k:s@127.0.0.1:9?prefix=t").broker("t")
    assert not Runner.lane_enabled(sqs, "postgresql", 8, 32)  # back only after a visibility timeout


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
        r.workers[0].runner.policy.task_pace["effect"] = 60.0  # beyond even the roomy budget
        await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                     what="all 10 slow-task jobs to succeed")
    assert r.worker_total("laned") == 0
    assert r.worker_total("succeeded") == 10


# --- deliveries handed over ahead of their due time ------------------------------------


def _schedule_ahead(app: duebox.Duebox, n: int, seconds: float, task: str = "ahead",
                    spacing_ms: float = 7.0) -> list[tuple[uuid.UUID, datetime]]:
    first = datetime.now(UTC) + timedelta(seconds=seconds)
    with app.engine.begin() as conn:
        out = []
        for i in range(n):
            due = first + timedelta(milliseconds=i * spacing_ms)
            out.append((app.schedule(conn, task, {"due": due.timestamp()}, at=due), due))
        return out


def _timed_task(app: duebox.Duebox) -> dict[str, float]:
    """A task that notes, first thing, when its handler started (wall clock)."""
    began: dict[str, float] = {}

    @app.task("ahead")
    def ahead(payload: Any, ctx: duebox.JobContext) -> None:
        began[str(ctx.job_id)] = datetime.now(UTC).timestamp()
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    return began


@pytest.mark.parametrize("broker", ["redis", "sql"])
async def test_deliveries_handed_over_ahead_run_in_the_lane_never_early(
        server_url: str, redis_keys: Keys, broker: str) -> None:
    """Redis hands a job to its stream 30 ms before its due time, ``sql://``
    its claimed job to the worker 5 ms before: the lane holds it, locks it
    with its batch a moment before the due time and holds the handler to it
    — one transaction, no start (or, on ``sql://``, handler) transaction of
    its own."""
    app = make_app(server_url, redis_keys.url() if broker == "redis" else "sql://")
    began = _timed_task(app)
    jobs = _schedule_ahead(app, 30, 1.5)
    ids = [j for j, _ in jobs]
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        seen_short_handlers(r)
        await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                     what="all 30 jobs to succeed")
    assert r.worker_total("laned") == 30, "each one held and run by the lane"
    for job_id, due in jobs:
        assert began[str(job_id)] >= due.timestamp(), "started before its due time"
        row = job_row(app.engine, job_id)
        assert (row.state, row.attempt) == ("SUCCEEDED", 1)
        assert row.started_at >= row.due_at
        (a,) = attempt_rows(app.engine, job_id)
        assert a.outcome == "succeeded"
    assert len(effect_rows(app.engine)) == 30


@pytest.fixture
def early_handover(monkeypatch: pytest.MonkeyPatch) -> float:
    """Redis's mover and ``sql://``'s claimer hand jobs over 3 s ahead and
    the lane holds that long: a window a test can act in (30 and 5 ms by
    default), wide enough for a relay and mover slowed by a loaded machine
    (at 1.5 s, CI at load 30 once reached the window after it closed)."""
    import duebox.brokers.redis_mover as mover
    import duebox.brokers.sql as sql
    import duebox.consumers.runner as lane
    monkeypatch.setattr(mover, "MOVE_LEAD_MS", 3000.0)
    monkeypatch.setattr(sql, "_HAND_OVER", timedelta(seconds=3.0))
    monkeypatch.setattr(lane, "LANE_HOLD_MOST", timedelta(seconds=5))
    return 3.0


@pytest.mark.parametrize("broker", ["redis", "sql"])
async def test_a_cancel_committed_while_the_lane_holds_a_delivery_wins(
        server_url: str, redis_keys: Keys, early_handover: float, broker: str) -> None:
    """Redis: the lane's version-checked lock finds the job cancelled;
    ``sql://`` (the claim leased it): the group's lease check does."""
    app = make_app(server_url, redis_keys.url() if broker == "redis" else "sql://")
    began = _timed_task(app)
    jobs = _schedule_ahead(app, 6, early_handover + 1.0)
    ids = [j for j, _ in jobs]
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        seen_short_handlers(r)
        lane = r.workers[0].runner
        assert lane.lane
        await r.wait(lambda: len(lane) == 6, timeout=30,
                     what="the lane to hold all 6 deliveries")
        cancelled = sorted(ids[::2])
        with app.engine.begin() as conn:
            for job_id in cancelled:
                assert app.cancel(conn, job_id)
        kept = [j for j in ids if j not in cancelled]
        await r.wait(lambda: all_final(app.engine, kept), timeout=30,
                     what="the 3 jobs left to succeed")
        await r.wait(lambda: r.worker_total("duplicates") >= 3, timeout=30,
                     what="the 3 cancelled jobs' messages to be discarded")
    assert set(began) == {str(j) for j in kept}
    assert all(job_row(app.engine, j).state == "CANCELLED" for j in cancelled)
    for job_id, due in jobs:
        if job_id in kept:
            assert began[str(job_id)] >= due.timestamp(), "started before its due time"


async def test_a_worker_stopped_while_holding_runs_its_deliveries_at_their_due_time(
        server_url: str, redis_keys: Keys, early_handover: float) -> None:
    """Stopping drains the lane: what it holds is locked and run, each
    handler held to its due time, not dropped for the broker to redeliver."""
    app = _app(server_url, redis_keys)
    began = _timed_task(app)
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        seen_short_handlers(r)
        lane = r.workers[0].runner
        assert lane.lane
        # Scheduled once the relay and worker run (their start on a loaded
        # machine must not eat the window in which the lane holds them).
        jobs = _schedule_ahead(app, 3, early_handover + 1.0)
        await r.wait(lambda: len(lane) == 3, timeout=30, what="the lane to hold all 3")
    # The worker has stopped: each ran in its drain, none early.
    for job_id, due in jobs:
        assert job_row(app.engine, job_id).state == "SUCCEEDED"
        assert began[str(job_id)] >= due.timestamp(), "started before its due time"
    assert r.worker_total("laned") == 3


async def test_forged_messages_handed_over_ahead_run_nothing(
        server_url: str, redis_keys: Keys) -> None:
    """Messages a moment ahead that the job table contradicts: one for a job
    that does not exist, and one with a real job's id and version claiming
    it is due now when its row is due tomorrow.  The lane holds both, its
    lock finds neither (the row's ``due_at`` is the condition, not the
    message's), and the usual path rejects the first and defers the second:
    no handler runs."""
    app = _app(server_url, redis_keys)
    began = _timed_task(app)
    tomorrow = datetime.now(UTC) + timedelta(days=1)
    with app.engine.begin() as conn:
        real = app.schedule(conn, "ahead", {"due": tomorrow.timestamp()}, at=tomorrow)
    url = app.settings.broker_url
    forger = broker_class(url)(url, BrokerContext(app.engine, app.clock, app.settings))
    soon = datetime.now(UTC) + timedelta(seconds=1.5)
    try:
        sent = await forger.publish([
            Outgoing(JobMessage(uuid.uuid4(), "ahead", "default", 1, 0, soon), 1.5),
            Outgoing(JobMessage(real, "ahead", "default", 1, 0, soon), 1.5)])
        assert all(r.ok for r in sent)
    finally:
        await forger.close()
    async with Running(app, relays=0, workers=1, concurrency=4) as r:
        seen_short_handlers(r)
        await r.wait(lambda: r.discarded.get("unknown_job", 0) >= 1
                     and r.worker_total("deferred") >= 1, timeout=30,
                     what="the unknown job's message rejected and the real one's deferred")
    assert began == {}
    assert r.worker_total("laned") == 0
    row = job_row(app.engine, real)
    assert (row.state, row.attempt) == ("SCHEDULED", 0)
    assert attempt_rows(app.engine, real) == []


async def test_a_forged_version_beyond_the_column_does_not_fail_its_batch(
        server_url: str, redis_keys: Keys, caplog: pytest.LogCaptureFixture) -> None:
    """A message naming a real job with version 10**30, in the stream before
    20 real jobs (issue #36): the lane's lock query took it as a parameter
    and PostgreSQL refused the whole batch (NumericValueOutOfRange, the SQL
    logged at WARNING).  The version is bounded where the message is
    decoded, so it is discarded as undecodable and the batch runs."""
    import redis

    app = _app(server_url, redis_keys)
    ids = _schedule_due(app, 20)
    forged = JobMessage(ids[0], "effect", "default", 10**30, 0, datetime.now(UTC),
                        {"n": "forged"})
    with redis.Redis.from_url(redis_keys.url().split("?")[0]) as client:
        client.xadd(redis_keys.k("ready"), {"id": str(ids[0]), "v": "1",
                                            "body": forged.encode()})
    async with Running(app, relays=1, workers=0) as r:
        await r.wait(lambda: redis_keys.stream_len() == 21, timeout=30,
                     what="the real jobs published behind the forged message")
    with caplog.at_level("WARNING"):
        async with Running(app, relays=0, workers=1, concurrency=4) as r:
            seen_short_handlers(r)
            await r.wait(lambda: all_final(app.engine, ids), timeout=60,
                         what="all 20 real jobs to succeed")
            await r.wait(lambda: r.discarded.get("undecodable", 0) == 1, timeout=30,
                         what="the forged message discarded as undecodable")
    assert r.worker_total("laned") == 20
    assert len(effect_rows(app.engine)) == 20
    assert not [rec for rec in caplog.records if "out of range" in rec.getMessage()]
