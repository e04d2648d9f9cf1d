"""Cron rules across daylight saving time (duebox.schedules.cron), checked against a
brute-force reference that walks every UTC minute and knows nothing of
croniter, fold round trips or bisection.

Zones: America/New_York (1 h, 02:00), Europe/Berlin (1 h, 02:00/03:00) and
Australia/Lord_Howe (30-minute DST, southern hemisphere).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duebox import ValidationError
from duebox.schedules.cron import Fire, Rule, parse_cron, resolve

ZONES = ["America/New_York", "Europe/Berlin", "Australia/Lord_Howe"]
MINUTE = timedelta(minutes=1)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def fires(rule: Rule, start: datetime, end: datetime) -> list[Fire]:
    out = []
    for f in rule.fires_from(start):
        if f.at >= end:
            break
        out.append(f)
    return out


def instants(rule: Rule, start: datetime, end: datetime) -> list[datetime]:
    return [f.at for f in fires(rule, start, end)]


# --- the documented transitions, by hand --------------------------------------------


@pytest.mark.parametrize(
    ("zone", "cron", "day", "gap", "expected"),
    [
        # New York, 2026-03-08: 02:00 EST -> 03:00 EDT; 02:30 does not exist.
        ("America/New_York", "30 2 * * *", (2026, 3, 8), "shift", [utc(2026, 3, 8, 7, 0)]),
        ("America/New_York", "30 2 * * *", (2026, 3, 8), "skip", []),
        # Berlin, 2026-03-29: 02:00 CET -> 03:00 CEST.
        ("Europe/Berlin", "30 2 * * *", (2026, 3, 29), "shift", [utc(2026, 3, 29, 1, 0)]),
        ("Europe/Berlin", "30 2 * * *", (2026, 3, 29), "skip", []),
        # Lord Howe, 2026-10-04: 02:00 +10:30 -> 02:30 +11:00; 02:15 does not exist.
        ("Australia/Lord_Howe", "15 2 * * *", (2026, 10, 4), "shift",
         [utc(2026, 10, 3, 15, 30)]),
        ("Australia/Lord_Howe", "15 2 * * *", (2026, 10, 4), "skip", []),
    ],
)
def test_spring_forward_gap(zone: str, cron: str, day: tuple[int, int, int], gap: str,
                            expected: list[datetime]) -> None:
    tz = ZoneInfo(zone)
    start = datetime(*day, tzinfo=tz).astimezone(UTC)
    got = fires(Rule(cron, zone, gap=gap), start, start + timedelta(hours=24))
    assert [f.at for f in got] == expected
    assert all(f.kind == "gap-shift" for f in got)


@pytest.mark.parametrize(
    ("zone", "cron", "day", "first", "second"),
    [
        # New York, 2026-11-01: 01:30 happens at -04:00, then at -05:00.
        ("America/New_York", "30 1 * * *", (2026, 11, 1), utc(2026, 11, 1, 5, 30),
         utc(2026, 11, 1, 6, 30)),
        # Berlin, 2026-10-25: 02:30 happens at +02:00, then at +01:00.
        ("Europe/Berlin", "30 2 * * *", (2026, 10, 25), utc(2026, 10, 25, 0, 30),
         utc(2026, 10, 25, 1, 30)),
        # Lord Howe, 2026-04-05: 01:45 happens at +11:00, then 30 minutes later at +10:30.
        ("Australia/Lord_Howe", "45 1 * * *", (2026, 4, 5), utc(2026, 4, 4, 14, 45),
         utc(2026, 4, 4, 15, 15)),
    ],
)
def test_fall_back_fold(zone: str, cron: str, day: tuple[int, int, int], first: datetime,
                        second: datetime) -> None:
    start = datetime(*day, tzinfo=ZoneInfo(zone)).astimezone(UTC)
    end = start + timedelta(hours=24)
    assert instants(Rule(cron, zone, fold="first"), start, end) == [first]
    assert instants(Rule(cron, zone, fold="last"), start, end) == [second]
    both = fires(Rule(cron, zone, fold="both"), start, end)
    assert [(f.at, f.kind) for f in both] == [(first, "fold-first"), (second, "fold-second")]
    assert Rule(cron, zone).fold == "first"  # the documented default


def test_hourly_schedule_across_new_york_fall_back() -> None:
    """Wall-clock hours: 01:00 happens twice; the default fires it once (the
    first), so one real hour passes without a fire.  ``both`` keeps the
    real-time cadence; ``last`` fires the second 01:00."""
    start, end = utc(2026, 11, 1, 3, 30), utc(2026, 11, 1, 8, 30)
    assert instants(Rule("0 * * * *", "America/New_York"), start, end) == [
        utc(2026, 11, 1, 4), utc(2026, 11, 1, 5), utc(2026, 11, 1, 7), utc(2026, 11, 1, 8)]
    assert instants(Rule("0 * * * *", "America/New_York", fold="both"), start, end) == [
        utc(2026, 11, 1, h) for h in (4, 5, 6, 7, 8)]
    assert instants(Rule("0 * * * *", "America/New_York", fold="last"), start, end) == [
        utc(2026, 11, 1, h) for h in (4, 6, 7, 8)]


def test_every_ten_minutes_across_lord_howe_half_hour_gap() -> None:
    """02:00, 02:10 and 02:20 do not exist; shifted, they and 02:30 fire once at 02:30."""
    got = fires(Rule("*/10 * * * *", "Australia/Lord_Howe"), utc(2026, 10, 3, 15, 0),
                utc(2026, 10, 3, 15, 50))
    assert [(f.at, f.wall.strftime("%H:%M"), f.kind) for f in got] == [
        (utc(2026, 10, 3, 15, 0), "01:30", "regular"),
        (utc(2026, 10, 3, 15, 10), "01:40", "regular"),
        (utc(2026, 10, 3, 15, 20), "01:50", "regular"),
        (utc(2026, 10, 3, 15, 30), "02:00", "gap-shift"),
        (utc(2026, 10, 3, 15, 40), "02:40", "regular"),
    ]


@pytest.mark.parametrize("machine_zone", ["Australia/Lord_Howe", "America/New_York", "UTC"])
def test_results_do_not_depend_on_the_machines_zone(machine_zone: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rule = Rule("0 * * * *", "America/New_York", fold="both")
    start, end = utc(2026, 11, 1, 3, 30), utc(2026, 11, 1, 8, 30)
    monkeypatch.setenv("TZ", machine_zone)
    time.tzset()
    try:
        assert instants(rule, start, end) == [utc(2026, 11, 1, h) for h in (4, 5, 6, 7, 8)]
    finally:
        monkeypatch.undo()
        time.tzset()


def test_six_fields_are_second_first() -> None:
    rule = Rule("*/20 30 1 * * *", "Europe/Berlin", fold="both")
    got = instants(rule, utc(2026, 10, 24, 23, 0), utc(2026, 10, 25, 3, 0))
    # 01:30:xx on the fall-back night exists once (the fold is 02:00-03:00).
    assert got == [utc(2026, 10, 24, 23, 30, s) for s in (0, 20, 40)]


def test_resolve_classifies_by_round_trip() -> None:
    ny = ZoneInfo("America/New_York")
    assert resolve(datetime(2026, 3, 8, 2, 30), ny).kind == "gap"
    assert resolve(datetime(2026, 3, 8, 2, 30), ny).first == utc(2026, 3, 8, 7)
    fold = resolve(datetime(2026, 11, 1, 1, 30), ny)
    assert (fold.kind, fold.first, fold.second) == (
        "fold", utc(2026, 11, 1, 5, 30), utc(2026, 11, 1, 6, 30))
    assert resolve(datetime(2026, 7, 1, 12), ny).kind == "regular"


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("cron", {"cron": "* * *"}),
        ("cron", {"cron": "61 * * * *"}),
        ("cron", {"cron": "* * * * * * *"}),
        ("cron", {"cron": "H * * * *"}),
        ("cron", {"cron": "@reboot"}),
        ("cron", {"cron": 5}),
        ("timezone", {"timezone": "Mars/Olympus_Mons"}),
        ("timezone", {"timezone": "localtime"}),
        ("timezone", {"timezone": "../../etc/passwd"}),
        ("gap", {"gap": "forward"}),
        ("fold", {"fold": "second"}),
    ],
)
def test_bad_rules_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"cron": "0 * * * *", "timezone": "UTC"}
    args.update(kwargs)
    with pytest.raises(ValidationError) as info:
        Rule(**args)  # type: ignore[arg-type]
    assert info.value.field == field


def test_aliases_and_whitespace_normalise() -> None:
    assert parse_cron("@daily") == "0 0 * * *"
    assert parse_cron("  0   9 * *  1-5 ") == "0 9 * * 1-5"


# --- the brute-force reference ------------------------------------------------------


def _field(spec: str, lo: int, hi: int) -> frozenset[int]:
    values: set[int] = set()
    for part in spec.split(","):
        rng, _, step_s = part.partition("/")
        step = int(step_s) if step_s else 1
        if rng == "*":
            a, b = lo, hi
        elif "-" in rng:
            a_s, b_s = rng.split("-")
            a, b = int(a_s), int(b_s)
        else:
            a = int(rng)
            b = hi if step_s else a
        values.update(range(a, b + 1, step))
    return frozenset(values)


class Matcher:
    """Five-field cron over a naive wall time; day-of-month and day-of-week
    are OR-ed when both are restricted (as croniter and Vixie cron do)."""

    def __init__(self, expr: str) -> None:
        m, h, dom, mon, dow = expr.split()
        self.m, self.h = _field(m, 0, 59), _field(h, 0, 23)
        self.dom, self.mon = _field(dom, 1, 31), _field(mon, 1, 12)
        self.dow = frozenset(d % 7 for d in _field(dow, 0, 7))
        self.day_or = dom != "*" and dow != "*"

    def __call__(self, w: datetime) -> bool:
        if w.minute not in self.m or w.hour not in self.h or w.month not in self.mon:
            return False
        in_dom, in_dow = w.day in self.dom, (w.weekday() + 1) % 7 in self.dow
        return (in_dom or in_dow) if self.day_or else (in_dom and in_dow)


def classify(expr: str, zone: str, start: datetime, end: datetime
             ) -> list[tuple[datetime, str]]:
    """Walk every UTC minute in [start, end): a wall minute seen twice is a
    fold, a wall clock jumping forward is a gap whose missing minutes would
    fire at the jump.  Returns (instant, regular|fold-first|fold-second|gap)."""
    tz, match = ZoneInfo(zone), Matcher(expr)
    margin = timedelta(hours=3)
    walls: list[tuple[datetime, datetime]] = []
    u = start - margin
    while u < end + margin:
        walls.append((u, u.astimezone(tz).replace(tzinfo=None)))
        u += MINUTE
    seen: dict[datetime, list[datetime]] = {}
    for u, w in walls:
        seen.setdefault(w, []).append(u)
    out: list[tuple[datetime, str]] = []
    for i, (u, w) in enumerate(walls):
        if not start <= u < end:
            continue
        if match(w):
            times = seen[w]
            kind = "regular" if len(times) == 1 else (
                "fold-first" if u == times[0] else "fold-second")
            out.append((u, kind))
        missing = walls[i - 1][1] + MINUTE
        while missing < w:
            if match(missing):
                out.append((u, "gap"))
                break
            missing += MINUTE
    return out


def apply(classes: list[tuple[datetime, str]], gap: str, fold: str) -> list[datetime]:
    wanted = {"regular"}
    wanted |= {"fold-first"} if fold in ("first", "both") else set()
    wanted |= {"fold-second"} if fold in ("last", "both") else set()
    wanted |= {"gap"} if gap == "shift" else set()
    return sorted({u for u, kind in classes if kind in wanted})


def reference(expr: str, zone: str, gap: str, fold: str, start: datetime,
              end: datetime) -> list[datetime]:
    return apply(classify(expr, zone, start, end), gap, fold)


@functools.cache
def transitions(zone: str, year: int) -> tuple[datetime, ...]:
    """The instants a zone's UTC offset changes in a year (to the minute)."""
    tz = ZoneInfo(zone)
    found = []
    t = utc(year, 1, 1)
    off = t.astimezone(tz).utcoffset()
    while t.year == year:
        nxt = t + timedelta(hours=6)
        if nxt.astimezone(tz).utcoffset() != off:
            lo, hi = t, nxt
            while hi - lo > MINUTE:
                mid = lo + (hi - lo) / 2
                mid = mid.replace(second=0, microsecond=0)
                if mid.astimezone(tz).utcoffset() == off:
                    lo = mid
                else:
                    hi = mid if mid > lo else lo + MINUTE
            found.append(hi)
            off = nxt.astimezone(tz).utcoffset()
        t = nxt
    return tuple(found)


