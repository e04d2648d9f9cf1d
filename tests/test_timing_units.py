"""duebox.timing: one unit per constant, said by its type and its name.

A hand-over lead added to an instant as a number of seconds where it is a
``timedelta`` (or the other way round) is a ``TypeError`` at best and a
lead off by a factor of 1,000 at worst; the module once had
``HANDOVER_LEAD = 0.030`` beside ``SQL_HANDOVER_LEAD = timedelta(milliseconds=5)``."""

from __future__ import annotations

from datetime import timedelta

import pytest

from duebox import timing


@pytest.mark.parametrize("name", timing.__all__)
def test_a_float_says_seconds_in_its_name_and_a_timedelta_does_not(name: str) -> None:
    value = getattr(timing, name)
    if name.endswith("_SECONDS"):
        assert type(value) is float, f"{name} says seconds: a float, not {value!r}"
    else:
        assert isinstance(value, timedelta), f"{name}: a timedelta, or _SECONDS in its name"
    assert value > value * 0, f"{name}: a positive duration"


def test_the_hand_over_sequence_runs_from_the_furthest_out_to_the_due_time() -> None:
    """The module's docstring orders them: each hop may happen a little
    early so that the next one is ready at the due time."""
    s = timedelta(seconds=1)
    assert (timing.NEAR_WINDOW_SECONDS * s > timing.EARLY_HOLD_SECONDS * s
            > timing.HANDOVER_LEAD_SECONDS * s > timing.EXECUTOR_HOLD_MOST
            > timing.SQL_HANDOVER_LEAD > timing.REREAD_LEAD)
    # A hand-over ahead gathers what is due just after it: all of it still
    # within what the batch lane holds.
    assert timing.HANDOVER_LEAD_SECONDS * s + timing.HANDOVER_GATHER <= timing.LANE_HOLD_MOST
