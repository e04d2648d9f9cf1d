"""Queues your own consumer reads (docs/own-consumers.md): the setting and
its checks, the relay's DELIVERED mark, the dedupe decorator's fenced
completion, the health report, and ``duebox broker declare``/``names``.
The loops of the four drivers against their real brokers are in
tests/test_own_consumer_loops.py."""

from __future__ import annotations

import dataclasses
import importlib
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from helpers import make_app, schedule_committed

import duebox
from duebox import (
    DUPLICATE,
    ConfigurationError,
    MessageDecodeError,
    NotDueError,
    SQLDedupeStore,
)
from duebox.cli.main import cli
from duebox.config import Settings
from duebox.leases.dispatch_marks import mark_and_claim, mark_enqueued
from duebox.message import JobMessage
from duebox.reads.status import build_report
from duebox.states import JobState
from duebox.tables import job, processed

AMQP_URL = "amqp://guest:guest@127.0.0.1/"

loop_metadata = sa.MetaData()
sent = sa.Table("own_sent", loop_metadata, sa.Column("job_id", sa.String(64), primary_key=True))


# --- the setting -----------------------------------------------------------------------


def test_the_setting_takes_a_list_or_a_comma_separated_string() -> None:
    assert Settings(own_consumer_queues=["sms", "emails", "sms"]).own_queues == ("emails", "sms")
    env = {"DUEBOX_OWN_CONSUMER_QUEUES": " emails , sms ", "DUEBOX_BROKER_URL": AMQP_URL}
    assert Settings.from_env(env).own_queues == ("emails", "sms")
    assert Settings().own_queues == ()


@pytest.mark.parametrize("bad", [[""], ["a,b"], [" a"], [3], 7, b"emails", {"a": 1}])
def test_bad_values_name_the_field(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="own_consumer_queues"):
        Settings(own_consumer_queues=bad)


@pytest.mark.parametrize("broker", ["sql://", "memory://x"])
def test_a_broker_without_a_queue_of_its_own_is_refused(broker: str) -> None:
    with pytest.raises(ConfigurationError, match=r"own_consumer_queues: .* no broker queue"):
        duebox.Duebox("sqlite://", broker, settings=Settings(own_consumer_queues=["emails"]))
    app = duebox.Duebox("sqlite://", AMQP_URL, settings=Settings(own_consumer_queues=["emails"]))
    with pytest.raises(ConfigurationError, match="own_consumer_queues"):
        app.configure(broker_url=broker)
    assert app.settings.broker_url == AMQP_URL  # the refused change changed nothing


def test_a_queue_name_the_broker_cannot_use_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"own_consumer_queues: queue 'a\{b\}'"):
        duebox.Duebox("sqlite://", "redis://127.0.0.1:6379/0",
                      settings=Settings(own_consumer_queues=["a{b}"]))


def test_broker_queue_names_are_the_brokers_own() -> None:
    def name(url: str, queue: str = "emails") -> str:
        return duebox.Duebox("sqlite://", url).broker_queue_name(queue)

    assert name(AMQP_URL) == "duebox.q.emails"
    assert name(AMQP_URL + "?prefix=shop") == "shop.q.emails"
    assert name("sqs://k:s@localhost:4566?region=us-east-1&prefix=shop-") == "shop-emails"
    assert name("kafka://127.0.0.1:9092?prefix=shop.") == "shop.emails"
    assert name("redis://127.0.0.1:6379/0?prefix=shop") == "shop:{emails}:ready"
    with pytest.raises(ConfigurationError, match="sql:// keeps queue 'emails' to itself"):
        name("sql://")
    with pytest.raises(duebox.ValidationError) as err:
        name("redis://127.0.0.1:6379/0", "a{b}")
    assert err.value.field == "queue"


# --- the relay's mark ------------------------------------------------------------------


def _claim(app: duebox.Duebox, owner: str) -> list[uuid.UUID]:
    now = datetime.now(UTC)
    with app.engine.begin() as conn:
        _, recs = mark_and_claim(conn, marks=[], owner=owner, horizon=now + timedelta(hours=1),
                                 limit=100, now=now, lease_until=now + timedelta(seconds=30))
    return [r.id for r in recs]


def _state(app: duebox.Duebox, job_id: uuid.UUID) -> str:
    with app.engine.connect() as conn:
        return str(conn.execute(sa.select(job.c.state).where(job.c.id == job_id)).scalar_one())


