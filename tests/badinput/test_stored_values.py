"""Invariant 6 for what duebox stores (duebox.validation): text a database cannot
hold is refused before any SQL, so the caller's transaction and its business
write survive; and what a handler receives equals what was scheduled, or
scheduling refuses it.

On the real PostgreSQL and MariaDB as well as SQLite: SQLite accepts NUL
where PostgreSQL refuses it, and MariaDB's default collation made two
different keys one.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import Running, job_row, make_app
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session

import duebox
from duebox import ConfigurationError, ValidationError
from duebox.message import JobMessage
from duebox.schedules.api import ScheduleInfo
from duebox.validation import MAX_DEPTH

from .common import nothing_written
from .strategies import MB, NASTY, NASTY_TEXT, PLAIN, nested

NUL, SURROGATE = "a\x00b", "x\ud800"

biz_metadata = sa.MetaData()
biz = sa.Table("biz", biz_metadata, sa.Column("id", sa.Integer, primary_key=True))


@pytest.fixture
def app(database_url_all: str) -> Iterator[duebox.Duebox]:
    a = make_app(database_url_all, max_payload_bytes=4 * MB)
    biz_metadata.drop_all(a.engine)
    biz_metadata.create_all(a.engine)
    a.add_task("other", lambda p, c: None)
    yield a
    biz_metadata.drop_all(a.engine)
    a.dispose()


def business_rows(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return sorted(conn.execute(sa.select(biz.c.id)).scalars())


# (id, the call, the field it must name).  Each carries text no database
# stores as given (PostgreSQL: NUL; every driver: a lone surrogate).
Call = Callable[[duebox.Duebox, Session], Any]
TEXT_CASES: list[tuple[str, Call, str]] = [
    ("payload value", lambda a, s: a.schedule(s, "effect", {"note": NUL}), "payload"),
    ("payload deep value", lambda a, s: a.schedule(s, "effect", nested(30, NUL)), "payload"),
    ("payload key", lambda a, s: a.schedule(s, "effect", {NUL: 1}), "payload"),
    ("payload list item", lambda a, s: a.schedule(s, "effect", [1, [SURROGATE]]), "payload"),
    ("payload surrogate key", lambda a, s: a.schedule(s, "effect", {SURROGATE: 1}), "payload"),
    ("payload string", lambda a, s: a.schedule(s, "effect", "\udfff"), "payload"),
    ("key NUL", lambda a, s: a.schedule(s, "effect", key=NUL), "key"),
    ("key surrogate", lambda a, s: a.schedule(s, "effect", key=SURROGATE), "key"),
    ("tenant NUL", lambda a, s: a.schedule(s, "effect", tenant=NUL), "tenant"),
    ("tenant surrogate", lambda a, s: a.schedule(s, "effect", tenant=SURROGATE), "tenant"),
    ("headers key", lambda a, s: a.schedule(s, "effect", headers={NUL: "v"}), "headers"),
    ("headers value", lambda a, s: a.schedule(s, "effect", headers={"h": [SURROGATE]}),
     "headers"),
    ("new_job payload", lambda a, s: a.schedule_many(
        s, [a.new_job("effect", {"n": 1}), a.new_job("effect", {"n": NUL})]), "payload"),
    ("new_job tenant", lambda a, s: a.schedule_many(s, [a.new_job("effect", tenant=SURROGATE)]),
     "tenant"),
    ("task name NUL", lambda a, s: a.schedule(s, "effect\x00"), "task"),
    ("schedule name", lambda a, s: a.schedules.add(s, NUL, "effect", "* * * * *"), "name"),
    ("schedule name surrogate", lambda a, s: a.schedules.add(s, SURROGATE, "effect",
                                                             "* * * * *"), "name"),
    ("schedule payload", lambda a, s: a.schedules.add(s, "n", "effect", "* * * * *",
                                                      payload={"a": NUL}), "payload"),
    ("schedule cron", lambda a, s: a.schedules.add(s, "n", "effect", "* * * * *\x00"), "cron"),
    ("schedule timezone", lambda a, s: a.schedules.add(s, "n", "effect", "* * * * *",
                                                       timezone="UTC\x00"), "timezone"),
    ("schedule queue", lambda a, s: a.schedules.add(s, "n", "effect", "* * * * *",
                                                    queue=SURROGATE), "queue"),
    ("schedule lookup", lambda a, s: a.schedules.get(s, NUL), "schedule"),
    ("schedule pause lookup", lambda a, s: a.schedules.pause(s, SURROGATE), "schedule"),
    ("cancel reason", lambda a, s: a.cancel(s, "00000000-0000-7000-8000-000000000000",
                                            operator="alice", reason=NUL), "reason"),
    ("cancel operator", lambda a, s: a.cancel(s, "00000000-0000-7000-8000-000000000000",
                                              operator=SURROGATE, reason="r"), "operator"),
]


@pytest.mark.parametrize(("call", "field"), [c[1:] for c in TEXT_CASES],
                         ids=[c[0] for c in TEXT_CASES])
def test_unstorable_text_is_refused_before_sql_and_the_business_write_commits(
    app: duebox.Duebox, call: Call, field: str
) -> None:
    """On PostgreSQL the driver's error used to abort the caller's
    transaction: its COMMIT then rolled back the business row silently."""
    with Session(app.engine) as s, s.begin():
        s.execute(biz.insert().values(id=1))
        with pytest.raises(ValidationError) as info:
            call(app, s)
        s.execute(biz.insert().values(id=2))  # the transaction is still usable
    assert type(info.value) in (ValidationError, duebox.UnknownTaskError)
    assert info.value.field == field, info.value
    assert business_rows(app.engine) == [1, 2]
    nothing_written(app.engine)


def test_a_task_name_a_database_cannot_store_is_refused_at_registration(
    app: duebox.Duebox,
) -> None:
    for name in (NUL, SURROGATE):
        with pytest.raises(ConfigurationError, match="task name"):
            app.add_task(name, lambda p, c: None)


@pytest.mark.parametrize(("first", "second"), [
    ("abc", "ABC"), ("a", "a "), ("i", "\u0131"), ("strasse", "stra\u00dfe"),
    (unicodedata.normalize("NFC", "caf\u00e9"), unicodedata.normalize("NFD", "caf\u00e9")),
])
def test_keys_that_differ_in_any_character_are_different_jobs(
    app: duebox.Duebox, first: str, second: str
) -> None:
    """MariaDB's default collation made "abc" and "ABC" (and "a", "a ") one
    key: the second schedule() returned the first job and scheduled nothing."""
    with app.engine.begin() as conn:
        one = app.schedule(conn, "effect", {"k": first}, key=first)
        two = app.schedule(conn, "effect", {"k": second}, key=second)
        again = app.schedule(conn, "effect", key=second)
    assert one != two
    assert again == two
    assert (job_row(app.engine, one).key, job_row(app.engine, two).key) == (first, second)
    with Session(app.engine) as s, s.begin():
        app.schedules.add(s, "n" + first, "effect", "* * * * *")
        app.schedules.add(s, "n" + second, "effect", "* * * * *")  # not "already exists"
    for name in (first, second):
        with Session(app.engine) as s:
            assert app.schedules.get(s, "n" + name).name == "n" + name  # type: ignore[union-attr]


# --- what a handler receives --------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same JSON type all the way down (1 is not 1.0,
    True is not 1, a list is not a tuple)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def received(app: duebox.Duebox, job_id: Any) -> list[Any]:
    """The payload as each path hands it to a handler: the sql:// worker
    reads the row; the other brokers carry the relay's message of that row."""
    row = job_row(app.engine, job_id)
    message = JobMessage(job_id=row.id, task=row.task, queue=row.queue, version=1, attempt=0,
                         due_at=row.due_at, payload=row.payload, headers=row.headers or {})
    return [row.payload, JobMessage.decode(message.encode()).payload]


