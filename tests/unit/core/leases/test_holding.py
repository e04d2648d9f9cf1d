"""duebox.holding: the near-due hold gives items back earliest release
first, equal times in arrival order, and none before its time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from duebox.leases.holding import Hold

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=20), max_size=30),
       st.integers(min_value=-1, max_value=21))
def test_what_is_due_comes_out_in_release_then_arrival_order(releases: list[int],
                                                              now: int) -> None:
    hold: Hold[int] = Hold()
    for n, ms in enumerate(releases):
        hold.push(at(ms), n)
    due = sorted((ms, n) for n, ms in enumerate(releases) if ms <= now)
    assert hold.count_due(at(now)) == len(due)
    assert hold.take_all(at(now)) == [n for _, n in due]
    assert hold.take(at(now)) is None
    assert len(hold) == len(releases) - len(due)
    assert sorted(hold) == sorted(n for n, ms in enumerate(releases) if ms > now)
    left = [ms for ms in releases if ms > now]
    assert hold.earliest() == (at(min(left)) if left else None)


def test_push_says_when_the_timer_must_wake_earlier() -> None:
    hold: Hold[str] = Hold()
    assert hold.push(at(10), "a") is True  # the first
    assert hold.push(at(20), "b") is False
    assert hold.push(at(10), "c") is False  # not earlier than what is held
    assert hold.push(at(5), "d") is True


def test_take_gives_one_at_a_time_and_nothing_early() -> None:
    hold: Hold[str] = Hold()
    hold.push(at(5), "late")
    hold.push(at(1), "early")
    assert hold.take(at(0)) is None
    assert hold.take(at(5)) == "early"
    assert hold.take(at(5)) == "late"
    assert not hold
    assert hold.earliest() is None


def test_drain_empties_whatever_is_held() -> None:
    hold: Hold[int] = Hold()
    for n in range(5):
        hold.push(at(100 - n), n)
    assert sorted(hold.drain()) == [0, 1, 2, 3, 4]
    assert len(hold) == 0
    assert hold.take_all(at(1000)) == []