@pytest.fixture
def app(database_url_all: str) -> Iterator[duebox.Duebox]:
    app = make_app(database_url_all, AMQP_URL, own_consumer_queues=["emails"])

    @app.task("send_email", queue="emails")
    def send_email(payload: Any, ctx: duebox.JobContext) -> None:  # pragma: no cover
        raise AssertionError("your own consumer runs it, not duebox's worker")

    loop_metadata.drop_all(app.engine)
    loop_metadata.create_all(app.engine)
    yield app
    app.dispose()


@pytest.mark.parametrize("fused", [False, True], ids=["mark", "mark_and_claim"])
def test_the_mark_says_delivered_for_own_queues_only(app: duebox.Duebox, fused: bool) -> None:
    mine = schedule_committed(app, "send_email", {"to": "a@example.com"})
    theirs = schedule_committed(app, "effect")
    ids = _claim(app, "relay-1")
    assert sorted(ids) == sorted([mine, theirs])
    now = datetime.now(UTC)
    with app.engine.begin() as conn:
        if fused:  # PostgreSQL: the mark is a CTE of the next claim's statement
            (n,), _ = mark_and_claim(conn, marks=[("relay-1", ids)], owner="relay-2",
                                     horizon=now, limit=1, now=now, lease_until=now,
                                     delivered=("emails",))
        else:
            n = mark_enqueued(conn, owner="relay-1", ids=ids, now=now, delivered=("emails",))
    assert n == 2
    assert _state(app, mine) == JobState.DELIVERED
    assert _state(app, theirs) == JobState.ENQUEUED
    with app.engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(sa.select(job).where(job.c.id.in_(ids)))}
    assert rows[mine].finished_at is not None
    assert rows[mine].published_at is not None
    assert rows[theirs].finished_at is None


# --- the dedupe decorator's completion --------------------------------------------------


def _delivered(app: duebox.Duebox, **kw: Any) -> JobMessage:
    """A job of the own queue, claimed and marked DELIVERED, and its message."""
    job_id = schedule_committed(app, "send_email", {"to": "a@example.com"}, **kw)
    now = datetime.now(UTC)
    with app.engine.begin() as conn:
        _, recs = mark_and_claim(conn, marks=[], owner="r", horizon=now + timedelta(hours=1),
                                 limit=100, now=now, lease_until=now + timedelta(seconds=30))
        mark_enqueued(conn, owner="r", ids=[r.id for r in recs], now=now, delivered=("emails",))
    (rec,) = [r for r in recs if r.id == job_id]
    return rec.to_message()


def _handler(app: duebox.Duebox, calls: list[str], fail: bool = False) -> Any:
    @duebox.dedupe(SQLDedupeStore(app.engine, consumer="mailer"))
    def handle(headers: dict[str, str], body: bytes, *, session: Any) -> str:
        calls.append(headers["duebox-id"])
        session.execute(sent.insert().values(job_id=headers["duebox-id"]))
        if fail:
            raise ConnectionError("smtp down")
        return "sent"

    return handle


def _only_headers(app: duebox.Duebox, calls: list[str]) -> Any:
    """A handler for messages that are only their ``duebox-*`` headers (a
    mapping of your own)."""
    @duebox.dedupe(SQLDedupeStore(app.engine, consumer="mailer"))
    def handle(headers: dict[str, str], *, session: Any) -> str:
        calls.append(headers["duebox-id"])
        session.execute(sent.insert().values(job_id=headers["duebox-id"]))
        return "sent"

    return handle


def _seen(app: duebox.Duebox) -> int:
    with app.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(processed)
                                .where(processed.c.consumer == "mailer")).scalar_one())


