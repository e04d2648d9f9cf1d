"""core/processes/liveness.py's verdict: a lock free on two looks CONFIRM_AFTER apart
is a death, except within AFTER_SERVER_CHANGE of the database server
changing (a failover or a restart ended every session at once).

The locks themselves, on every database and with real processes killed, are
tests/test_liveness.py's; a real failover, tests/test_pg_failover.py's.
"""

from __future__ import annotations

from duebox.processes.liveness import AFTER_SERVER_CHANGE, CONFIRM_AFTER, DeathWatch


def test_a_free_lock_is_a_death_on_the_second_look_confirm_after_later() -> None:
    watch = DeathWatch()
    assert watch.verdict({"w1"}, "primary", 0.0) == []
    assert watch.verdict({"w1"}, "primary", CONFIRM_AFTER - 0.001) == []
    assert watch.verdict({"w1"}, "primary", CONFIRM_AFTER) == ["w1"]


def test_a_lock_held_again_clears_the_suspicion() -> None:
    watch = DeathWatch()
    watch.verdict({"w1"}, "primary", 0.0)
    assert watch.verdict(set(), "primary", 0.5) == []
    assert watch.verdict({"w1"}, "primary", CONFIRM_AFTER) == []  # suspected anew


def test_no_verdict_within_the_grace_after_the_server_changed() -> None:
    """Every lock went with the old primary: w2 needs time to reach the
    new one (a connect to a host that does not answer waits for its
    timeout first), and is not taken for dead meanwhile."""
    watch = DeathWatch()
    assert watch.verdict(set(), "primary", 0.0) == []
    changed = 10.0
    assert watch.verdict({"w1", "w2"}, "promoted standby", changed) == []
    assert watch.verdict({"w1", "w2"}, "promoted standby", changed + CONFIRM_AFTER) == []
    before_end = changed + AFTER_SERVER_CHANGE - 0.001
    assert watch.verdict({"w1"}, "promoted standby", before_end) == []
    # w2 holds its lock again; w1 never came back: dead, once the grace is over.
    assert watch.verdict({"w1"}, "promoted standby", changed + AFTER_SERVER_CHANGE) == ["w1"]


def test_the_first_server_seen_is_no_change() -> None:
    watch = DeathWatch()
    watch.verdict({"w1"}, "primary", 0.0)
    assert watch.verdict({"w1"}, "primary", CONFIRM_AFTER) == ["w1"]
