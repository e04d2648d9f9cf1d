"""duebox.timing: the hand-over leads around a due time keep the order the
module states, whatever unit each is written in.  A lead that outgrew the
one before it would have a hop hand a job over earlier than the next hop
holds it (the worker would send it back to the broker, or an executor
thread would wait on the event loop's timer)."""

from __future__ import annotations

from datetime import timedelta

from duebox import timing


def seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def test_the_leads_shrink_from_the_relays_window_to_the_reread() -> None:
    leads = [seconds(getattr(timing, name)) for name in (
        "NEAR_WINDOW_SECONDS", "EARLY_HOLD_SECONDS", "HANDOVER_LEAD_SECONDS", "EXECUTOR_HOLD_MOST",
        "SQL_HANDOVER_LEAD", "REREAD_LEAD")]
    assert leads == sorted(leads, reverse=True)
    assert len(set(leads)) == len(leads)
    assert leads[-1] > 0


def test_a_job_handed_over_with_its_gathered_neighbours_is_still_held_not_sent_back() -> None:
    earliest = seconds(timing.HANDOVER_LEAD_SECONDS) + seconds(timing.HANDOVER_GATHER)
    assert earliest <= seconds(timing.EARLY_HOLD_SECONDS)  # the worker holds it
    assert earliest <= seconds(timing.LANE_HOLD_MOST)  # the batch lane takes it


def test_the_batch_lane_locks_its_rows_after_they_arrive_and_before_they_are_due() -> None:
    assert 0 < seconds(timing.LANE_LOCK_LEAD) < seconds(timing.LANE_HOLD_MOST)
    # A sql:// job handed to its executor this early runs there at once.
    assert seconds(timing.SQL_HANDOVER_LEAD) <= seconds(timing.EXECUTOR_HOLD_MOST)


def test_every_lead_is_exported() -> None:
    names = {n for n in vars(timing) if n.isupper()}
    assert names == set(timing.__all__)
