"""duebox.clock: the database clock follows the server from below (a reading
is a lower bound; the tightest of the recent ones wins), so an error can
make a job a little late, never early; and the fake clock moves only when
told."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from duebox.clock import (
    DatabaseClock,
    FakeClock,
    SystemClock,
    as_utc,
    follows_real_time,
    server_now_sql,
    server_source_sql,
    server_time_after,
    sync_clock,
    wait_until,
)

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def test_a_reading_is_taken_as_a_lower_bound_on_the_server() -> None:
    clock = DatabaseClock(FakeClock(T0))
    assert clock.offset == timedelta(0)
    assert clock.now() == T0
    # The server said T0+10 s somewhere between before and after: at `after`
    # it is at least T0+10 s, so the offset kept is 10 - 0.2 s.
    clock.observe(T0, T0 + s(10), T0 + s(0.2))
    assert clock.offset == s(9.8)


def test_the_reading_with_the_shortest_round_trip_of_the_last_four_wins() -> None:
    clock = DatabaseClock(FakeClock(T0))
    readings = [(0.5, 3.0), (0.01, 2.0), (0.3, 4.0), (0.2, 1.0)]  # (rtt, offset at after)
    for rtt, offset in readings:
        clock.observe(T0, T0 + s(rtt + offset), T0 + s(rtt))
    assert clock.offset == s(2.0)
    clock.observe(T0, T0 + s(0.1 + 5.0), T0 + s(0.1))  # the 0.5 s reading drops out
    assert clock.offset == s(2.0)
    for _ in range(3):  # pushes the 0.01 s one out: the tightest left (0.1 s) wins
        clock.observe(T0, T0 + s(0.4 + 7.0), T0 + s(0.4))
    assert clock.offset == s(5.0)


def test_a_reading_from_another_server_replaces_the_old_servers_readings() -> None:
    """A failover (a standby promoted behind a multi-host URL): the old
    primary's tight reading must not outlive it, or a new server whose clock
    is behind would be followed from ahead, starting jobs early."""
    clock = DatabaseClock(FakeClock(T0))
    clock.observe(T0, T0 + s(0.01 + 2.0), T0 + s(0.01), "primary")
    clock.observe(T0, T0 + s(0.3 + 1.0), T0 + s(0.3), "primary")
    assert clock.offset == s(2.0)
    clock.observe(T0, T0 + s(0.3 + 1.0), T0 + s(0.3), "standby, promoted")
    assert clock.offset == s(1.0)


def test_a_naive_server_time_is_utc() -> None:
    clock = DatabaseClock(FakeClock(T0))
    clock.observe(T0, datetime(2030, 1, 1, 0, 0, 1), T0)
    assert clock.offset == s(1)
    assert as_utc(datetime(2030, 1, 1)) == T0
    assert as_utc(T0) is T0


def test_sqlite_has_no_server_clock_to_follow(sqlite_url: str) -> None:
    clock = DatabaseClock(FakeClock(T0))
    engine = sa.create_engine(sqlite_url)
    with engine.connect() as conn:
        sync_clock(clock, conn)
    engine.dispose()
    assert clock.offset == timedelta(0)
    assert server_now_sql("sqlite") is None
    assert server_time_after("sqlite", s(1)) is None
    assert server_source_sql("sqlite") is None
    for dialect in ("postgresql", "mysql", "mariadb"):
        assert server_now_sql(dialect) is not None
        assert server_source_sql(dialect) is not None
        assert server_time_after(dialect, s(1)) is not None


async def test_a_fake_clock_moves_only_when_told_or_slept_on() -> None:
    clock = FakeClock(T0)
    assert clock.now() == clock.now() == T0
    clock.advance(1.5)
    await clock.sleep(2)
    await clock.sleep(-5)  # never backwards
    assert clock.now() == T0 + s(3.5)
    assert FakeClock().now() == datetime(2030, 1, 1, tzinfo=UTC)


def test_which_clocks_a_thread_may_wait_for_by_sleeping() -> None:
    assert follows_real_time(SystemClock())
    assert follows_real_time(DatabaseClock())
    assert not follows_real_time(FakeClock())
    assert not follows_real_time(DatabaseClock(FakeClock()))


def test_waiting_for_an_instant_already_past_returns_at_once() -> None:
    clock = FakeClock(T0)
    wait_until(clock, T0)  # a FakeClock that never moves: would block if it slept
    wait_until(clock, T0 - s(1))


def test_the_system_clock_is_aware_utc() -> None:
    before = datetime.now(UTC)
    now = SystemClock().now()
    assert now.tzinfo is UTC
    assert now >= before
