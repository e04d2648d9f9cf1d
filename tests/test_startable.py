"""One start condition (duebox.leases.claims.startable) on every path that starts a
delivered job: the worker's usual start (jobstore.start_many), the batch
lane's lock (batch_sql.lock_startable), your own consumer's completion
(own_queues.complete_steps), and the reason a start gives for a row it did
not take (jobstore.why_not_started), and a claimed record's own check
(JobRecord.expired).  Each path is run on the same rows, each
in a transaction rolled back afterwards, on SQLite, PostgreSQL and MariaDB:
the copies of the condition these paths used to carry had drifted apart
(expiry checked at three different instants, or not at all)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import make_app

import duebox
from duebox.leases import batch_sql, jobstore
from duebox.leases.own_queues import Completion, complete_steps
from duebox.leases.records import ROW_COLUMNS
from duebox.leases.records import records as read_records
from duebox.message import JobMessage, MessageRef
from duebox.producer import drive_sync
from duebox.states import Discard, JobState
from duebox.tables import job

H = timedelta(hours=1)
S = timedelta(seconds=1)


@dataclass(frozen=True)
class Row:
    state: JobState
    due: timedelta  # from now
    expires: timedelta | None = None  # from now
    moved_on: bool = False  # the row's version is one past the message's


@pytest.fixture
def app(database_url_all: str) -> Iterator[duebox.Duebox]:
    a = make_app(database_url_all)
    yield a
    a.dispose()


def put(app: duebox.Duebox, now: datetime, rows: dict[str, Row]
        ) -> dict[str, JobMessage]:
    """Write the rows as given (states, times and versions a job reaches on
    its way, written directly), and the message each one's delivery carries."""
    messages = {}
    with app.engine.begin() as conn:
        for name, row in rows.items():
            job_id = app.schedule(conn, "effect", {"row": name}, at=now + row.due)
            assert isinstance(job_id, uuid.UUID)
            conn.execute(sa.update(job).where(job.c.id == job_id).values(
                state=row.state,
                expires_at=None if row.expires is None else now + row.expires,
                version=job.c.version + (1 if row.moved_on else 0)))
            messages[name] = JobMessage(job_id=job_id, task="effect", queue="default",
                                        version=1, attempt=1, due_at=now + row.due)
    return messages


def rolled_back(app: duebox.Duebox, path: Callable[[sa.Connection], set[uuid.UUID]]
                ) -> set[uuid.UUID]:
    with app.engine.connect() as conn, conn.begin() as tx:
        try:
            return path(conn)
        finally:
            tx.rollback()


def named(messages: dict[str, JobMessage], ids: set[uuid.UUID]) -> set[str]:
    return {name for name, m in messages.items() if m.job_id in ids}


def usual_start(messages: dict[str, JobMessage], now: datetime, ahead: float = 0.0
                ) -> Callable[[sa.Connection], set[uuid.UUID]]:
    def path(conn: sa.Connection) -> set[uuid.UUID]:
        return set(jobstore.start_many(
            conn, messages=list(messages.values()), owner="w#1", now=now,
            lease_until=now + timedelta(seconds=30 + ahead), worker="w", ahead=ahead))
    return path


def lane_lock(messages: dict[str, JobMessage], now: datetime, due_by: datetime | None = None
              ) -> Callable[[sa.Connection], set[uuid.UUID]]:
    def path(conn: sa.Connection) -> set[uuid.UUID]:
        return set(batch_sql.lock_startable(conn, list(messages.values()), now, "w#2",
                                            due_by=due_by))
    return path


def own_completion(messages: dict[str, JobMessage], now: datetime
                   ) -> Callable[[sa.Connection], set[uuid.UUID]]:
    def path(conn: sa.Connection) -> set[uuid.UUID]:
        done = set()
        for m in messages.values():
            steps = complete_steps(MessageRef(m.job_id, m.version, m.task),
                                   conn.dialect.name, now)
            if drive_sync(conn, steps).completion is Completion.DONE:
                done.add(m.job_id)
        return done
    return path


def reasons(app: duebox.Duebox, messages: dict[str, JobMessage], now: datetime,
            due_by: datetime | None = None) -> dict[str, Discard]:
    with app.engine.connect() as conn:
        return {name: jobstore.why_not_started(conn, m, now, due_by)
                for name, m in messages.items()}


# Due an hour ago unless said otherwise.  Your own consumer's completion
# reads the database server's clock, so ``now`` is the real time and every
# row is an hour or half an hour from it.
DUE_NOW: dict[str, Row] = {
    "enqueued": Row(JobState.ENQUEUED, -H),
    "dispatching": Row(JobState.DISPATCHING, -H),  # its message overtook the relay's mark
    "scheduled": Row(JobState.SCHEDULED, -H),  # recovered, its earlier message redelivered
    "expires_later": Row(JobState.ENQUEUED, -H, expires=H),
    "expired": Row(JobState.ENQUEUED, -H, expires=-H / 2),
    "cancelled": Row(JobState.CANCELLED, -H),
    "moved_on": Row(JobState.ENQUEUED, -H, moved_on=True),
    "not_due": Row(JobState.ENQUEUED, H),
    "running": Row(JobState.RUNNING, -H),
    "succeeded": Row(JobState.SUCCEEDED, -H),
    "delivered": Row(JobState.DELIVERED, -H),  # your own consumer's queue
}
STARTABLE_NOW = {"enqueued", "dispatching", "scheduled", "expires_later"}