MINUTES = ["*", "*/15", "0", "30", "0,30", "*/7", "5-20/5", "59", "1-3", "45"]
HOURS = ["*", "*", "1", "2", "1-3", "*/2", "0,2", "3", "1,2"]
DOMS = ["*", "*", "*", "1-15", "*/2"]
MONTHS = ["*", "*", "*", "3,4,10,11", "1-6"]
DOWS = ["*", "*", "*", "0", "1-5", "6,0"]

crons = st.tuples(*(st.sampled_from(x) for x in (MINUTES, HOURS, DOMS, MONTHS, DOWS))).map(
    " ".join)


@st.composite
def windows(draw: st.DrawFn) -> tuple[str, datetime, datetime]:
    zone = draw(st.sampled_from(ZONES))
    year = draw(st.integers(1900, 2100))
    changes = transitions(zone, year)
    if changes and draw(st.booleans()):
        t = changes[draw(st.integers(0, len(changes) - 1))]
        before = draw(st.integers(0, 6 * 60))
        start = t - before * MINUTE
    else:
        day = draw(st.integers(0, 364))
        start = utc(year, 1, 1) + timedelta(days=day, minutes=draw(st.integers(0, 1439)))
    return zone, start, start + draw(st.integers(1, 10 * 60)) * MINUTE


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=windows(), cron=crons, gap=st.sampled_from(["shift", "skip"]),
       fold=st.sampled_from(["first", "last", "both"]))