def test_completion_is_fenced_and_in_the_handlers_transaction(app: duebox.Duebox) -> None:
    msg = _delivered(app)
    calls: list[str] = []
    handle = _handler(app, calls)
    # A failing handler rolls back its writes, the dedupe row and the completion.
    with pytest.raises(ConnectionError):
        _handler(app, [], fail=True)(msg.header_map(), msg.encode())
    assert _state(app, msg.job_id) == JobState.DELIVERED
    assert _seen(app) == 0
    # Forged copies the job never had: another version, another task.
    stale = dataclasses.replace(msg, version=msg.version + 1)
    assert handle(stale.header_map(), stale.encode()) is DUPLICATE
    forged = dataclasses.replace(msg, task="refund")
    assert handle(forged.header_map(), forged.encode()) is DUPLICATE
    assert calls == []
    assert _seen(app) == 0
    assert handle(msg.header_map(), msg.encode()) == "sent"
    assert _state(app, msg.job_id) == JobState.SUCCEEDED
    assert handle(msg.header_map(), msg.encode()) is DUPLICATE
    assert calls == [str(msg.job_id)]
    assert _seen(app) == 1
    with app.engine.connect() as conn:
        row = conn.execute(sa.select(job).where(job.c.id == msg.job_id)).one()
        assert conn.execute(sa.select(sa.func.count()).select_from(sent)).scalar_one() == 1
    assert row.started_at is not None
    assert row.finished_at is not None


def test_a_stale_version_cannot_complete_a_rescheduled_job(app: duebox.Duebox) -> None:
    msg = _delivered(app)
    # The job moves on (as a reschedule does: a new version) after its message left.
    with app.engine.begin() as conn:
        conn.execute(sa.update(job).where(job.c.id == msg.job_id).values(
            state=JobState.ENQUEUED, version=job.c.version + 1))
    calls: list[str] = []
    assert _handler(app, calls)(msg.header_map(), msg.encode()) is DUPLICATE
    assert calls == []
    assert _state(app, msg.job_id) == JobState.ENQUEUED
    assert _seen(app) == 0


def test_a_cancelled_job_is_not_run(app: duebox.Duebox) -> None:
    job_id = schedule_committed(app, "send_email", {"to": "x"}, delay=60)
    with app.engine.begin() as conn:
        assert app.cancel(conn, job_id)
        version = conn.execute(sa.select(job.c.version).where(job.c.id == job_id)).scalar_one()
    calls: list[str] = []
    headers = {"duebox-id": str(job_id), "duebox-version": str(version),
               "duebox-task": "send_email"}
    assert _only_headers(app, calls)(headers) is DUPLICATE
    assert calls == []
    assert _state(app, job_id) == JobState.CANCELLED


def test_an_early_message_raises_not_due_and_leaves_nothing(app: duebox.Duebox) -> None:
    msg = _delivered(app, delay=3600)
    calls: list[str] = []
    with pytest.raises(NotDueError) as err:
        _handler(app, calls)(msg.header_map(), msg.encode())
    assert 3500 < err.value.seconds <= 3600
    assert calls == []
    assert _seen(app) == 0
    assert _state(app, msg.job_id) == JobState.DELIVERED


def test_a_message_that_overtook_the_relays_mark_completes(app: duebox.Duebox) -> None:
    job_id = schedule_committed(app, "send_email", {"to": "a"})
    (claimed,) = _claim(app, "relay-1")
    assert claimed == job_id
    assert _state(app, job_id) == JobState.DISPATCHING
    headers = {"duebox-id": str(job_id), "duebox-version": "1", "duebox-task": "send_email"}
    assert _only_headers(app, [])(headers) == "sent"
    with app.engine.begin() as conn:  # the relay's late mark matches nothing: harmless
        assert mark_enqueued(conn, owner="relay-1", ids=[job_id], now=datetime.now(UTC),
                             delivered=("emails",)) == 0
    assert _state(app, job_id) == JobState.SUCCEEDED


# --- forged copies of a real job's message (issue #36) -----------------------------------


def _nothing_ran(app: duebox.Duebox, msg: JobMessage, calls: list[str]) -> None:
    assert calls == []
    assert _seen(app) == 0
    assert _state(app, msg.job_id) == JobState.DELIVERED
    with app.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(sent)).scalar_one() == 0


@pytest.mark.parametrize("forged", [
    {"duebox-task": "send_email"},  # no version
    {"duebox-version": "1"},  # no task
    {},  # neither
], ids=["no-version", "no-task", "id-only"])
def test_a_real_jobs_id_without_its_version_and_task_runs_nothing(
        app: duebox.Duebox, forged: dict[str, str]) -> None:
    """On the job table's database a message naming a duebox job must match
    its version and task.  Without a version the handler used to run with
    the forged payload and write a dedupe row; the job stayed DELIVERED and
    the relay's genuine message was then answered DUPLICATE."""
    msg = _delivered(app)
    calls: list[str] = []
    assert _only_headers(app, calls)({"duebox-id": str(msg.job_id), **forged}) is DUPLICATE
    _nothing_ran(app, msg, calls)
    assert _handler(app, calls)(msg.header_map(), msg.encode()) == "sent"  # the real one runs
    assert calls == [str(msg.job_id)]
    assert _state(app, msg.job_id) == JobState.SUCCEEDED


