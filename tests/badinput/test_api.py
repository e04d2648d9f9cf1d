"""Invariant 6 at the API: bad arguments to schedule(), new_job(),
schedule_many(), cancel() and reschedule() get a ValidationError naming the
field and the rule, and write nothing — the caller's transaction stays
usable."""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import duebox_row_counts, effect_rows, job_row, make_app, schedule_committed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import duebox
from duebox import DueboxError, UnknownTaskError, ValidationError

from .common import SQLITE_ONLY, nothing_written, snapshot
from .strategies import NASTY, NASTY_DURATIONS, NASTY_INSTANTS, NASTY_NUMBERS, NASTY_TEXT

NAIVE = datetime(2030, 1, 1, 9, 0)
AWARE = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)
BIG = "x" * (1024 * 1024)  # over the default max_payload_bytes once quoted


@pytest.fixture
async def app(database_url: str) -> AsyncIterator[duebox.Duebox]:
    a = make_app(database_url, clock=duebox.FakeClock(AWARE - timedelta(hours=1)))
    yield a
    await a.adispose()


def _deep(levels: int) -> list[Any]:
    outer: list[Any] = []
    inner = outer
    for _ in range(levels):
        inner.append([])
        inner = inner[0]
    return outer


class _Unprintable:
    def __hash__(self) -> int:
        raise RuntimeError("no hash")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


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
    # Not a name at all: a TypeError (unhashable) came out of the task lookup.
    ("task a NewJob", lambda a, s: a.schedule(s, a.new_job("effect")), ValidationError, "task"),
    ("task a dict", lambda a, s: a.schedule(s, {"task": "effect"}), ValidationError, "task"),
    ("task a number", lambda a, s: a.schedule(s, 5), ValidationError, "task"),
    ("new_job task a list", lambda a, s: a.new_job(["effect"]), ValidationError, "task"),
    ("task nested deep", lambda a, s: a.new_job(_deep(100_000)), ValidationError, "task"),
    ("task unhashable and unprintable", lambda a, s: a.new_job(_Unprintable()),
     ValidationError, "task"),
]


# Validation happens before any SQL is sent, so one database suffices here;
# the tests below that do reach the database run on both.
@SQLITE_ONLY
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
    nothing_written(app.engine)


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
    nothing_written(app.engine)


# --- payload size -------------------------------------------------------------------------


@SQLITE_ONLY
def test_an_oversized_payload_is_refused_naming_the_limit(database_url: str) -> None:
    app = make_app(database_url, max_payload_bytes=1000)
    try:
        with app.engine.begin() as conn:
            app.schedule(conn, "effect", "x" * 998)  # 1000 bytes once quoted: fits
            with pytest.raises(ValidationError) as info:
                app.schedule(conn, "effect", "x" * 999)
            assert info.value.field == "payload"
            assert "at most 1000 bytes" in str(info.value)
            assert "max_payload_bytes" in str(info.value)
            # Headers travel in the same message and count against the same limit.
            with pytest.raises(ValidationError, match="at most 1000 bytes"):
                app.schedule(conn, "effect", "x" * 900, headers={"h": "y" * 100})
            with pytest.raises(ValidationError, match="at most 1000 bytes"):
                app.schedule_many(conn, [app.new_job("effect", "x" * 2000)])
        assert duebox_row_counts(app.engine)["duebox_job"] == 1
    finally:
        app.dispose()


@SQLITE_ONLY
def test_a_broker_with_a_smaller_message_limit_lowers_the_payload_limit(
    database_url: str,
) -> None:
    """SQS carries 256 KiB (less with ?max_message_size=): a job that could
    never be published is refused at schedule(), where the caller can act."""
    app = make_app(database_url, "sqs://k:s@127.0.0.1:1?max_message_size=4096")
    try:
        limit, where = app.payload_limit()
        assert limit == 4096 - 2048
        assert "sqs://" in where
        with app.engine.begin() as conn, pytest.raises(ValidationError) as info:
            app.schedule(conn, "effect", "x" * 3000)
        assert info.value.field == "payload"
        assert f"at most {limit} bytes" in str(info.value)
        nothing_written(app.engine)
        app.configure(broker_url="sqs://k:s@127.0.0.1:1")
        assert app.payload_limit()[0] == 256 * 1024 - 2048
    finally:
        app.dispose()


