"""duebox.occurrences: :func:`plan`'s decisions — which fire times become
jobs now and where the cursor goes — under each misfire and overlap policy,
and the ids and jitter every relay derives alike for one fire time.

Through the relay on real databases this is tests/test_schedules.py's; the
cron rules' DST resolution is tests/test_dst.py's."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox.schedules.occurrences import Plan, jitter_for, occurrence_id, plan
from duebox.schedules.rows import ScheduleInfo

NOW = datetime(2030, 3, 1, 12, 0, 30, tzinfo=UTC)
SID = uuid.UUID("6d1c0000-0000-4000-8000-000000000001")
GRACE, LOOKAHEAD = 60.0, 120.0


def hour(h: int, minute: int = 0) -> datetime:
    return NOW.replace(hour=h, minute=minute, second=0)


def info(**changes: Any) -> ScheduleInfo:
    values: dict[str, Any] = {
        "id": SID, "name": "s", "task": "t", "queue": "default", "cron": "0 * * * *",
        "timezone": "UTC", "payload": None, "next_fire_at": hour(12), "last_fire_at": None,
        "misfire": "fire_all", "overlap": "allow", "gap": "shift", "fold": "first", "jitter": 0,
        "priority": 0, "max_attempts": 3, "expire_after": None, "version": 1, "paused": False,
        "created_at": NOW, "updated_at": NOW}
    return ScheduleInfo(**{**values, **changes})


def planned(schedule: ScheduleInfo, *, now: datetime = NOW, budget: int = 100,
            previous_active: bool = False, lookahead: float = LOOKAHEAD) -> Plan:
    return plan(schedule, now, grace=GRACE, lookahead=lookahead, budget=budget,
                previous_active=previous_active)


def fires(p: Plan) -> list[datetime]:
    return [f.at for f in p.fires]


def test_an_on_time_fire_becomes_a_job_and_the_cursor_moves_to_the_next() -> None:
    p = planned(info())
    assert (fires(p), p.next_fire_at, p.misfired, p.full) == ([hour(12)], hour(13), False, False)


def test_with_overlap_allow_fires_within_the_lookahead_are_made_ahead() -> None:
    p = planned(info(next_fire_at=hour(12, 1), cron="* * * * *"))
    assert fires(p) == [hour(12, 1), hour(12, 2)]  # up to now + 120 s
    assert p.next_fire_at == hour(12, 3)
    for overlap in ("skip", "queue"):  # they decide at the fire time itself
        assert fires(planned(info(next_fire_at=hour(12, 1), cron="* * * * *",
                                  overlap=overlap))) == []


def test_a_paused_or_finished_schedule_or_a_far_cursor_makes_nothing() -> None:
    for schedule in (info(paused=True), info(next_fire_at=None), info(next_fire_at=hour(15))):
        p = planned(schedule)
        assert (p.fires, p.next_fire_at) == ([], schedule.next_fire_at)


@pytest.mark.parametrize(("misfire", "made"), [
    ("fire_all", [hour(h) for h in range(7, 13)]),
    ("fire_once", [hour(11), hour(12)]),  # the latest missed, then the on-time one
    ("skip", [hour(12)]),
])
def test_five_missed_hours_under_each_misfire_policy(misfire: str, made: list[datetime]) -> None:
    p = planned(info(next_fire_at=hour(7), misfire=misfire))
    assert fires(p) == made
    assert p.next_fire_at == hour(13)
    assert p.misfired is (misfire != "fire_all")


def test_fire_all_stops_at_the_budget_and_says_more_is_due() -> None:
    p = planned(info(next_fire_at=hour(7)), budget=2)
    assert (fires(p), p.next_fire_at, p.full) == ([hour(7), hour(8)], hour(9), True)


def test_overlap_skip_drops_fire_times_while_the_previous_run_is_active() -> None:
    quiet = planned(info(overlap="skip"))
    busy = planned(info(overlap="skip"), previous_active=True)
    assert (fires(quiet), quiet.overlapped) == ([hour(12)], 0)
    assert (fires(busy), busy.overlapped, busy.next_fire_at) == ([], 1, hour(13))


def test_overlap_skip_after_an_outage_makes_one_and_counts_the_rest_dropped() -> None:
    p = planned(info(overlap="skip", next_fire_at=hour(9)))
    assert (fires(p), p.overlapped, p.next_fire_at) == ([hour(9)], 3, hour(13))


def test_overlap_queue_waits_for_the_previous_run_then_makes_one_at_a_time() -> None:
    waiting = planned(info(overlap="queue", next_fire_at=hour(10)), previous_active=True)
    assert (waiting.blocked, waiting.fires, waiting.next_fire_at) == (True, [], hour(10))
    free = planned(info(overlap="queue", next_fire_at=hour(10)))
    assert (fires(free), free.next_fire_at, free.full) == ([hour(10)], hour(11), False)


def test_a_fold_under_fold_both_makes_two_jobs_with_their_own_ids() -> None:
    # New York falls back on 2030-11-03: 01:30 local happens at 05:30 and 06:30 UTC.
    at = datetime(2030, 11, 3, 6, 0, tzinfo=UTC)
    schedule = info(cron="30 1 * * *", timezone="America/New_York", fold="both",
                    next_fire_at=datetime(2030, 11, 3, 5, 30, tzinfo=UTC), misfire="fire_all")
    p = planned(schedule, now=at + timedelta(hours=1))
    assert fires(p) == [datetime(2030, 11, 3, 5, 30, tzinfo=UTC),
                        datetime(2030, 11, 3, 6, 30, tzinfo=UTC)]
    assert [f.kind for f in p.fires] == ["fold-first", "fold-second"]
    assert len({occurrence_id(SID, f.at) for f in p.fires}) == 2
    assert fires(planned(replace(schedule, fold="first"), now=at + timedelta(hours=1))) == [
        datetime(2030, 11, 3, 5, 30, tzinfo=UTC)]


def test_an_occurrence_id_is_the_same_for_the_same_instant_on_every_relay() -> None:
    nominal = hour(12)
    same = nominal.astimezone(timezone(timedelta(hours=-5)))
    assert occurrence_id(SID, nominal) == occurrence_id(SID, same)
    assert occurrence_id(SID, nominal).version == 5
    assert occurrence_id(SID, nominal) != occurrence_id(SID, hour(13))
    assert occurrence_id(SID, nominal) != occurrence_id(uuid.UUID(int=SID.int + 1), nominal)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=3600), st.integers(min_value=0, max_value=10**7),
       st.uuids())
def test_jitter_is_fixed_per_fire_time_and_within_the_bound(jitter: int, offset: int,
                                                           schedule: uuid.UUID) -> None:
    nominal = NOW + timedelta(seconds=offset)
    delay = jitter_for(schedule, nominal, jitter)
    assert delay == jitter_for(schedule, nominal, jitter)
    assert timedelta(0) <= delay <= timedelta(seconds=jitter)
    assert delay % timedelta(milliseconds=1) == timedelta(0)


def test_jitter_spreads_fire_times() -> None:
    delays = {jitter_for(SID, hour(0) + timedelta(hours=n), 60) for n in range(100)}
    assert len(delays) > 90
