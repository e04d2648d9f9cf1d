"""duebox.states: the state sets the transitions are written with agree with
the state machine (docs/design.md, "States"), and every state past those a
message can start a job from has its discard reason."""

from __future__ import annotations

import pytest

from duebox.states import (
    ACTIVE_STATES,
    CANCELLABLE_STATES,
    FINAL_STATES,
    LEASED_STATES,
    RESCHEDULABLE_STATES,
    STARTABLE_STATES,
    Discard,
    JobState,
)

S = JobState


def test_every_state_is_active_or_final_never_both() -> None:
    assert set(JobState) == ACTIVE_STATES | FINAL_STATES
    assert not ACTIVE_STATES & FINAL_STATES
    assert {S.SUCCEEDED, S.DEAD, S.CANCELLED, S.EXPIRED, S.DELIVERED} == FINAL_STATES


def test_what_a_worker_may_start_and_what_recovery_may_expire() -> None:
    # A message may overtake the relay's mark, or follow a recovery.
    assert {S.SCHEDULED, S.DISPATCHING, S.ENQUEUED} == STARTABLE_STATES
    assert {S.DISPATCHING, S.ENQUEUED, S.RUNNING} == LEASED_STATES
    assert STARTABLE_STATES <= ACTIVE_STATES
    assert LEASED_STATES <= ACTIVE_STATES


def test_a_job_handed_to_your_own_consumer_may_still_be_cancelled_or_rescheduled() -> None:
    assert S.DELIVERED in CANCELLABLE_STATES
    assert S.DELIVERED in RESCHEDULABLE_STATES
    assert ACTIVE_STATES | {S.DELIVERED} == CANCELLABLE_STATES
    assert STARTABLE_STATES | {S.DELIVERED} == RESCHEDULABLE_STATES
    assert not CANCELLABLE_STATES & {S.SUCCEEDED, S.DEAD, S.CANCELLED, S.EXPIRED}


@pytest.mark.parametrize("state", sorted((set(JobState) - STARTABLE_STATES), key=str))
def test_each_state_past_starting_has_its_discard_reason(state: JobState) -> None:
    reason = Discard.already(state)
    assert reason == f"already_{state.lower()}"
    assert Discard.already(str(state)) is reason


def test_a_startable_state_has_no_already_reason() -> None:
    for state in STARTABLE_STATES:
        with pytest.raises(ValueError, match="is not a valid Discard"):
            Discard.already(state)


def test_states_are_their_names_in_the_database() -> None:
    assert all(state == state.name == str(state) for state in JobState)
