"""A job whose own transaction a lost connection cut (consumers/settling.py):
its worker settles it as recovery would once its lease ran out, only at
once — fenced by the lease, so a job whose commit went through after all,
or that moved on, is left as it is — and a handler that failed by itself,
its own transaction intact, is classified as before.

The failover itself (a real primary killed, its standby promoted) is
tests/test_pg_failover.py; here the pieces, on SQLite and PostgreSQL, and
a real disconnect on PostgreSQL (the handler's server process terminated).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from backends import free_port
from helpers import attempt_rows, job_row, make_app

import duebox
from duebox import FakeClock, JobState
from duebox.consumers.dedupe import SQLDedupeStore
from duebox.consumers.execution import Execution, RunStatus, record_cut
from duebox.consumers.settling import until_answered, until_written
from duebox.errors import DatabaseError
from duebox.leases import claims, jobstore

T0 = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
def app(database_url: str) -> Iterator[duebox.Duebox]:
    a = make_app(database_url, clock=FakeClock(T0))

    @a.task("once", max_attempts=1)
    def once(payload: Any, ctx: duebox.JobContext) -> None:
        pass

    @a.task("other_database")
    def other_database(payload: Any, ctx: duebox.JobContext) -> None:
        # Its own transaction is fine; what fails is another server it
        # reaches, which answers nothing.
        ctx.session.execute(sa.text("SELECT 1"))
        other = sa.create_engine(f"postgresql+psycopg://127.0.0.1:{free_port()}/x")
        try:
            other.connect()
        finally:
            other.dispose()

    yield a
    a.dispose()


def running(app: duebox.Duebox, task: str = "effect", **kw: Any) -> jobstore.JobRecord:
    """A job of ``task`` claimed to run (RUNNING, leased, its attempt open)."""
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, task, **kw)
    with app.engine.begin() as conn:
        [rec] = claims.claim_for_run(conn, owner="w#1", now=T0, limit=1,
                                     lease_until=T0 + timedelta(seconds=30), queues=None,
                                     worker="w")
    assert rec.id == job_id
    return rec


def cut(app: duebox.Duebox, rec: jobstore.JobRecord) -> RunStatus:
    with app.engine.begin() as conn:
        outcome = record_cut(conn, app.get_task(rec.task), rec, "the job's transaction was cut",
                             T0 + timedelta(seconds=1))
    return outcome.status


def test_a_cut_job_goes_back_at_once_as_recovery_would_put_it(app: duebox.Duebox) -> None:
    rec = running(app)
    assert cut(app, rec) is RunStatus.INTERRUPTED
    row = job_row(app.engine, rec.id)
    # Due as it was (never early, and at once), the same version, no lease.
    assert (row.state, row.due_at, row.version, row.lease_owner) == (
        JobState.SCHEDULED, rec.due_at, rec.version, None)
    assert row.error_class == "lost"
    [a] = attempt_rows(app.engine, rec.id)
    assert (a.outcome, a.error_class, a.error) == ("lost", "lost", "the job's transaction was cut")


def test_a_cut_job_whose_attempts_are_used_up_is_dead(app: duebox.Duebox) -> None:
    rec = running(app, "once")
    assert cut(app, rec) is RunStatus.DEAD
    assert job_row(app.engine, rec.id).state == JobState.DEAD


def test_a_cut_whose_commit_went_through_is_left_as_it_is(app: duebox.Duebox) -> None:
    rec = running(app)
    with app.engine.begin() as conn:  # the commit that was in flight, which landed
        assert conn.execute(*jobstore.complete_bound(rec, T0)).rowcount == 1
        conn.execute(*jobstore.finish_attempt_bound(rec, T0, "succeeded"))
    assert cut(app, rec) is RunStatus.SUCCEEDED
    assert job_row(app.engine, rec.id).state == JobState.SUCCEEDED
    assert [a.outcome for a in attempt_rows(app.engine, rec.id)] == ["succeeded"]


def test_a_cut_job_another_process_took_meanwhile_is_left_to_it(app: duebox.Duebox) -> None:
    rec = running(app)
    with app.engine.begin() as conn:  # its lease ran out; recovery took it back
        conn.execute(jobstore.interrupted_stmt(rec, T0, "lease expired", dead=False))
    before = job_row(app.engine, rec.id)
    assert cut(app, rec) is RunStatus.LEASE_LOST
    assert job_row(app.engine, rec.id) == before


def test_a_handler_failing_on_another_unreachable_server_is_classified_not_cut(
    app: duebox.Duebox,
) -> None:
    rec = running(app, "other_database")
    execution = Execution(app, app.get_task(rec.task), rec, "w", SQLDedupeStore())
    assert execution.run_sync().status is RunStatus.RETRIED
    row = job_row(app.engine, rec.id)
    assert row.state == JobState.SCHEDULED
    assert row.due_at > rec.due_at  # its backoff
    assert [a.outcome for a in attempt_rows(app.engine, rec.id)] == ["failed"]


@pytest.mark.postgres
def test_a_handler_whose_own_connection_dies_is_cut(pg_server_url: str) -> None:
    from conftest import reset_tables

    reset_tables(pg_server_url)
    app = make_app(pg_server_url, clock=FakeClock(T0))
    try:
        @app.task("killed")
        def killed(payload: Any, ctx: duebox.JobContext) -> None:
            ctx.session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))

        rec = running(app, "killed")
        execution = Execution(app, app.get_task(rec.task), rec, "w", SQLDedupeStore())
        assert execution.run_sync().status is RunStatus.INTERRUPTED
        assert job_row(app.engine, rec.id).state == JobState.SCHEDULED
        [a] = attempt_rows(app.engine, rec.id)
        assert a.outcome == "lost"
        assert "terminating connection" in a.error, a.error
    finally:
        app.dispose()


@pytest.mark.postgres
async def test_an_async_handler_whose_own_connection_dies_is_cut(pg_server_url: str) -> None:
    from conftest import reset_tables

    reset_tables(pg_server_url)
    app = make_app(pg_server_url, clock=FakeClock(T0))
    try:
        @app.task("killed_async")
        async def killed_async(payload: Any, ctx: duebox.JobContext) -> None:
            await ctx.session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))

        rec = running(app, "killed_async")
        execution = Execution(app, app.get_task(rec.task), rec, "w", SQLDedupeStore())
        assert (await execution.run()).status is RunStatus.INTERRUPTED
        assert job_row(app.engine, rec.id).state == JobState.SCHEDULED
        [a] = attempt_rows(app.engine, rec.id)
        assert a.outcome == "lost"
    finally:
        await app.adispose()


# --- trying again while no server answers ---------------------------------------------


def _unreachable() -> DatabaseError:
    try:
        try:
            raise sa.exc.OperationalError("SELECT 1", {}, ConnectionResetError("reset"),
                                          connection_invalidated=True)
        except sa.exc.OperationalError as exc:
            raise DatabaseError("record failure: database connection lost") from exc
    except DatabaseError as wrapped:
        return wrapped


def test_a_write_that_found_no_server_is_tried_again_while_the_lease_holds() -> None:
    tries: list[int] = []

    def write() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise _unreachable()
        return "written"

    assert until_written(write, lambda: float("inf")) == "written"
    assert len(tries) == 3


def test_a_write_is_not_tried_again_once_the_lease_is_over_or_for_another_error() -> None:
    tries: list[str] = []

    def unreachable() -> None:
        tries.append("unreachable")
        raise _unreachable()

    with pytest.raises(DatabaseError):
        until_written(unreachable, lambda: 0.0)
    refused = DatabaseError("record failure: permission denied")

    def denied() -> None:
        tries.append("denied")
        raise refused

    with pytest.raises(DatabaseError):
        until_written(denied, lambda: float("inf"))
    assert tries == ["unreachable", "denied"]


async def test_a_start_that_found_no_server_is_tried_again_for_a_while_only() -> None:
    tries: list[int] = []

    async def start() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise _unreachable()
        return "started"

    assert await until_answered(start, within=5.0) == "started"
    assert len(tries) == 3

    async def never() -> str:
        tries.append(1)
        raise _unreachable()

    with pytest.raises(DatabaseError):
        await until_answered(never, within=0.0)
    assert len(tries) == 4