EXAMPLES = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])


def test_any_value_comes_back_equal_or_is_refused_by_name(app: duebox.Duebox) -> None:
    """Whatever is scheduled, the handler receives exactly it (type for type,
    PostgreSQL's jsonb and MariaDB's JSON included), or scheduling raises a
    ValidationError naming the payload and writes nothing: a tuple, a dict
    with an int key, a float PostgreSQL would hand back as an int, NUL,
    deep nesting.  The caller's transaction goes on either way."""
    refused = accepted = 0

    @EXAMPLES
    @given(NASTY, NASTY_TEXT)
    def check(payload: Any, header: str) -> None:
        nonlocal refused, accepted
        before = business_rows(app.engine)
        error = None
        with Session(app.engine) as s, s.begin():
            s.execute(biz.insert().values(id=len(before) + 1))
            try:
                job_id = app.schedule(s, "effect", payload, headers={"h": header})
            except ValidationError as exc:
                error = exc
        assert len(business_rows(app.engine)) == len(before) + 1
        if error is not None:
            assert error.field in ("payload", "headers"), error
            refused += 1
            return
        accepted += 1
        for got in received(app, job_id):
            assert same(got, payload), (got, payload)
        assert same(job_row(app.engine, job_id).headers, {"h": header})

    check()
    assert refused  # the strategy reaches both sides
    assert accepted


