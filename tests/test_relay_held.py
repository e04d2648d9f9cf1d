"""The relay's held jobs (relay/held.py): a release also takes the jobs due
just after the one it woke for, and publishes them with no broker delay —
the worker holds each to its due time — but never one due further out."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from duebox.leases.records import JobRecord
from duebox.relay.held import HeldJobs
from duebox.timing import HANDOVER_GATHER, HANDOVER_LEAD_SECONDS

T = datetime(2026, 12, 4, 9, 0, tzinfo=UTC)


def rec(due: datetime) -> JobRecord:
    return JobRecord(id=uuid.uuid4(), task="t", queue="default", payload={}, headers=None,
                     due_at=due, version=1, attempt=0, max_attempts=3, priority=0,
                     tenant=None, key=None, expires_at=None, lease_owner="o",
                     lease_generation=1)


def held_at(held: HeldJobs, dues: list[datetime]) -> list[JobRecord]:
    now = T - timedelta(seconds=10)
    out = [rec(d) for d in dues]
    for r in out:
        held.hold(r, "o", held.release_time(r, now, near=15.0))
    return out


def test_a_release_gathers_what_is_due_within_the_gather_after_it() -> None:
    held = HeldJobs(lead=HANDOVER_LEAD_SECONDS, max_delay=None, precision=0.001)
    gather = HANDOVER_GATHER
    first, inside, edge, outside = held_at(held, [
        T, T + gather / 2, T + gather, T + gather + timedelta(milliseconds=1)])
    release = held.next_release()
    assert release == T - timedelta(seconds=HANDOVER_LEAD_SECONDS)
    ((owner, taken),) = held.take_due(release)
    assert owner == "o"
    assert [r.id for r in taken] == [first.id, inside.id, edge.id]
    # Published now, each with no delay of the broker's: the worker holds it.
    assert [held.delay(r, release) for r in taken] == [0.0, 0.0, 0.0]
    assert held.next_release() == outside.due_at - timedelta(seconds=HANDOVER_LEAD_SECONDS)
    assert held.take_due(release) == []


def test_without_a_hand_over_ahead_nothing_is_gathered() -> None:
    """lead 0 (a broker whose own delay is exact): released at the due time,
    never before."""
    held = HeldJobs(lead=0.0, max_delay=None, precision=0.001)
    first, later = held_at(held, [T, T + timedelta(milliseconds=2)])
    ((_, taken),) = held.take_due(T)
    assert [r.id for r in taken] == [first.id]
    assert held.delay(later, T) == 0.002
