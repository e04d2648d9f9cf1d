"""Invariant 6: bad input gets a clear DueboxError subclass naming the
field, and changes nothing.  Producer arguments, settings and URLs, an
unreachable database, and garbage or forged messages arriving at a worker."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from helpers import (
    Running,
    all_final,
    duebox_row_counts,
    effect_rows,
    job_row,
    make_app,
    memory_url,
    schedule_committed,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import duebox
from duebox import (
    ConfigurationError,
    DatabaseError,
    DueboxError,
    JobMessage,
    MessageDecodeError,
    Settings,
    UnknownTaskError,
    ValidationError,
)
from duebox.brokers.memory import MemoryBroker, reset_hubs
from duebox.db import check_reachable, create_sync_engine
from duebox.relay import Relay

NAIVE = datetime(2030, 1, 1, 9, 0)
AWARE = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _fresh_hubs() -> Any:
    yield
    reset_hubs()


@pytest.fixture
async def app(database_url: str) -> AsyncIterator[duebox.Duebox]:
    a = make_app(database_url, clock=duebox.FakeClock(AWARE - timedelta(hours=1)))
    yield a
    await a.adispose()


def nothing_written(app: duebox.Duebox) -> None:
    counts = duebox_row_counts(app.engine)
    assert set(counts.values()) == {0}, counts


# Each case: (id, call(app, session), error type, field named in the message).
Call = Callable[[duebox.Duebox, Any], Any]
CASES: list[tuple[str, Call, type[DueboxError], str]] = [
    ("unknown task", lambda a, s: a.schedule(s, "no-such-task", {}), UnknownTaskError, "task"),
    ("naive at", lambda a, s: a.schedule(s, "effect", at=NAIVE), ValidationError, "at"),
    ("at not a datetime", lambda a, s: a.schedule(s, "effect", at="2030-01-01T09:00Z"),
     ValidationError, "at"),
    ("negative delay", lambda a, s: a.schedule(s, "effect", delay=-1), ValidationError, "delay"),
    ("negative timedelta", lambda a, s: a.schedule(s, "effect", delay=timedelta(seconds=-5)),
     ValidationError, "delay"),
    ("nan delay", lambda a, s: a.schedule(s, "effect", delay=math.nan), ValidationError, "delay"),
    ("infinite delay", lambda a, s: a.schedule(s, "effect", delay=math.inf),
     ValidationError, "delay"),
    ("delay as text", lambda a, s: a.schedule(s, "effect", delay="5"), ValidationError, "delay"),
    ("delay as bool", lambda a, s: a.schedule(s, "effect", delay=True), ValidationError, "delay"),
    ("at and delay", lambda a, s: a.schedule(s, "effect", at=AWARE, delay=5),
     ValidationError, "delay"),
    ("payload not JSON", lambda a, s: a.schedule(s, "effect", {"x": object()}),
     ValidationError, "payload"),
    ("payload a set", lambda a, s: a.schedule(s, "effect", {1, 2}), ValidationError, "payload"),
    ("payload NaN", lambda a, s: a.schedule(s, "effect", {"x": math.nan}),
     ValidationError, "payload"),
    ("payload bytes", lambda a, s: a.schedule(s, "effect", b"raw"), ValidationError, "payload"),
    ("expires before due", lambda a, s: a.schedule(
        s, "effect", at=AWARE, expires_at=AWARE - timedelta(seconds=1)),
     ValidationError, "expires_at"),
    ("expires at due", lambda a, s: a.schedule(s, "effect", at=AWARE, expires_at=AWARE),
     ValidationError, "expires_at"),
    ("naive expires_at", lambda a, s: a.schedule(s, "effect", expires_at=NAIVE),
     ValidationError, "expires_at"),
    ("empty key", lambda a, s: a.schedule(s, "effect", key=""), ValidationError, "key"),
    ("long key", lambda a, s: a.schedule(s, "effect", key="k" * 401), ValidationError, "key"),
    ("key not text", lambda a, s: a.schedule(s, "effect", key=42), ValidationError, "key"),
    ("long tenant", lambda a, s: a.schedule(s, "effect", tenant="t" * 201),
     ValidationError, "tenant"),
    ("priority bool", lambda a, s: a.schedule(s, "effect", priority=True),
     ValidationError, "priority"),
    ("priority float", lambda a, s: a.schedule(s, "effect", priority=1.5),
     ValidationError, "priority"),
    ("priority too big", lambda a, s: a.schedule(s, "effect", priority=2**31),
     ValidationError, "priority"),
    ("headers a list", lambda a, s: a.schedule(s, "effect", headers=["a"]),
     ValidationError, "headers"),
    ("headers not JSON", lambda a, s: a.schedule(s, "effect", headers={"a": object()}),
     ValidationError, "headers"),
    ("cancel a non-uuid", lambda a, s: a.cancel(s, "not-a-uuid"), ValidationError, "job_id"),
    ("reschedule a non-uuid", lambda a, s: a.reschedule(s, "nope", delay=1),
     ValidationError, "job_id"),
    ("reschedule naive", lambda a, s: a.reschedule(s, uuid.uuid4(), at=NAIVE),
     ValidationError, "at"),
    ("reschedule negative", lambda a, s: a.reschedule(s, uuid.uuid4(), delay=-3),
     ValidationError, "delay"),
    ("schedule_many foreign item", lambda a, s: a.schedule_many(s, [{"task": "effect"}]),
     ValidationError, "jobs[0]"),
    ("schedule_many with a key", lambda a, s: a.schedule_many(
        s, [a.new_job("effect"), a.new_job("effect", key="k")]), ValidationError, "jobs[1].key"),
    ("new_job unknown task", lambda a, s: a.new_job("nope"), UnknownTaskError, "task"),
]


# Validation happens before any SQL is sent, so one database suffices here;
# the tests below that do reach the database run on both.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(("call", "error", "field"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
async def test_bad_producer_input_is_refused_and_writes_nothing(
    app: duebox.Duebox, call: Call, error: type[DueboxError], field: str
) -> None:
    with Session(app.engine) as s:
        s.begin()
        with pytest.raises(error) as info:
            call(app, s)
        s.commit()  # whatever the call might have written would now be visible
    assert type(info.value) is error
    assert field in str(info.value)
    if isinstance(info.value, ValidationError):
        assert field in info.value.field or info.value.field == "at/delay"
    nothing_written(app)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_refused_call_leaves_the_callers_transaction_usable(
    app: duebox.Duebox, kind: str
) -> None:
    """A bad job in the middle of a transaction spoils nothing: the good
    ones before and after it still commit, and only they."""
    if kind == "sync":
        with Session(app.engine) as s, s.begin():
            first = app.schedule(s, "effect", {"n": 1})
            with pytest.raises(ValidationError, match="payload"):
                app.schedule(s, "effect", {"n": object()})
            second = app.schedule(s, "effect", {"n": 2})
    else:
        async with AsyncSession(app.async_engine) as s, s.begin():
            first = await app.schedule(s, "effect", {"n": 1})  # type: ignore[misc]
            with pytest.raises(ValidationError, match="at"):
                await app.schedule(s, "effect", at=NAIVE)  # type: ignore[misc]
            second = await app.schedule(s, "effect", {"n": 2})  # type: ignore[misc]
    counts = duebox_row_counts(app.engine)
    assert counts["duebox_job"] == 2
    assert job_row(app.engine, first).payload == {"n": 1}
    assert job_row(app.engine, second).payload == {"n": 2}


async def test_something_that_is_not_a_session_is_refused(app: duebox.Duebox) -> None:
    with pytest.raises(ValidationError, match="session") as info:
        app.schedule(app.engine, "effect")  # an Engine has no transaction to join
    assert info.value.field == "session"
    with pytest.raises(ValidationError, match="session"):
        app.cancel(None, uuid.uuid4())  # type: ignore[arg-type]
    nothing_written(app)


# --- settings and URLs ------------------------------------------------------------------


@pytest.mark.parametrize("broker_url", ["nats://localhost", "localhost:5672", "no-scheme"])
def test_an_unknown_broker_is_refused_when_the_app_is_made(
    database_url: str, broker_url: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        duebox.Duebox(database_url, broker_url)
    assert "broker_url" in str(info.value)
    app = duebox.Duebox(database_url)
    try:
        with pytest.raises(ConfigurationError, match="broker_url"):
            app.configure(broker_url=broker_url)
        assert app.settings.broker_url == "sql://"  # unchanged
    finally:
        app.dispose()


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon", "-0.001"])
def test_a_bad_max_delay_is_refused_before_anything_runs(database_url: str, value: str) -> None:
    bad = f"{memory_url()}?max_delay={value}"
    app = duebox.Duebox(database_url, memory_url())
    try:
        for make in (lambda: duebox.Duebox(database_url, bad),
                     lambda: app.configure(broker_url=bad)):
            with pytest.raises(ConfigurationError) as info:
                make()
            assert "broker_url" in str(info.value)
            assert "max_delay" in str(info.value)
        assert "max_delay" not in app.settings.broker_url
        nothing_written(app)
    finally:
        app.dispose()


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"batch_size": 0}, "batch_size"), ({"batch_size": True}, "batch_size"),
     ({"concurrency": -1}, "concurrency"), ({"lease_seconds": 0}, "lease_seconds"),
     ({"poll_interval": -1.0}, "poll_interval"), ({"clock_skew_margin": -1}, "clock_skew_margin"),
     ({"database_url": ""}, "database_url")],
)
def test_bad_settings_name_the_setting(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        Settings(**changes)


def test_a_bad_environment_variable_names_itself() -> None:
    with pytest.raises(ConfigurationError, match="DUEBOX_BATCH_SIZE"):
        Settings.from_env({"DUEBOX_BATCH_SIZE": "many"})


@pytest.mark.parametrize("url", ["not a url", "nosuchdialect://x/y"])
def test_a_malformed_database_url_names_database_url(url: str) -> None:
    with pytest.raises(ConfigurationError, match="database_url"):
        create_sync_engine(url)


def test_an_unreachable_database_is_a_database_error() -> None:
    engine = create_sync_engine("postgresql+psycopg://127.0.0.1:1/x",
                                connect_args={"connect_timeout": 3})
    try:
        with pytest.raises(DatabaseError) as info:
            check_reachable(engine)
        assert "database_url" in str(info.value)
        assert info.value.__cause__ is not None  # the driver's error, chained
    finally:
        engine.dispose()


async def test_a_relay_pass_against_an_unreachable_database_raises_database_error() -> None:
    app = duebox.Duebox("postgresql+psycopg://127.0.0.1:1/x", memory_url())
    try:
        with pytest.raises(DatabaseError):
            await Relay(app).run_pass()
    finally:
        await app.adispose()


# --- messages from the broker ---------------------------------------------------------------

GOOD = {"format": "duebox/1", "id": str(uuid.uuid4()), "task": "effect", "queue": "default",
        "version": 1, "attempt": 0, "due_at": "2030-01-01T09:00:00+00:00", "payload": None,
        "headers": {}}


def body(**changes: Any) -> bytes:
    data = {**GOOD, **changes}
    return json.dumps({k: v for k, v in data.items() if v is not ...}).encode()


GARBAGE = [
    (b"\xff\xfe not utf-8", "body"),
    (b"", "body"),
    (b"{not json", "body"),
    (b"[1, 2, 3]", "body"),
    (b'"a string"', "body"),
    (body(format="other/2"), "format"),
    (body(format=...), "format"),
    (body(id="not-a-uuid"), "id"),
    (body(id=...), "id"),
    (body(version=0), "version"),
    (body(version="1"), "version"),
    (body(version=True), "version"),
    (body(attempt=-1), "attempt"),
    (body(task=""), "task"),
    (body(queue=7), "queue"),
    (body(due_at="tomorrow"), "due_at"),
    (body(due_at="2030-01-01T09:00:00"), "due_at"),  # no offset
    (body(due_at=...), "due_at"),
    (body(headers=[1]), "headers"),
]


@pytest.mark.parametrize(("raw", "field"), GARBAGE)
def test_a_message_that_is_not_a_duebox_message_names_the_bad_field(
    raw: bytes, field: str
) -> None:
    with pytest.raises(MessageDecodeError) as info:
        JobMessage.decode(raw)
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_a_good_message_round_trips() -> None:
    msg = JobMessage.decode(body())
    assert JobMessage.decode(msg.encode()) == msg


async def test_garbage_and_forged_messages_are_rejected_without_harm(database_url: str) -> None:
    """A worker fed garbage and forgeries discards each one with its reason,
    keeps running, changes no job, and still runs the real work."""
    # A ceiling of 60 s keeps the parked job in the table, untouched.
    app = make_app(database_url, memory_url() + "?max_delay=60")
    try:
        parked = schedule_committed(app, "effect", delay=3600)
        parked_before = job_row(app.engine, parked)
        now = datetime.now(UTC).isoformat()
        forged = [
            # Right job, wrong version: a replayed or tampered message.
            body(id=str(parked), version=7, due_at=now),
            body(id=str(parked), version=0, due_at=now),  # not even decodable
            # Right job and version but claiming to be due now: must not run early.
            body(id=str(parked), version=1, due_at=now),
            # A job that does not exist.
            body(id=str(uuid.uuid4()), due_at=now),
        ]
        async with Running(app) as r:
            injector = app.broker("injector")
            assert isinstance(injector, MemoryBroker)
            for raw, _ in GARBAGE:
                await injector.inject("default", raw)
            for raw in forged:
                await injector.inject("default", raw)
            real = schedule_committed(app, "effect", {"real": True})
            expected = len(GARBAGE) + len(forged)

            def all_handled() -> bool:
                w = r.workers[0].stats
                return sum(w.discarded.values()) + w.deferred >= expected

            await r.wait(all_handled, timeout=15, what="every bad message to be handled")
            await r.wait(lambda: all_final(app.engine, [real]), timeout=15,
                         what="the real job to run after the garbage")
            stats = r.workers[0].stats
        assert stats.discarded["undecodable"] == len(GARBAGE) + 1
        assert stats.discarded["stale_version"] == 1
        assert stats.discarded["unknown_job"] == 1
        assert stats.deferred == 1  # the early forgery: not due, so not started
        assert stats.succeeded == 1
        assert set(effect_rows(app.engine)) == {str(real)}
        assert job_row(app.engine, parked) == parked_before
        counts = duebox_row_counts(app.engine)
        assert (counts["duebox_job"], counts["duebox_attempt"]) == (2, 1)
    finally:
        await app.adispose()


async def test_a_forged_message_is_refused_on_the_sql_path_too(database_url: str) -> None:
    """``sql://`` workers claim rows, not messages; a delivery handed to one
    directly still goes through the version check."""
    from duebox.brokers.base import Delivery
    from duebox.consumers import Worker

    app = make_app(database_url)
    try:
        job_id = schedule_committed(app, "effect")
        before = job_row(app.engine, job_id)
        worker = Worker(app, name="w")
        msg = JobMessage.decode(body(id=str(job_id), version=2,
                                     due_at=datetime.now(UTC).isoformat()))
        await worker.handle(Delivery(message=msg))
        await worker.handle(Delivery(message=None, decode_error="body: garbage"))
        assert dict(worker.stats.discarded) == {"stale_version": 1, "undecodable": 1}
        assert job_row(app.engine, job_id) == before
        assert effect_rows(app.engine) == {}
    finally:
        await app.adispose()
