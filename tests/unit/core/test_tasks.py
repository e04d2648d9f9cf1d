"""duebox.tasks: the retry curve of any RetryPolicy, the task options'
checks, and a JobContext without a worker behind it.

The defaults' band is tests/test_retry_defaults.py's; here any policy's
curve is checked against the formula its docstring states, with the random
draw pinned at both ends."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox import ConfigurationError, FailureClass, JobContext, RetryPolicy
from duebox.failures import Verdict
from duebox.tasks import check_task_seconds, validate_task_options
from duebox.validation import MAX_SPAN

MOST = MAX_SPAN.total_seconds()


class Pinned:
    """A random source whose every draw is ``value`` (in [0, 1))."""

    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


LOW, HIGH = Pinned(0.0), Pinned(math.nextafter(1.0, 0.0))
SECONDS = st.floats(min_value=0, max_value=MOST, allow_nan=False)
# From a microsecond up (and 0): below that a base means nothing, and past 64
# doublings the code stops doubling (2.0 ** 1024 overflows), which the cap
# hides for any base of 2e-7 s or more.
BASES = st.just(0.0) | st.floats(min_value=1e-6, max_value=MOST)
POLICIES = st.builds(RetryPolicy, base=BASES, cap=SECONDS,
                     minimum=st.floats(min_value=0, max_value=3600, allow_nan=False))
ATTEMPTS = st.integers(min_value=-3, max_value=10_000)


def computed(policy: RetryPolicy, attempt: int) -> float:
    """``min(cap, base * 2**(attempt-1))``, from the first attempt on."""
    return min(policy.cap, policy.base * 2.0 ** min(max(0, attempt - 1), 1000))


@settings(max_examples=300, deadline=None)
@given(POLICIES, ATTEMPTS)
def test_the_wait_is_in_the_upper_half_of_the_capped_backoff(policy: RetryPolicy,
                                                             attempt: int) -> None:
    ceiling = computed(policy, attempt)
    assert policy.backoff(attempt) == pytest.approx(ceiling, rel=1e-12)
    for verdict in (Verdict(FailureClass.TRANSIENT), Verdict(FailureClass.UNKNOWN),
                    Verdict(FailureClass.PERMANENT)):
        low, high = (policy.delay_for(attempt, verdict, rng) for rng in (LOW, HIGH))
        assert low == pytest.approx(max(policy.minimum, ceiling / 2), rel=1e-12)
        assert high == pytest.approx(max(policy.minimum, ceiling), rel=1e-9)


def test_the_default_curve_doubles_from_15_s_to_an_hour() -> None:
    policy = RetryPolicy()
    assert [policy.backoff(n) for n in range(1, 11)] == [
        15, 30, 60, 120, 240, 480, 960, 1920, 3600, 3600]
    assert policy.backoff(10**9) == 3600.0  # no overflow however many attempts


@settings(max_examples=200, deadline=None)
@given(POLICIES, st.integers(min_value=1, max_value=200),
       st.none() | st.just(math.nan) | st.floats(allow_nan=False))
def test_a_throttled_retry_waits_its_retry_after_plus_at_most_a_tenth(
        policy: RetryPolicy, attempt: int, retry_after: float | None) -> None:
    verdict = Verdict(FailureClass.THROTTLED, retry_after)
    usable = retry_after is not None and math.isfinite(retry_after)
    # Without a usable Retry-After: the next attempt's ceiling (harder backoff).
    floor = max(policy.minimum, retry_after if usable else policy.backoff(attempt + 1))
    low, high = (policy.delay_for(attempt, verdict, rng) for rng in (LOW, HIGH))
    assert low == pytest.approx(min(floor, MOST), rel=1e-12)
    assert high == pytest.approx(min(floor * 1.1, MOST), rel=1e-9)


def test_a_huge_retry_after_still_leaves_a_date() -> None:
    wait = RetryPolicy().delay_for(1, Verdict(FailureClass.THROTTLED, 1e300), HIGH)
    assert wait == MOST


def test_the_jitter_spreads_over_the_band() -> None:
    import random

    waits = {RetryPolicy(base=10, cap=10).delay(1, random.Random(seed)) for seed in range(50)}
    assert len(waits) == 50
    assert min(waits) >= 5
    assert max(waits) <= 10


@pytest.mark.parametrize(("field", "value"), [
    ("base", -1), ("cap", math.nan), ("minimum", math.inf), ("base", True), ("cap", "60"),
    ("minimum", MOST + 1), ("base", None),
])
def test_a_bad_policy_names_its_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"^RetryPolicy\.{field}: must be a number"):
        RetryPolicy(**{field: value})


@pytest.mark.parametrize(("name", "queue", "attempts", "says"), [
    ("", "default", 1, "task name"), ("t" * 201, "default", 1, "task name"),
    ("a\x00", "default", 1, "task name"), (5, "default", 1, "task name"),
    ("t", "", 1, "queue"), ("t", "q" * 201, 1, "queue"), ("t", None, 1, "queue"),
    ("t", "default", 0, "max_attempts"), ("t", "default", True, "max_attempts"),
    ("t", "default", 2.0, "max_attempts"),
])
def test_task_options_are_refused_by_name(name: object, queue: object, attempts: object,
                                          says: str) -> None:
    with pytest.raises(ConfigurationError, match=f"^{says}: "):
        validate_task_options(name, queue, attempts)


def test_task_options_at_their_bounds_are_taken() -> None:
    validate_task_options("t" * 200, "q" * 200, 1)


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, MOST + 1, True, "5"])
def test_task_durations_are_refused_by_name(value: object) -> None:
    with pytest.raises(ConfigurationError, match=r"^max_lateness: must be a number of seconds > 0"):
        check_task_seconds(timeout=None, max_lateness=value)


def test_task_durations_up_to_max_span_are_taken() -> None:
    check_task_seconds(timeout=0.001, max_lateness=MOST, lease_seconds=None)


def context(**changes: Any) -> JobContext:
    values: dict[str, Any] = {
        "job_id": uuid.UUID(int=7), "task": "t", "queue": "q", "attempt": 1, "version": 1,
        "due_at": datetime(2030, 1, 1, tzinfo=UTC), "key": None, "tenant": None,
        "session": None, "worker": "w", "lease_generation": 1}
    return JobContext(**{**values, **changes})


def test_the_idempotency_key_is_the_business_key_else_the_job_id() -> None:
    assert context().idempotency_key == str(uuid.UUID(int=7))
    assert context(key="order-42").idempotency_key == "order-42"
    assert context(key="").idempotency_key == ""


async def test_a_context_without_a_worker_is_never_cancelled_and_keeps_nothing() -> None:
    ctx = context()
    assert ctx.cancelled is False
    assert ctx.heartbeat() is True
    assert await ctx.aheartbeat() is True
    assert ctx.checkpoint({"page": 2}) is False
    assert await ctx.acheckpoint(1) is False