def test_the_default_payload_limit_holds_without_a_broker_limit(database_url: str) -> None:
    app = make_app(database_url)
    try:
        with app.engine.begin() as conn, pytest.raises(ValidationError, match="payload"):
            app.schedule(conn, "effect", BIG)
        nothing_written(app.engine)
        with app.engine.begin() as conn, pytest.raises(ValidationError, match="payload"):
            app.schedules.add(conn, "big", "effect", "* * * * *", payload=BIG)
        nothing_written(app.engine)
    finally:
        app.dispose()


# --- operator arguments of cancel() -------------------------------------------------------


@SQLITE_ONLY
@pytest.mark.parametrize(("operator", "reason", "field"), [
    ("alice", None, "reason"), ("alice", "  ", "reason"), (None, "why", "operator"),
    ("", "why", "operator"), ("a" * 201, "why", "operator"), ("al\nice", "why", "operator"),
    ("alice", "r" * 2001, "reason"), (7, "why", "operator"),
])
def test_cancel_with_half_an_audit_identity_is_refused_and_changes_nothing(
    database_url: str, operator: Any, reason: Any, field: str
) -> None:
    app = make_app(database_url)
    try:
        job_id = schedule_committed(app, "effect", delay=60)
        before = snapshot(app.engine)
        with app.engine.begin() as conn, pytest.raises(ValidationError) as info:
            app.cancel(conn, job_id, operator=operator, reason=reason)
        assert info.value.field == field
        assert snapshot(app.engine) == before
    finally:
        app.dispose()


# --- anything at all ----------------------------------------------------------------------

ANYTHING = NASTY | NASTY_INSTANTS | NASTY_DURATIONS
ARGUMENTS = st.fixed_dictionaries({}, optional={
    "payload": ANYTHING, "at": NASTY_INSTANTS | ANYTHING, "delay": NASTY_DURATIONS | ANYTHING,
    "key": NASTY_TEXT | ANYTHING, "priority": NASTY_NUMBERS, "tenant": NASTY_TEXT | ANYTHING,
    "expires_at": NASTY_INSTANTS | ANYTHING, "headers": st.dictionaries(NASTY_TEXT, NASTY)
    | ANYTHING})


def test_any_arguments_either_schedule_a_job_or_are_refused_by_name(
    database_url_all: str,
) -> None:
    """Whatever is passed — text no database stores, numbers past every
    edge, nesting to 100,000 levels, megabytes, instants past either end of
    the calendar — schedule() writes exactly one job or raises a
    ValidationError naming one of its arguments: never another exception,
    never a half-written row, and the caller's business write beside it
    commits either way (on PostgreSQL and MariaDB too, which refuse what
    SQLite accepts)."""
    app = make_app(database_url_all)
    names = {"payload", "at", "delay", "key", "priority", "tenant", "expires_at", "headers",
             "at/delay"}
    written = [0]
    keys: set[object] = set()  # keys of jobs written: the same key again is that job

    @settings(max_examples=200, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(ARGUMENTS)
    def check(kwargs: dict[str, Any]) -> None:
        before = duebox_row_counts(app.engine)["duebox_job"]
        refused = None
        with Session(app.engine) as s, s.begin():
            s.execute(sa.text("INSERT INTO effects (job_id, due_us, started_us, worker, "
                              "attempt, lease_generation) VALUES (:j, 0, 0, 'biz', 0, 0)"),
                      {"j": str(uuid.uuid4())})
            try:
                app.schedule(s, "effect", **kwargs)
            except ValidationError as exc:
                refused = exc
        written[0] += 1
        assert len(effect_rows(app.engine)) == written[0]  # the business write committed
        after = duebox_row_counts(app.engine)["duebox_job"]
        if refused is None:
            key = kwargs.get("key")
            assert after == before + (0 if key is not None and key in keys else 1)
            keys.add(key)
        else:
            assert refused.field in names, refused
            assert after == before

    try:
        check()
    finally:
        app.dispose()


def test_nan_and_infinite_delays_are_refused_not_scheduled_forever(
    bare_app: duebox.Duebox,
) -> None:
    for delay in (math.nan, math.inf, -math.inf, 1e308):
        with pytest.raises(ValidationError, match="delay"):
            bare_app.new_job("t", delay=delay)


def test_instants_at_the_edge_of_the_calendar_are_refused_by_name(
    bare_app: duebox.Duebox,
) -> None:
    edge = datetime(9999, 12, 31, 23, 0, tzinfo=timezone(-timedelta(hours=5)))
    with pytest.raises(ValidationError, match="at"):
        bare_app.new_job("t", at=edge)
    with pytest.raises(ValidationError, match="expires_at"):
        bare_app.new_job("t", expires_at=edge)