@pytest.mark.parametrize("version", [0, 2**31, 10**30, -1])
def test_a_version_no_job_can_have_is_refused_with_the_field(app: duebox.Duebox,
                                                              version: int) -> None:
    """Version 0 or 2**31 with a real job's id and another payload: the
    handler used to run it.  As a header and in the body."""
    msg = _delivered(app)
    calls: list[str] = []
    forged = dataclasses.replace(msg, version=version, payload={"to": "attacker"})
    with pytest.raises(MessageDecodeError) as err:
        _only_headers(app, calls)({**msg.header_map(), "duebox-version": str(version)})
    assert err.value.field == "duebox-version"
    assert "from 1 to 2147483647" in str(err.value)
    with pytest.raises(MessageDecodeError) as err:
        _handler(app, calls)(forged.header_map(), forged.encode())
    assert err.value.field == "duebox-version"
    with pytest.raises(MessageDecodeError) as err:
        _handler(app, calls)(None, forged.encode())  # the body alone
    assert err.value.field == "version"
    _nothing_ran(app, msg, calls)


def test_headers_that_disagree_with_the_body_are_refused(app: duebox.Duebox) -> None:
    """The fence would check one job and the handler read another's payload."""
    msg = _delivered(app)
    other = _delivered(app)
    calls: list[str] = []
    for name, value in (("duebox-id", str(other.job_id)), ("duebox-version", "2"),
                        ("duebox-task", "refund")):
        with pytest.raises(MessageDecodeError) as err:
            _handler(app, calls)({**msg.header_map(), name: value}, msg.encode())
        assert err.value.field == name
        assert "must agree with the body" in str(err.value)
    _nothing_ran(app, msg, calls)


# --- cancel and reschedule after delivery (issue #36) ------------------------------------


def test_a_delivered_job_can_be_cancelled_until_its_handler_ran(app: duebox.Duebox) -> None:
    """A job due in an hour is DELIVERED as soon as the broker holds its
    message; a cancel used to answer False and the message ran at its due
    time.  The cancel bumps the version, and the completion's fence keeps
    the message from running."""
    msg = _delivered(app, delay=3600)
    with app.engine.begin() as conn:
        assert app.cancel(conn, msg.job_id, operator="alice", reason="not needed") is True
    with app.engine.connect() as conn:
        row = conn.execute(sa.select(job).where(job.c.id == msg.job_id)).one()
    assert (row.state, row.version) == (JobState.CANCELLED, msg.version + 1)
    calls: list[str] = []
    assert _handler(app, calls)(msg.header_map(), msg.encode()) is DUPLICATE
    assert calls == []
    assert _seen(app) == 0
    # Once the handler ran, there is nothing left to cancel.
    handled = _delivered(app)
    assert _handler(app, calls)(handled.header_map(), handled.encode()) == "sent"
    with app.engine.begin() as conn:
        assert app.cancel(conn, handled.job_id) is False
    assert _state(app, handled.job_id) == JobState.SUCCEEDED


def test_a_delivered_job_can_be_rescheduled_until_its_handler_ran(app: duebox.Duebox) -> None:
    msg = _delivered(app, delay=3600)
    with app.engine.begin() as conn:
        app.reschedule(conn, msg.job_id, delay=0.0)
    with app.engine.connect() as conn:
        row = conn.execute(sa.select(job).where(job.c.id == msg.job_id)).one()
    assert (row.state, row.version, row.finished_at) == (JobState.SCHEDULED,
                                                         msg.version + 1, None)
    calls: list[str] = []
    assert _handler(app, calls)(msg.header_map(), msg.encode()) is DUPLICATE  # the old copy
    assert calls == []
    # The relay publishes it again, with its new version: that one runs.
    again = _delivered_again(app, msg.job_id)
    assert again is not None
    assert again.version == msg.version + 1
    assert _handler(app, calls)(again.header_map(), again.encode()) == "sent"
    assert _state(app, msg.job_id) == JobState.SUCCEEDED
    with app.engine.begin() as conn, pytest.raises(duebox.JobStateError, match="SUCCEEDED"):
        app.reschedule(conn, msg.job_id, delay=60.0)


