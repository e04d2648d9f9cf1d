"""The job state machine (duebox.leases.jobstore): every transition is one
conditional statement, and a write that lost a race changes nothing.  Also:
the Alembic migrations create exactly the tables in duebox.tables."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from helpers import attempt_rows, job_row, make_app, observer

import duebox
from duebox import FakeClock, JobState, migrate
from duebox.leases import claims, dispatch_marks, jobstore, recovery
from duebox.tables import job

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def app(database_url: str) -> Iterator[duebox.Duebox]:
    a = make_app(database_url, clock=FakeClock(T0))
    yield a
    a.dispose()


def add(app: duebox.Duebox, *delays: float, **kw: object) -> list[uuid.UUID]:
    ids = []
    with app.engine.begin() as conn:
        for d in delays:
            ids.append(app.schedule(conn, "effect", delay=d, **kw))
    return ids  # type: ignore[return-value]


def dispatch(app: duebox.Duebox, owner: str, *, now: float = 0, horizon: float = 3600,
             limit: int = 100, lease: float = 30) -> list[jobstore.JobRecord]:
    with app.engine.begin() as conn:
        return claims.claim_for_dispatch(
            conn, owner=owner, horizon=at(horizon), limit=limit, now=at(now),
            lease_until=at(now + lease),
        )


def run_claim(app: duebox.Duebox, owner: str, *, now: float = 0, limit: int = 100,
              lease: float = 30, queues: list[str] | None = None) -> list[jobstore.JobRecord]:
    with app.engine.begin() as conn:
        return claims.claim_for_run(
            conn, owner=owner, now=at(now), limit=limit, lease_until=at(now + lease),
            queues=queues, worker=owner.split("#")[0],
        )


def start(app: duebox.Duebox, msg: duebox.JobMessage, owner: str, *, now: float,
          lease: float = 30) -> tuple[jobstore.JobRecord | None, str]:
    with app.engine.begin() as conn:
        rec = jobstore.start(conn, message=msg, owner=owner, now=at(now),
                             lease_until=at(now + lease), worker=owner)
        return rec, ("started" if rec else jobstore.why_not_started(conn, msg, at(now)))


def recover(app: duebox.Duebox, now: float, *, margin: float = 2,
            redeliver_after: float = 900) -> recovery.Recovered:
    with app.engine.begin() as conn:
        return recovery.recover(conn, now=at(now), margin=margin,
                                redeliver_after=redeliver_after, limit=1000)


def execute(app: duebox.Duebox, stmt: sa.Executable, params: dict[str, Any] | None = None
            ) -> int:
    with app.engine.begin() as conn:
        return int(conn.execute(stmt, params).rowcount)


# --- the relay's claim ------------------------------------------------------------


def test_claim_for_dispatch_takes_due_jobs_in_due_order_up_to_the_limit(
    app: duebox.Duebox,
) -> None:
    late, soon, now_, far = add(app, 50, 5, 0, 10_000)
    cancelled = add(app, 1)[0]
    with app.engine.begin() as conn:
        app.cancel(conn, cancelled)
    recs = dispatch(app, "relay#1", horizon=100, limit=2)
    assert [r.id for r in recs] == [now_, soon]
    for r in recs:
        row = job_row(app.engine, r.id)
        assert row.state == JobState.DISPATCHING
        assert (row.lease_owner, row.lease_until, row.lease_generation) == ("relay#1", at(30), 1)
        assert r.lease_owner == "relay#1"
        assert r.lease_generation == 1
    recs = dispatch(app, "relay#2", horizon=100)
    assert [r.id for r in recs] == [late]  # beyond the horizon stays parked
    assert job_row(app.engine, far).state == JobState.SCHEDULED
    assert job_row(app.engine, cancelled).state == JobState.CANCELLED
    assert dispatch(app, "relay#3", horizon=100) == []


@pytest.mark.postgres
def test_concurrent_claims_skip_each_others_locked_rows(pg_server_url: str) -> None:
    from conftest import reset_tables

    reset_tables(pg_server_url)
    app = make_app(pg_server_url, clock=FakeClock(T0))
    try:
        ids = set(add(app, *range(10)))
        with app.engine.connect() as first:
            first.begin()
            a = claims.claim_for_dispatch(first, owner="a", horizon=at(100), limit=6,
                                            now=T0, lease_until=at(30))
            # ``first`` is still open and holds its row locks: the second relay
            # must neither wait for them nor take the same rows.
            with app.engine.connect() as second:
                second.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
                b = claims.claim_for_dispatch(second, owner="b", horizon=at(100), limit=10,
                                                now=T0, lease_until=at(30))
                second.commit()
            first.commit()
        assert len(a) == 6
        assert len(b) == 4
        assert {r.id for r in a} | {r.id for r in b} == ids
    finally:
        app.dispose()


def test_mark_enqueued_is_fenced_by_the_claim_owner(app: duebox.Duebox) -> None:
    ids = add(app, 0, 1)
    dispatch(app, "relay#1")
    with app.engine.begin() as conn:
        assert dispatch_marks.mark_enqueued(conn, owner="relay#2", ids=ids, now=at(1)) == 0
    assert {job_row(app.engine, i).state for i in ids} == {JobState.DISPATCHING}
    with app.engine.begin() as conn:
        n = dispatch_marks.mark_enqueued(conn, owner="relay#1", ids=ids, now=at(1),
                                   broker_ids={ids[0]: "m-0", ids[1]: "m-1"})
    assert n == 2
    for i, job_id in enumerate(ids):
        row = job_row(app.engine, job_id)
        assert (row.state, row.lease_owner, row.lease_until) == (JobState.ENQUEUED, None, None)
        assert (row.published_at, row.broker_message_id) == (at(1), f"m-{i}")
    with app.engine.begin() as conn:  # a second mark finds nothing to move
        assert dispatch_marks.mark_enqueued(conn, owner="relay#1", ids=ids, now=at(2)) == 0


def test_release_and_expire_only_touch_the_owners_rows(app: duebox.Duebox) -> None:
    a, b = add(app, 0, 0)
    dispatch(app, "relay#1", limit=1)
    dispatch(app, "relay#2", limit=1)
    with app.engine.begin() as conn:
        assert dispatch_marks.release(conn, owner="relay#1", ids=[a, b], now=at(1)) == 1
        assert dispatch_marks.expire(conn, owner="relay#1", ids=[a, b], now=at(1)) == 0
        assert dispatch_marks.expire(conn, owner="relay#2", ids=[a, b], now=at(1)) == 1
    assert job_row(app.engine, a).state == JobState.SCHEDULED
    assert job_row(app.engine, a).lease_owner is None
    assert job_row(app.engine, b).state == JobState.EXPIRED


def test_next_due_is_the_earliest_scheduled_job(app: duebox.Duebox) -> None:
    with app.engine.connect() as conn:
        assert claims.next_due(conn) is None
    add(app, 30, 7, 90)
    dispatch(app, "relay#1", horizon=10)  # takes the one due at 7
    with app.engine.connect() as conn:
        assert claims.next_due(conn) == at(30)


# --- recovery -----------------------------------------------------------------------


def test_recover_returns_an_expired_dispatch_lease_after_the_margin(app: duebox.Duebox) -> None:
    [job_id] = add(app, 0)
    dispatch(app, "dead-relay#1", lease=10)
    assert recover(app, 11.5, margin=2).total == 0  # expired, but within the skew margin
    assert job_row(app.engine, job_id).state == JobState.DISPATCHING
    assert recover(app, 12.5, margin=2).dispatching == 1
    row = job_row(app.engine, job_id)
    assert (row.state, row.lease_owner, row.lease_until) == (JobState.SCHEDULED, None, None)
    assert row.version == 1  # the relay never published: its message cannot exist
    [again] = dispatch(app, "relay#2", now=13)
    assert again.id == job_id
    assert again.lease_generation == 2


def test_recover_counts_a_vanished_worker_as_a_lost_attempt(app: duebox.Duebox) -> None:
    [job_id] = add(app, 0)
    run_claim(app, "dead-worker#1", lease=5)
    assert recover(app, 4).total == 0
    rec = recover(app, 8)
    assert (rec.running, rec.dead) == (1, 0)
    row = job_row(app.engine, job_id)
    assert (row.state, row.attempt, row.error_class) == (JobState.SCHEDULED, 1, "lost")
    assert [(a.number, a.outcome) for a in attempt_rows(app.engine, job_id)] == [(1, "lost")]


def test_recover_dead_letters_a_job_whose_attempts_are_used_up(app: duebox.Duebox) -> None:
    app.add_task("three-tries", lambda payload, ctx: None, max_attempts=3)
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "three-tries")
    for i in range(3):  # the task's max_attempts
        assert len(run_claim(app, f"dead-worker#{i}", now=100 * i, lease=5)) == 1
        recover(app, 100 * i + 50)
    row = job_row(app.engine, job_id)
    assert (row.state, row.attempt, row.error_class) == (JobState.DEAD, 3, "lost")
    assert [a.outcome for a in attempt_rows(app.engine, job_id)] == ["lost"] * 3
    assert run_claim(app, "worker#9", now=1000) == []


def test_recover_republishes_an_enqueued_job_nobody_started(app: duebox.Duebox) -> None:
    [job_id] = add(app, 10)
    dispatch(app, "relay#1")
    with app.engine.begin() as conn:
        dispatch_marks.mark_enqueued(conn, owner="relay#1", ids=[job_id], now=T0)
    assert recover(app, 10 + 59, redeliver_after=60).total == 0
    assert recover(app, 10 + 61, redeliver_after=60).enqueued == 1
    assert job_row(app.engine, job_id).state == JobState.SCHEDULED


def test_recover_waits_redeliver_after_again_after_a_republish(app: duebox.Duebox) -> None:
    """Found by the soak: measured from the due time alone, an overdue job
    was republished on every recovery pass, flooding the broker."""
    [job_id] = add(app, 10)
    dispatch(app, "relay#1")
    with app.engine.begin() as conn:
        dispatch_marks.mark_enqueued(conn, owner="relay#1", ids=[job_id], now=T0)
    assert recover(app, 10 + 61, redeliver_after=60).enqueued == 1
    dispatch(app, "relay#2", now=10 + 61)
    with app.engine.begin() as conn:  # republished at 71 s
        dispatch_marks.mark_enqueued(conn, owner="relay#2", ids=[job_id],
                               now=at(10 + 61))
    assert recover(app, 10 + 62, redeliver_after=60).total == 0
    assert recover(app, 10 + 61 + 59, redeliver_after=60).total == 0
    assert recover(app, 10 + 61 + 61, redeliver_after=60).enqueued == 1


# --- the worker's start and completion -----------------------------------------------


def test_start_checks_version_state_due_time_and_expiry(app: duebox.Duebox) -> None:
    due, cancelled, moved, expiring = add(app, 10, 10, 10, 10)
    with app.engine.begin() as conn:
        conn.execute(sa.update(job).where(job.c.id == expiring).values(expires_at=at(20)))
    recs = {r.id: r for r in dispatch(app, "relay#1")}
    msgs = {i: r.to_message() for i, r in recs.items()}
    with app.engine.begin() as conn:
        app.cancel(conn, cancelled)
        app.reschedule(conn, moved, delay=10)
    forged = duebox.JobMessage(uuid.uuid4(), "effect", "default", 1, 0, T0)

    assert start(app, msgs[due], "w#1", now=9.9) == (None, "not_due")
    assert start(app, msgs[cancelled], "w#1", now=11) == (None, "cancelled")
    assert start(app, msgs[moved], "w#1", now=11) == (None, "stale_version")
    assert start(app, msgs[expiring], "w#1", now=21) == (None, "expired")
    assert start(app, forged, "w#1", now=11) == (None, "unknown_job")

    # The relay's mark has not landed yet: a DISPATCHING job may start.
    rec, why = start(app, msgs[due], "w#1", now=10)
    assert why == "started"
    assert rec is not None
    assert (rec.attempt, rec.lease_owner, rec.lease_generation) == (1, "w#1", 2)
    assert start(app, msgs[due], "w#2", now=10) == (None, "already_running")
    row = job_row(app.engine, due)
    assert (row.state, row.attempt, row.started_at) == (JobState.RUNNING, 1, at(10))
    [att] = attempt_rows(app.engine, due)
    assert (att.id, att.number, att.outcome, att.lease_generation) == (
        rec.attempt_id, 1, None, 2)


def test_a_started_job_given_back_with_its_message_is_not_published_again(
        app: duebox.Duebox) -> None:
    """Every thread of a worker runs a long handler: a job it started and
    could not run goes back with its broker message (Broker.hand_back).
    Back to SCHEDULED, a relay published it a second time: two messages for
    one job, the later discarded by whichever worker got it (CI saw four
    such discards in the SIGTERM test on SQS).  ENQUEUED, published now:
    no relay claim, the message it carries starts it, and recovery waits
    redeliver_after from the give-back."""
    [job_id] = add(app, 10)
    [claimed] = dispatch(app, "relay#1")
    with app.engine.begin() as conn:
        dispatch_marks.mark_enqueued(conn, owner="relay#1", ids=[job_id], now=T0)
    msg = claimed.to_message()
    rec, _ = start(app, msg, "w#1", now=100)
    assert rec is not None
    with app.engine.begin() as conn:
        assert jobstore.unclaim_run(conn, records=[rec], now=at(100), message_back=True) == 1
        assert jobstore.unclaim_run(conn, records=[rec], now=at(100)) == 0  # fenced
    row = job_row(app.engine, job_id)
    assert (row.state, row.attempt, row.lease_owner, row.published_at) == (
        JobState.ENQUEUED, 0, None, at(100))
    assert attempt_rows(app.engine, job_id) == []  # the unopened attempt is gone
    assert dispatch(app, "relay#2", now=100) == []  # not published a second time
    assert recover(app, 100 + 59, redeliver_after=60).total == 0
    again, why = start(app, msg, "w#2", now=101)  # the message handed back starts it
    assert why == "started"
    assert again is not None
    assert again.attempt == 1


def test_a_job_whose_broker_kept_its_message_goes_back_to_the_relay(
        app: duebox.Duebox) -> None:
    """The broker refused the hand-back (the worker acks the message): the
    job ENQUEUED for it is requeued for a relay, fenced by state and
    version."""
    [job_id] = add(app, 10)
    [claimed] = dispatch(app, "relay#1")
    rec, _ = start(app, claimed.to_message(), "w#1", now=100)
    assert rec is not None
    with app.engine.begin() as conn:
        jobstore.unclaim_run(conn, records=[rec], now=at(100), message_back=True)
        assert jobstore.requeue_handed_back(conn, rec=rec, now=at(100)) == 1
        assert jobstore.requeue_handed_back(conn, rec=rec, now=at(100)) == 0
    assert job_row(app.engine, job_id).state == JobState.SCHEDULED
    assert [r.id for r in dispatch(app, "relay#2", now=100)] == [job_id]


def test_claim_for_run_takes_only_due_jobs_of_the_given_queues(app: duebox.Duebox) -> None:
    a, b = add(app, 0, 5)
    with app.engine.begin() as conn:
        other = app.schedule(conn, "noop")  # queue "other"
    assert [r.id for r in run_claim(app, "w#1", queues=["default"])] == [a]
    assert [r.id for r in run_claim(app, "w#2", queues=["other"])] == [other]
    assert run_claim(app, "w#3", now=4.9) == []
    [rec] = run_claim(app, "w#4", now=5)
    assert rec.id == b
    assert rec.attempt == 1
    assert rec.attempt_id is not None
    assert {r.job_id for r in attempt_rows(app.engine)} == {a, b, other}


def test_a_completion_from_a_lost_lease_matches_no_row(app: duebox.Duebox) -> None:
    [job_id] = add(app, 0)
    [old] = run_claim(app, "w1#1", lease=5)
    recover(app, 10)
    [new] = run_claim(app, "w2#1", now=10, lease=5)
    assert new.lease_generation > old.lease_generation
    for stmt, params in (jobstore.complete_bound(old, at(11)),
                         (jobstore.retry_stmt(old, at(11), at(60), "unknown", "boom"), None),
                         (jobstore.dead_stmt(old, at(11), "permanent", "boom"), None),
                         (jobstore.heartbeat_stmt(old, at(11), at(100)), None)):
        assert execute(app, stmt, params) == 0
    row = job_row(app.engine, job_id)
    assert (row.state, row.lease_owner, row.lease_until) == (JobState.RUNNING, "w2#1", at(15))
    assert execute(app, jobstore.heartbeat_stmt(new, at(11), at(40))) == 1
    assert execute(app, *jobstore.complete_bound(new, at(12))) == 1
    assert execute(app, jobstore.finish_attempt_stmt(new, at(12), "succeeded")) == 1
    row = job_row(app.engine, job_id)
    assert (row.state, row.finished_at, row.lease_owner) == (JobState.SUCCEEDED, at(12), None)
    assert [a.outcome for a in attempt_rows(app.engine, job_id)] == ["lost", "succeeded"]


def test_same_owner_with_an_old_generation_is_fenced_too(app: duebox.Duebox) -> None:
    [job_id] = add(app, 0)
    [old] = run_claim(app, "w#1", lease=5)
    recover(app, 10)
    [new] = run_claim(app, "w#1", now=10)  # an owner token reused after a restart
    assert new.lease_owner == old.lease_owner
    assert execute(app, *jobstore.complete_bound(old, at(11))) == 0
    assert job_row(app.engine, job_id).state == JobState.RUNNING


def test_retry_moves_the_version_on_so_in_flight_messages_are_stale(app: duebox.Duebox) -> None:
    [job_id] = add(app, 0)
    [claimed] = dispatch(app, "relay#1")
    rec, _ = start(app, claimed.to_message(), "w#1", now=0)
    assert rec is not None
    assert execute(app, jobstore.retry_stmt(rec, at(1), at(30), "unknown", "boom")) == 1
    row = job_row(app.engine, job_id)
    assert (row.state, row.version, row.due_at, row.last_error) == (
        JobState.SCHEDULED, 2, at(30), "boom")
    assert start(app, claimed.to_message(), "w#2", now=31) == (None, "stale_version")


# --- migrations -----------------------------------------------------------------------


def test_migrations_create_exactly_the_declared_tables(database_url: str) -> None:
    """``database_url`` was built by ``duebox.migrate.upgrade``; autogenerate
    must find nothing to change against ``duebox.metadata``."""
    engine = observer(database_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={
                "version_table": migrate.VERSION_TABLE,
                "compare_type": True,
                "compare_server_default": True,
                "include_name": lambda name, type_, parent: (
                    type_ != "table" or (name or "").startswith("duebox_")),
            })
            diffs = compare_metadata(ctx, duebox.metadata)
            tables = set(sa.inspect(conn).get_table_names())
            current = migrate.current_revision(engine)
        assert diffs == []
        assert {t.name for t in duebox.metadata.sorted_tables} <= tables
        assert current == migrate.head_revision() is not None
    finally:
        engine.dispose()


def test_upgrade_again_is_a_no_op_that_keeps_the_data(app: duebox.Duebox) -> None:
    [job_id] = add(app, 0)
    migrate.upgrade(app.engine)
    assert migrate.current_revision(app.engine) == migrate.head_revision()
    assert job_row(app.engine, job_id).state == JobState.SCHEDULED
