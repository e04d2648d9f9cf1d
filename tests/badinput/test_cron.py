"""Cron expressions, time zones and schedule options: a ValidationError
naming the field (``cron``, ``timezone``, ``misfire`` ...), nothing written —
for whatever text arrives."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session

import duebox
from duebox import ValidationError
from duebox.schedules.cron import Rule, load_zone, parse_cron

from .common import SQLITE_ONLY, nothing_written


@SQLITE_ONLY
@pytest.mark.parametrize(("cron", "timezone", "options", "field"), [
    ("", "UTC", {}, "cron"),
    ("* * * *", "UTC", {}, "cron"),
    ("* * * * * * *", "UTC", {}, "cron"),
    ("61 * * * *", "UTC", {}, "cron"),
    ("H * * * *", "UTC", {}, "cron"),
    ("0 0 31 2 *", "UTC", {}, "cron"),  # never fires
    ("@sometimes", "UTC", {}, "cron"),
    ("* * * * *", "Mars/Olympus", {}, "timezone"),
    ("* * * * *", "", {}, "timezone"),
    ("* * * * *", "localtime", {}, "timezone"),
    ("* * * * *", "../../etc/passwd", {}, "timezone"),
    ("* * * * *", "UTC", {"misfire": "sometimes"}, "misfire"),
    ("* * * * *", "UTC", {"overlap": "maybe"}, "overlap"),
    ("* * * * *", "UTC", {"gap": "leap"}, "gap"),
    ("* * * * *", "UTC", {"fold": "middle"}, "fold"),
    ("* * * * *", "UTC", {"jitter": -1}, "jitter"),
    ("* * * * *", "UTC", {"expire_after": 0}, "expire_after"),
    ("* * * * *", "UTC", {"queue": ""}, "queue"),
    ("* * * * *", "UTC", {"payload": {"x": float("nan")}}, "payload"),
    ("* * * * *", "UTC", {"paused": "yes"}, "paused"),
])
def test_a_bad_schedule_is_refused_by_name_and_writes_nothing(
    database_url: str, cron: str, timezone: str, options: dict[str, Any], field: str
) -> None:
    app = duebox.Duebox(database_url)
    app.add_task("t", lambda p, c: None)
    try:
        with Session(app.engine) as s, s.begin(), pytest.raises(ValidationError) as info:
            app.schedules.add(s, "nightly", "t", cron, timezone=timezone, **options)
        assert info.value.field == field
        nothing_written(app.engine)
    finally:
        app.dispose()


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40) | st.lists(
    st.sampled_from(["*", "0", "59", "60", "*/0", "*/5", "1-3", "3-1", "L", "W", "#", "?",
                     "MON", "JAN", "1,2", "-", ",", "H", "@daily", "99999999999"]),
    min_size=1, max_size=7).map(" ".join))
def test_any_cron_text_is_accepted_or_refused_naming_cron(text: str) -> None:
    field = refused_field(lambda: Rule(parse_cron(text), "UTC").next_after(
        duebox.SystemClock().now()))
    assert field in (None, "cron")


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40) | st.sampled_from(["Europe/Berlin", "UTC", "EST5EDT", "Etc/GMT+1"]))
def test_any_zone_text_is_accepted_or_refused_naming_timezone(name: str) -> None:
    assert refused_field(lambda: load_zone(name)) in (None, "timezone")


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(max_size=20), st.text(max_size=20))
def test_schedules_validate_never_raises_anything_else(bare_app: duebox.Duebox, cron: str,
                                                      zone: str) -> None:
    assert refused_field(
        lambda: bare_app.schedules.validate("n", "t", cron, timezone=zone)) in (
        None, "cron", "timezone")


def refused_field(call: Any) -> str | None:
    try:
        call()
    except ValidationError as exc:
        return exc.field
    return None
