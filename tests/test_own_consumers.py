"""Queues your own consumer reads (docs/own-consumers.md): the setting and
its checks, the relay's DELIVERED mark, the dedupe decorator's fenced
completion, the health report, and ``duebox broker declare``/``names``.
The loops of the four drivers against their real brokers are in
tests/test_own_consumer_loops.py."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from helpers import make_app, schedule_committed

import duebox
from duebox import DUPLICATE, ConfigurationError, NotDueError, SQLDedupeStore
from duebox.cli.main import cli
from duebox.config import Settings
from duebox.dispatched import mark_and_claim, mark_enqueued
from duebox.inspect_status import build_report
from duebox.message import JobMessage
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
    # Terminal: a cancel finds nothing to cancel.
    with app.engine.begin() as conn:
        assert app.cancel(conn, mine) is False
    assert _state(app, mine) == JobState.DELIVERED


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
    assert _handler(app, calls)(headers, b"") is DUPLICATE
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
    assert _handler(app, [])(headers, b"") == "sent"
    with app.engine.begin() as conn:  # the relay's late mark matches nothing: harmless
        assert mark_enqueued(conn, owner="relay-1", ids=[job_id], now=datetime.now(UTC),
                             delivered=("emails",)) == 0
    assert _state(app, job_id) == JobState.SUCCEEDED


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
    report = build_report(app.engine, now, own_queues=app.settings.own_queues)
    assert report.states == {"DELIVERED": 1, "SCHEDULED": 1}
    assert not any("worker" in p for p in report.problems + report.warnings)
    assert all(v.in_flight == 0 for v in report.queues.values())
    # Without the setting the same jobs would want a worker.
    assert "no live worker" in build_report(app.engine, now).problems
    # A job of a duebox queue does.
    schedule_committed(app, "effect", delay=3600)
    assert "no live worker" in build_report(app.engine, now,
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