def test_plain_json_is_always_accepted_and_comes_back_equal(app: duebox.Duebox) -> None:
    @EXAMPLES
    @given(PLAIN)
    def check(payload: Any) -> None:
        with app.engine.begin() as conn:
            job_id = app.schedule(conn, "effect", payload)
        for got in received(app, job_id):
            assert same(got, payload), (got, payload)

    check()


def test_any_schedule_is_stored_as_given_or_refused_by_name(app: duebox.Duebox) -> None:
    """schedules.add with hostile names, queues, zones, cron text and
    payloads: the schedule reads back exactly as given, or a ValidationError
    names the argument; the business write beside it commits either way."""
    fields = {"name", "queue", "timezone", "cron", "payload"}

    @EXAMPLES
    @given(name=NASTY_TEXT, queue=st.none() | NASTY_TEXT, payload=NASTY,
           timezone=st.sampled_from(["UTC", "Europe/Berlin", "UTC\x00", "\ud800"]) | NASTY_TEXT,
           cron=st.sampled_from(["* * * * *", "0 3 * * *", "* * * * *\x00"]) | NASTY_TEXT)
    def check(name: str, queue: str | None, payload: Any, timezone: str, cron: str) -> None:
        before = business_rows(app.engine)
        error = None
        with Session(app.engine) as s, s.begin():
            s.execute(biz.insert().values(id=len(before) + 1))
            try:
                app.schedules.add(s, name, "effect", cron, queue=queue, timezone=timezone,
                                  payload=payload)
            except ValidationError as exc:
                error = exc
        assert len(business_rows(app.engine)) == len(before) + 1
        if error is not None:
            assert error.field in fields, error
            return
        with Session(app.engine) as s, s.begin():
            info = app.schedules.get(s, name)
            assert isinstance(info, ScheduleInfo)
            assert (info.name, info.queue, info.timezone) == (name, queue or "default", timezone)
            assert same(info.payload, payload), (info.payload, payload)
            app.schedules.delete(s, info.id)

    check()


@pytest.mark.parametrize(("payload", "names"), [
    ({1: "a"}, "dict keys must be strings"),
    (1.0, "a bare float without a fraction comes back as an int on SQLite"),
    (2**64, "a bare int beyond 64 bits"),
    ({"a": (1, 2)}, "payload['a']: must be JSON"),
    ({"a": [0, {"b": 1e16}]}, "payload['a'][1]['b']: a float must be below 1e16"),
    ({"a": Decimal("1.5")}, "must be JSON-serialisable"),
    ({None: 1}, "dict keys must be strings"),
    (nested(MAX_DEPTH + 1), f"must nest lists and dicts at most {MAX_DEPTH} levels deep"),
    (nested(5_000), f"must nest lists and dicts at most {MAX_DEPTH} levels deep"),
    ("x" * (5 * MB), "at most 4194304 bytes"),
])
def test_what_would_not_come_back_equal_is_refused_saying_where(
    app: duebox.Duebox, payload: Any, names: str
) -> None:
    with app.engine.begin() as conn, pytest.raises(ValidationError) as info:
        app.schedule(conn, "effect", payload)
    assert info.value.field == "payload"
    assert names in str(info.value)
    nothing_written(app.engine)


@pytest.mark.parametrize("broker", ["sql", "redis"])
async def test_a_worker_hands_the_handler_exactly_what_was_scheduled(
    database_url_all: str, broker: str, request: pytest.FixtureRequest
) -> None:
    """End to end, through a real relay and worker: the payloads at the
    edge of the rule arrive as they were sent."""
    payloads: list[Any] = [
        {"rtl": "\u202eevil", "nfd": unicodedata.normalize("NFD", "caf\u00e9"),
         "esc": "\x1b[31m", "bom": "\ufeff", "astral": "\U0001d518", "ctl": "\x01\x7f"},
        [9.999999999999998e15, -9.999999999999998e15, 5e-324, 1e-7, 0.1, 10**400, -(2**63)],
        {"": [True, False, None, 0, 1, "1", "true"], "\\u0000": '"\\'},
        nested(MAX_DEPTH, "deepest"),
    ]
    url = "sql://" if broker == "sql" else request.getfixturevalue("redis_keys").url()
    app = make_app(database_url_all, url)
    got: dict[str, Any] = {}
    app.add_task("record", lambda p, ctx: got.__setitem__(str(ctx.job_id), p))
    try:
        ids = []
        with app.engine.begin() as conn:
            for p in payloads:
                ids.append(app.schedule(conn, "record", p))
        async with Running(app) as r:
            await r.wait(lambda: len(got) == len(ids), timeout=60, what="every payload to run")
        for job_id, payload in zip(ids, payloads, strict=True):
            assert same(got[str(job_id)], payload), (got[str(job_id)], payload)
    finally:
        await app.adispose()
