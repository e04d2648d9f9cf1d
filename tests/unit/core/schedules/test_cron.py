"""duebox.cron: a refused rule says which field and why, a DST-resolved fire
describes itself, and the stepping methods keep their "strictly after /
strictly before" promises at a fire time itself.

Which instants a rule fires at, across every DST transition, is
tests/test_dst.py's (against a brute-force reference)."""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from duebox import ValidationError
from duebox.schedules.cron import Fire, Rule, cached_rule, check_policy, load_zone, parse_cron


@pytest.mark.parametrize(("expr", "rule"), [
    ("61 * * * *", "minute field '61' is out of range 0-59"),
    ("* 24 * * *", "hour field '24' is out of range 0-23"),
    ("* * 0 * *", "day-of-month field '0' is out of range 1-31"),
    ("* * * 13 *", "month field '13' is out of range 1-12"),
    ("* * * * 8", "day-of-week field '8' is out of range 0-7"),
    ("60 * * * * *", "second field '60' is out of range 0-59"),
    ("*/0 * * * *", "minute field step '0' must be a whole number >= 1"),
    ("* * * FOO *", "month field 'FOO' is not a number from 1 to 12 or a name (jan, feb, mar"),
    ("* * * * MON-XYZ", "day-of-week field 'XYZ' is not a number from 0 to 7 or a name (sun"),
    (",1 * * * *", "minute field '' is empty"),
    ("1-2-3 * * * *", "is not a valid cron expression"),
    ("H/5 * * * *", "hashed fields (H) are not supported"),
    ("* * *", "must have 5 fields (minute hour day-of-month month day-of-week) or 6"),
    ("   ", "must be a non-empty cron expression"),
])
def test_a_refused_rule_names_the_field_and_the_rule(expr: str, rule: str) -> None:
    with pytest.raises(ValidationError) as refused:
        parse_cron(expr)
    assert refused.value.field == "cron"
    assert refused.value.rule.startswith(rule), refused.value.rule


@pytest.mark.parametrize(("expr", "normal"), [
    ("@HOURLY", "0 * * * *"), ("@annually", "0 0 1 1 *"),
    ("*/5\t* * * mon-fri", "*/5 * * * mon-fri"),
    ("0 0 12 * * *", "0 0 12 * * *"),
])
def test_aliases_any_case_and_whitespace_normalise(expr: str, normal: str) -> None:
    assert parse_cron(expr) == normal


def test_zones_and_policies_are_refused_by_their_own_field() -> None:
    for name in ("", "localtime", "posixrules", "Europe/Atlantis", 3):
        with pytest.raises(ValidationError) as refused:
            load_zone(name)
        assert refused.value.field == "timezone"
    assert load_zone("Europe/Berlin") is load_zone("Europe/Berlin")
    with pytest.raises(ValidationError, match=r"^gap: must be one of shift, skip"):
        check_policy("gap", "leap", ("shift", "skip"))


def test_a_fire_describes_how_dst_resolved_it() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    wall = datetime(2030, 3, 31, 2, 30)
    shifted = Fire(datetime(2030, 3, 31, 1, 0, tzinfo=UTC), wall, "gap-shift")
    assert shifted.describe(berlin) == (
        "02:30:00 does not exist that day (clocks go forward): shifted to 03:00:00")
    assert Fire(datetime(2030, 10, 27, 0, 30, tzinfo=UTC), wall, "fold-first").describe(
        berlin).endswith("happens twice that day (clocks go back): first one")
    assert Fire(datetime(2030, 10, 27, 1, 30, tzinfo=UTC), wall, "fold-second").describe(
        berlin).endswith("second one")
    assert Fire(datetime(2030, 1, 1, tzinfo=UTC), wall, "regular").describe(berlin) == ""


def test_stepping_from_a_fire_time_itself() -> None:
    rule = Rule("0 9 * * *", "Europe/Berlin")
    nine = datetime(2030, 6, 3, 7, tzinfo=UTC)  # 09:00 in Berlin (CEST)
    after = rule.next_after(nine)
    assert after is not None
    assert after.at == datetime(2030, 6, 4, 7, tzinfo=UTC)
    before = rule.last_before(nine)
    assert before is not None
    assert before.at == datetime(2030, 6, 2, 7, tzinfo=UTC)
    assert rule.last_before(nine, not_before=datetime(2030, 6, 2, 8, tzinfo=UTC)) is None
    assert next(rule.fires_from(nine)).at == nine  # at or after
    assert rule.upcoming(nine, 0) == []
    assert len(rule.upcoming(nine, 3)) == 3


def test_a_rule_that_never_fires_again_ends() -> None:
    rule = Rule("0 0 29 2 *", "UTC")  # every leap day, until the calendar's end
    assert rule.next_after(datetime(9996, 3, 1, tzinfo=UTC)) is None


def test_a_rule_is_validated_when_made_and_cached_by_its_parts() -> None:
    with pytest.raises(ValidationError):
        Rule("0 9 * * *", "UTC", fold="second")
    assert cached_rule("0 9 * * *", "UTC", "shift", "first") is cached_rule(
        "0 9 * * *", "UTC", "shift", "first")
    assert Rule("@daily").cron == "0 0 * * *"