def test_fires_match_brute_force(window: tuple[str, datetime, datetime], cron: str, gap: str,
                                 fold: str) -> None:
    zone, start, end = window
    rule = Rule(cron, zone, gap=gap, fold=fold)
    got = instants(rule, start, end)
    assert got == reference(cron, zone, gap, fold, start, end)
    assert got == sorted(set(got))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=windows(), cron=crons, gap=st.sampled_from(["shift", "skip"]),
       fold=st.sampled_from(["first", "last", "both"]), cut=st.floats(0, 1))
def test_last_before_and_resuming_agree_with_brute_force(
    window: tuple[str, datetime, datetime], cron: str, gap: str, fold: str, cut: float
) -> None:
    """What the relay relies on: resuming at any instant loses and repeats
    nothing, and the latest fire before an instant (fire_once) is exact."""
    zone, start, end = window
    rule = Rule(cron, zone, gap=gap, fold=fold)
    expected = reference(cron, zone, gap, fold, start, end)
    split = start + timedelta(minutes=int((end - start) / MINUTE * cut))
    assert instants(rule, start, split) + instants(rule, split, end) == expected
    before = [t for t in expected if t < split]
    got = rule.last_before(split, not_before=start)
    assert (got.at if got else None) == (before[-1] if before else None)


def test_brute_force_over_every_transition_2010_to_2040() -> None:
    """Every real transition of the three zones in 31 years, for the rules a
    fall-back and a spring-forward hurt most, every policy in turn, resuming
    at points around it (inside the repeated hour too)."""
    rules = ["*/15 * * * *", "30 2 * * *", "45 1 * * *", "0 * * * *"]
    policies = [(g, f) for f in ("first", "last", "both") for g in ("shift", "skip")]
    splits = [timedelta(minutes=m) for m in (-70, -50, -30, -10, 0, 10, 30, 50)]
    checked = 0
    for zone in ZONES:
        for year in range(2010, 2041):
            for n, t in enumerate(transitions(zone, year)):
                start, end = t - timedelta(hours=2), t + timedelta(hours=2)
                for i in range(2):
                    cron = rules[(year + n + 2 * i) % len(rules)]
                    gap, fold = policies[(year + 3 * n + 3 * i) % len(policies)]
                    rule = Rule(cron, zone, gap=gap, fold=fold)
                    expected = reference(cron, zone, gap, fold, start, end)
                    assert instants(rule, start, end) == expected, (zone, t, cron, gap, fold)
                    for d in splits:
                        split = t + d
                        assert instants(rule, split, end) == [
                            u for u in expected if u >= split], (zone, split, cron, fold)
                        last = rule.last_before(split, not_before=start)
                        before = [u for u in expected if u < split]
                        assert (last.at if last else None) == (
                            before[-1] if before else None), (zone, split, cron, fold)
                    checked += 1
    assert checked > 350


def _iter_all(rule: Rule, start: datetime, n: int) -> Iterator[datetime]:
    for i, f in enumerate(rule.fires_from(start)):
        if i >= n:
            return
        yield f.at


def test_a_year_of_hourly_fires_is_exactly_the_real_hours_minus_the_policy() -> None:
    """Across a whole year in New York every real hour starts at a local :00,
    so ``both`` fires exactly once per real hour (the missing 02:00 shifts
    onto 03:00, which fires anyway, and fires once); the default ``first``
    fires one less: the second 01:00 of the fall-back night."""
    start, end = utc(2026, 1, 1, 5), utc(2027, 1, 1, 5)  # local midnight to midnight
    hours = int((end - start) / timedelta(hours=1))
    both = [t for t in _iter_all(Rule("0 * * * *", "America/New_York", fold="both"), start,
                                 hours + 10) if t < end]
    first = [t for t in _iter_all(Rule("0 * * * *", "America/New_York"), start, hours + 10)
             if t < end]
    assert both == [start + timedelta(hours=h) for h in range(hours)]
    assert sorted(set(both) - set(first)) == [utc(2026, 11, 1, 6)]
    assert len(first) == hours - 1
