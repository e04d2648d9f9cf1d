"""Invariant 6 for time: due times, expiry times and durations outside the
range duebox accepts (duebox.validation: from 1970-01-01 up to 9000-01-01 UTC;
durations it adds to instants at most 100 years) are refused by name before
any SQL, and nothing inside the range makes a relay or worker compute a date
past the calendar (``at=datetime(1, 1, 1)`` was accepted and then crashed
the worker on every delivery; ``delay=10**400`` was a raw OverflowError).
Both ends of the range run on every backend: tests/contract/base.py, clause 10.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import Running, job_row, make_app, wait_for
from hypothesis import HealthCheck, given, settings
from sqlalchemy.orm import Session

import duebox
from duebox import ConfigurationError, Settings, Throttled, ValidationError
from duebox.failures import FailureClass, Verdict
from duebox.tables import job
from duebox.tasks import RetryPolicy
from duebox.validation import EARLIEST, LATEST, MAX_SPAN

from .common import nothing_written
from .strategies import NASTY_DURATIONS, NASTY_INSTANTS

US = timedelta(microseconds=1)
YEAR_1 = datetime(1, 1, 1, tzinfo=UTC)
Call = Callable[[duebox.Duebox, Any], Any]

# (id, call, field).  Every one is just outside the range or far beyond it.
OUTSIDE: list[tuple[str, Call, str]] = [
    ("at year 1", lambda a, s: a.schedule(s, "effect", at=YEAR_1), "at"),
    ("at a microsecond before the epoch", lambda a, s: a.schedule(s, "effect",
                                                                  at=EARLIEST - US), "at"),
    ("at the first instant refused", lambda a, s: a.schedule(s, "effect", at=LATEST), "at"),
    ("at the end of the calendar", lambda a, s: a.schedule(
        s, "effect", at=datetime.max.replace(tzinfo=UTC)), "at"),
    ("at past the calendar in UTC", lambda a, s: a.schedule(
        s, "effect", at=datetime(9999, 12, 31, 23, tzinfo=timezone(-timedelta(hours=5)))),
     "at"),
    ("at the start of the calendar ahead of UTC", lambda a, s: a.schedule(
        s, "effect", at=datetime(1, 1, 1, 1, tzinfo=timezone(timedelta(hours=5)))), "at"),
    ("delay 10**400", lambda a, s: a.schedule(s, "effect", delay=10**400), "delay"),
    ("delay 1e300", lambda a, s: a.schedule(s, "effect", delay=1e300), "delay"),
    ("delay timedelta.max", lambda a, s: a.schedule(s, "effect", delay=timedelta.max), "delay"),
    ("delay timedelta.min", lambda a, s: a.schedule(s, "effect", delay=timedelta.min), "delay"),
    ("delay a microsecond below 0", lambda a, s: a.schedule(s, "effect", delay=-US), "delay"),
    ("delay to the refused end", lambda a, s: a.schedule(
        s, "effect", delay=LATEST - a.clock.now()), "delay"),
    ("expires_at year 1", lambda a, s: a.schedule(s, "effect", expires_at=YEAR_1),
     "expires_at"),
    ("expires_at at the refused end", lambda a, s: a.schedule(s, "effect", expires_at=LATEST),
     "expires_at"),
    ("new_job at year 1", lambda a, s: a.schedule_many(s, [a.new_job("effect", at=YEAR_1)]),
     "at"),
    ("reschedule to year 1", lambda a, s: a.reschedule(s, uuid.uuid4(), at=YEAR_1), "at"),
    ("reschedule by 10**400", lambda a, s: a.reschedule(s, uuid.uuid4(), delay=10**400),
     "delay"),
    ("schedule expire_after past 32 bits", lambda a, s: a.schedules.add(
        s, "n", "effect", "* * * * *", expire_after=2**31), "expire_after"),
    ("schedule expire_after infinite", lambda a, s: a.schedules.add(
        s, "n", "effect", "* * * * *", expire_after=math.inf), "expire_after"),
    ("schedule expire_after NaN", lambda a, s: a.schedules.add(
        s, "n", "effect", "* * * * *", expire_after=math.nan), "expire_after"),
    ("schedule jitter 10**400", lambda a, s: a.schedules.add(
        s, "n", "effect", "* * * * *", jitter=10**400), "jitter"),
    ("schedule expire_after timedelta.max", lambda a, s: a.schedules.add(
        s, "n", "effect", "* * * * *", expire_after=timedelta.max), "expire_after"),
]


def test_instants_and_durations_outside_the_range_are_refused_by_name(
    database_url_all: str,
) -> None:
    """On each database: a ValidationError naming the field, nothing written,
    and the caller's transaction goes on to commit its other job."""
    app = make_app(database_url_all)
    try:
        for what, call, field in OUTSIDE:
            with Session(app.engine) as s, s.begin():
                with pytest.raises(ValidationError) as info:
                    call(app, s)
                kept = app.schedule(s, "effect", {"after": what})
            assert info.value.field == field, (what, info.value)
            assert job_row(app.engine, kept).payload == {"after": what}
            with app.engine.begin() as conn:
                conn.execute(sa.delete(job))
        nothing_written(app.engine)
    finally:
        app.dispose()