def test_every_path_starts_the_same_rows(app: duebox.Duebox) -> None:
    now = datetime.now(UTC)
    messages = put(app, now, DUE_NOW)
    assert named(messages, rolled_back(app, usual_start(messages, now))) == STARTABLE_NOW
    assert named(messages, rolled_back(app, lane_lock(messages, now))) == STARTABLE_NOW
    # Your own consumer's completion also takes a DELIVERED job (its only state
    # beyond the worker's), and nothing else the worker would not start.
    assert (named(messages, rolled_back(app, own_completion(messages, now)))
            == STARTABLE_NOW | {"delivered"})


def test_a_start_names_the_part_of_the_condition_a_row_fails(app: duebox.Duebox) -> None:
    now = datetime.now(UTC)
    messages = put(app, now, DUE_NOW)
    why = reasons(app, messages, now)
    # A row that fails no part could only have been skipped for its lock.
    assert {name for name, reason in why.items() if reason is Discard.LOCKED} == STARTABLE_NOW
    assert {name: why[name] for name in DUE_NOW.keys() - STARTABLE_NOW} == {
        "expired": Discard.EXPIRED, "cancelled": Discard.CANCELLED,
        "moved_on": Discard.STALE_VERSION, "not_due": Discard.NOT_DUE,
        "running": Discard.ALREADY_RUNNING, "succeeded": Discard.ALREADY_SUCCEEDED,
        "delivered": Discard.already(JobState.DELIVERED)}


def test_own_consumer_completion_says_why_it_did_not_run(app: duebox.Duebox) -> None:
    now = datetime.now(UTC)
    messages = put(app, now, {k: DUE_NOW[k] for k in ("expired", "not_due", "cancelled")})
    with app.engine.connect() as conn, conn.begin() as tx:
        said = {name: drive_sync(conn, complete_steps(
            MessageRef(m.job_id, m.version, m.task), conn.dialect.name, now)).completion
            for name, m in messages.items()}
        tx.rollback()
    # Past its expiry is too late to run: moved on (DUPLICATE), not early
    # (NotDueError, which would have the consumer try it again).
    assert said == {"expired": Completion.MOVED_ON, "not_due": Completion.NOT_DUE,
                    "cancelled": Completion.MOVED_ON}


# Started ahead: now, and due by a minute from now.  The instant a job
# starts is the later of now and its due time; it must not be expired then.
AHEAD = 60.0
DUE_AHEAD: dict[str, Row] = {
    "due_within": Row(JobState.ENQUEUED, 30 * S),
    "expires_after_its_start": Row(JobState.ENQUEUED, 30 * S, expires=45 * S),
    # A retry or a reschedule can move the due time past the expiry.
    "expires_before_its_start": Row(JobState.ENQUEUED, 30 * S, expires=15 * S),
    "due_beyond": Row(JobState.ENQUEUED, 90 * S),
    "expired": Row(JobState.ENQUEUED, -H, expires=-S),
}
STARTABLE_AHEAD = {"due_within", "expires_after_its_start"}


def test_a_start_ahead_checks_expiry_when_the_job_starts_on_every_path(
        app: duebox.Duebox) -> None:
    now = datetime.now(UTC)
    due_by = now + timedelta(seconds=AHEAD)
    messages = put(app, now, DUE_AHEAD)
    assert (named(messages, rolled_back(app, usual_start(messages, now, AHEAD)))
            == STARTABLE_AHEAD)
    assert (named(messages, rolled_back(app, lane_lock(messages, now, due_by)))
            == STARTABLE_AHEAD)
    why = reasons(app, messages, now, due_by)
    assert why == {"due_within": Discard.LOCKED, "expires_after_its_start": Discard.LOCKED,
                   "expires_before_its_start": Discard.EXPIRED,
                   "due_beyond": Discard.NOT_DUE, "expired": Discard.EXPIRED}


def test_a_claimed_record_is_expired_when_the_start_would_refuse_it(
        app: duebox.Duebox) -> None:
    """A job a ``sql://`` worker or a relay claimed holds its record, and
    they ask it (JobRecord.expired) whether the job is past its expiry: the
    answer must be the start's, also for a job claimed ahead of its due
    time whose expiry falls before it."""
    now = datetime.now(UTC)
    messages = put(app, now, DUE_AHEAD)
    why = reasons(app, messages, now, now + timedelta(seconds=AHEAD))
    with app.engine.connect() as conn:
        records = {name: read_records(conn.execute(
            sa.select(*ROW_COLUMNS).where(job.c.id == m.job_id)).all())[0]
            for name, m in messages.items()}
    assert ({name for name, rec in records.items() if rec.expired(now)}
            == {name for name, reason in why.items() if reason is Discard.EXPIRED}
            == {"expires_before_its_start", "expired"})


@pytest.mark.postgres
def test_the_lanes_lock_is_one_statement_text_whatever_the_batch_size(
        pg_server_url: str) -> None:
    """PostgreSQL plans a statement text once per connection: the lock takes
    its pairs as arrays, so a batch of 1 and one of 7 send the same text."""
    from conftest import reset_tables

    reset_tables(pg_server_url)
    app = make_app(pg_server_url)
    sent: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FOR UPDATE" in statement:
            sent.append(statement)

    try:
        now = datetime.now(UTC)
        messages = list(put(app, now, {f"j{n}": Row(JobState.ENQUEUED, -H)
                                       for n in range(7)}).values())
        sa.event.listen(app.engine, "before_cursor_execute", seen)
        for batch in (messages[:1], messages):
            with app.engine.connect() as conn, conn.begin() as tx:
                assert len(batch_sql.lock_startable(conn, batch, now, "w#1")) == len(batch)
                tx.rollback()
        assert len(sent) == 2
        assert sent[0] == sent[1]
    finally:
        sa.event.remove(app.engine, "before_cursor_execute", seen)
        app.dispose()