def _delivered_again(app: duebox.Duebox, job_id: uuid.UUID) -> JobMessage | None:
    now = datetime.now(UTC)
    with app.engine.begin() as conn:
        _, recs = mark_and_claim(conn, marks=[], owner="r2", horizon=now + timedelta(hours=1),
                                 limit=100, now=now, lease_until=now + timedelta(seconds=30))
        mark_enqueued(conn, owner="r2", ids=[r.id for r in recs], now=now,
                      delivered=("emails",))
    return next((r.to_message() for r in recs if r.id == job_id), None)


def test_duebox_jobs_cancel_cancels_a_delivered_job(
        app: duebox.Duebox, monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to say "already finished, nothing to cancel" and exit 0."""
    msg = _delivered(app, delay=3600)
    monkeypatch.setenv("DUEBOX_DATABASE_URL", app.settings.database_url)
    monkeypatch.setenv("DUEBOX_BROKER_URL", AMQP_URL)
    monkeypatch.setenv("DUEBOX_OWN_CONSUMER_QUEUES", "emails")
    result = CliRunner().invoke(cli, ["jobs", "cancel", str(msg.job_id), "--operator", "alice",
                                      "--reason", "not needed"])
    assert result.exit_code == 0, result.output
    assert result.output == f"job {msg.job_id}: cancelled\n"
    assert _state(app, msg.job_id) == JobState.CANCELLED


# --- the due check on the database's clock (issue #36) -----------------------------------


@pytest.fixture
def server_app(server_url: str) -> Iterator[duebox.Duebox]:
    app = make_app(server_url, AMQP_URL, own_consumer_queues=["emails"])
    app.add_task("send_email", lambda p, c: None, queue="emails")
    loop_metadata.drop_all(app.engine)
    loop_metadata.create_all(app.engine)
    yield app
    app.dispose()


async def test_the_due_check_is_the_database_servers_not_the_consumer_hosts(
        server_app: duebox.Duebox, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer host whose clock runs 30 s fast: a job due in 10 s used to
    run at once (and its ``finished_at``, on that clock, came after the due
    time).  The due time is compared with the server's clock, as the worker
    and the relay compare it.  The process under ``faketime`` is in
    tests/test_own_consumer_loops.py."""
    # The module, not the decorator duebox.consumers re-exports under its name.
    dedupe_module = importlib.import_module("duebox.consumers.dedupe")
    app = server_app
    monkeypatch.setattr(dedupe_module, "utcnow",
                        lambda: datetime.now(UTC) + timedelta(seconds=30))
    msg = _delivered(app, delay=10)
    calls: list[str] = []
    with pytest.raises(NotDueError) as err:
        _handler(app, calls)(msg.header_map(), msg.encode())
    assert 5 < err.value.seconds <= 10
    store = SQLDedupeStore(app.engine, consumer="mailer")

    @duebox.dedupe(store)
    async def handle(headers: dict[str, str], *, session: Any) -> str:  # pragma: no cover
        calls.append(headers["duebox-id"])
        return "sent"

    try:
        with pytest.raises(NotDueError) as err:
            await handle(msg.header_map())
        assert 5 < err.value.seconds <= 10
    finally:
        await store.aclose()
    assert calls == []
    assert _seen(app) == 0
    assert _state(app, msg.job_id) == JobState.DELIVERED


def test_complete_false_and_other_databases_only_dedupe(app: duebox.Duebox,
                                                        tmp_path: Any) -> None:
    msg = _delivered(app)
    store = SQLDedupeStore(app.engine, consumer="mailer", complete=False)

    @duebox.dedupe(store)
    def handle(headers: dict[str, str], *, session: Any) -> str:
        return "ok"

    assert handle(msg.header_map()) == "ok"
    assert _state(app, msg.job_id) == JobState.DELIVERED
    # A database without duebox's tables: nothing to complete, the handler runs.
    other = sa.create_engine(f"sqlite:///{tmp_path}/mine.db")
    duebox.metadata.create_all(other, tables=[processed])
    auto = SQLDedupeStore(other, consumer="mailer")

    @duebox.dedupe(auto)
    def elsewhere(headers: dict[str, str], *, session: Any) -> str:
        return "ok"

    assert elsewhere(msg.header_map()) == "ok"
    assert auto.complete is False
    assert elsewhere(msg.header_map()) is DUPLICATE
    other.dispose()
    with pytest.raises(TypeError, match="complete"):
        SQLDedupeStore(app.engine, complete="yes")  # type: ignore[arg-type]


async def test_an_async_handler_completes_too(app: duebox.Duebox) -> None:
    msg = _delivered(app)
    store = SQLDedupeStore(app.engine, consumer="mailer")

    @duebox.dedupe(store)
    async def handle(headers: dict[str, str], *, session: Any) -> str:
        await session.execute(sent.insert().values(job_id=headers["duebox-id"]))
        return "sent"

    try:
        assert await handle(msg.header_map()) == "sent"
        assert await handle(msg.header_map()) is DUPLICATE
    finally:
        await store.aclose()
    assert _state(app, msg.job_id) == JobState.SUCCEEDED


# --- status ----------------------------------------------------------------------------


def test_status_counts_delivered_and_wants_no_worker_for_own_queues(
        app: duebox.Duebox) -> None:
    _delivered(app)
    schedule_committed(app, "send_email", {"to": "later"}, delay=3600)
    now = datetime.now(UTC)
    soon = 7200  # the jobs due in an hour count as work (duebox status --due-within)
    report = build_report(app.engine, now, own_queues=app.settings.own_queues,
                          due_within=soon)
    assert report.states == {"DELIVERED": 1, "SCHEDULED": 1}
    assert not any("worker" in p for p in report.problems + report.warnings)
    assert all(v.in_flight == 0 for v in report.queues.values())
    # Without the setting the same jobs would want a worker.
    assert "no live worker" in build_report(app.engine, now, due_within=soon).problems
    # A job of a duebox queue does.
    schedule_committed(app, "effect", delay=3600)
    assert "no live worker" in build_report(app.engine, now, due_within=soon,
                                            own_queues=app.settings.own_queues).problems


def test_status_command_and_jobs_show(app: duebox.Duebox, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    msg = _delivered(app)
    monkeypatch.setenv("DUEBOX_DATABASE_URL", app.settings.database_url)
    monkeypatch.setenv("DUEBOX_BROKER_URL", AMQP_URL)
    monkeypatch.setenv("DUEBOX_OWN_CONSUMER_QUEUES", "emails")
    runner = CliRunner()
    result = runner.invoke(cli, ["status", "--json"])
    assert '"DELIVERED": 1' in result.output, result.output
    assert "no live worker" not in result.output
    shown = runner.invoke(cli, ["jobs", "show", str(msg.job_id)])
    assert "delivered: handed over" in shown.output, shown.output
    listed = runner.invoke(cli, ["jobs", "list", "--state", "delivered"])
    assert str(msg.job_id)[:8] in listed.output, listed.output


# --- duebox broker declare | names -----------------------------------------------------


def test_broker_declare_creates_the_queue_a_consumer_looks_for(
        amqp_vhost: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import pika
    import pika.exceptions

    queue = f"emails{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("DUEBOX_BROKER_URL", amqp_vhost)
    monkeypatch.setenv("DUEBOX_OWN_CONSUMER_QUEUES", queue)
    conn = pika.BlockingConnection(pika.URLParameters(amqp_vhost))
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
            conn.channel().queue_declare(f"duebox.q.{queue}", passive=True)
        assert err.value.reply_code == 404  # what a consumer started first met
        runner = CliRunner()
        names = runner.invoke(cli, ["broker", "names"])
        assert names.output == f"{queue}\tduebox.q.{queue}\n", names.output
        for _ in range(2):  # idempotent
            result = runner.invoke(cli, ["broker", "declare"])
            assert result.exit_code == 0, result.output
            assert result.output == f"{queue}\tduebox.q.{queue}\n"
        conn.channel().queue_declare(f"duebox.q.{queue}", passive=True)  # there now
    finally:
        conn.close()
    monkeypatch.delenv("DUEBOX_OWN_CONSUMER_QUEUES")
    refused = CliRunner().invoke(cli, ["broker", "declare", "--queue", "x",
                                       "--broker-url", "sql://"])
    assert refused.exit_code == 1
    assert "sql:// keeps queue 'x' to itself" in refused.output


def test_a_duebox_worker_discards_a_delivered_jobs_message() -> None:
    from duebox.states import Discard

    assert Discard.already(JobState.DELIVERED) is Discard.ALREADY_DELIVERED