def test_the_ends_of_the_range_are_stored_exactly(database_url_all: str) -> None:
    app = make_app(database_url_all)
    try:
        last = LATEST - US
        with app.engine.begin() as conn:
            first = app.schedule(conn, "effect", at=EARLIEST)
            latest = app.schedule(conn, "effect", at=last - US, expires_at=last)
            far = app.schedule(conn, "effect", delay=LATEST - app.clock.now() - timedelta(days=1))
            app.schedules.add(conn, "slow", "effect", "* * * * *", expire_after=2**31 - 1)
        assert job_row(app.engine, first).due_at == EARLIEST
        row = job_row(app.engine, latest)
        assert (row.due_at, row.expires_at) == (last - US, last)
        assert LATEST - timedelta(days=2) < job_row(app.engine, far).due_at < LATEST
    finally:
        app.dispose()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(at=NASTY_INSTANTS, delay=NASTY_DURATIONS)
def test_any_instant_or_delay_is_in_range_or_refused_by_name(at: datetime, delay: Any) -> None:
    """Never an OverflowError, never a due time outside the range."""
    app = duebox.Duebox("sqlite://")
    app.add_task("t", lambda p, c: None)
    for kwargs in ({"at": at}, {"delay": delay}, {"expires_at": at}, {"at": at, "delay": delay}):
        refused: ValidationError | None = None
        try:
            new = app.new_job("t", **kwargs)
        except ValidationError as exc:
            refused = exc
        if refused is not None:
            assert refused.field in ("at", "delay", "expires_at", "at/delay"), refused
            continue
        assert EARLIEST <= new.due_at < LATEST
        assert new.expires_at is None or EARLIEST <= new.expires_at < LATEST


# --- durations duebox adds to instants ---------------------------------------------------


@pytest.mark.parametrize(("options", "named"), [
    ({"max_lateness": 1e300}, "max_lateness"), ({"max_lateness": 10**400}, "max_lateness"),
    ({"max_lateness": math.inf}, "max_lateness"), ({"timeout": math.nan}, "timeout"),
    ({"lease_seconds": 1e300}, "lease_seconds"), ({"lease_seconds": -1}, "lease_seconds"),
    ({"retry": None, "max_lateness": MAX_SPAN.total_seconds() + 1}, "max_lateness"),
])
def test_task_durations_past_a_century_are_refused(options: dict[str, Any], named: str) -> None:
    app = duebox.Duebox("sqlite://")
    with pytest.raises(ConfigurationError, match=named):
        app.add_task("t", lambda p, c: None, **options)


@pytest.mark.parametrize("changes", [
    {"lease_seconds": 1e300}, {"redeliver_after": 10**400}, {"misfire_grace": math.inf},
    {"clock_skew_margin": 1e300}, {"poll_interval": 10**400},
])
def test_settings_durations_past_a_century_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match=next(iter(changes))):
        Settings(**changes)


@pytest.mark.parametrize("fields", [
    {"base": math.inf}, {"cap": 1e300}, {"minimum": math.nan}, {"base": -1}, {"cap": 10**400}])
def test_a_retry_policy_beyond_a_century_is_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="RetryPolicy"):
        RetryPolicy(**fields)


def test_retry_delays_stay_dates_whatever_the_attempt_or_retry_after() -> None:
    """A task with max_attempts=5000 reaches attempt 1025, where 2.0**1024
    overflowed; a downstream's ``Retry-After: 1e300`` (someone else's input)
    made the retry's due time overflow in the worker."""
    policy = RetryPolicy()
    for attempt in (1, 64, 1025, 10**6):
        assert 0 <= policy.delay(attempt) <= policy.cap
        assert 0 <= policy.delay_for(attempt, Verdict(FailureClass.TRANSIENT)) <= policy.cap
    for after in (1e300, math.inf, math.nan, 10.0**308):
        delay = policy.delay_for(3, Verdict(FailureClass.THROTTLED, after))
        assert 0 <= delay <= MAX_SPAN.total_seconds()
        datetime(2100, 1, 1, tzinfo=UTC) + timedelta(seconds=delay)  # no OverflowError


async def test_a_huge_retry_after_reschedules_the_job_and_the_worker_goes_on(
    database_url: str,
) -> None:
    app = make_app(database_url)

    @app.task("throttled", max_attempts=3)
    def throttled(payload: Any, ctx: duebox.JobContext) -> None:
        raise Throttled("slow down", retry_after=1e300)

    try:
        first = app.new_job("throttled")
        second = app.new_job("effect")
        with app.engine.begin() as conn:
            ids = app.schedule_many(conn, [first, second])
        assert isinstance(ids, list)
        async with Running(app) as r:
            await r.wait(lambda: job_row(app.engine, ids[0]).attempt == 1
                         and job_row(app.engine, ids[0]).state == "SCHEDULED",
                         timeout=30, what="the throttled job to be rescheduled")
            await wait_for(lambda: job_row(app.engine, ids[1]).state == "SUCCEEDED",
                           timeout=30, what="the next job to run", check=r.check)
        row = job_row(app.engine, ids[0])
        assert row.error_class == "throttled"
        assert row.due_at <= datetime.now(UTC) + MAX_SPAN + timedelta(days=1)
    finally:
        await app.adispose()
