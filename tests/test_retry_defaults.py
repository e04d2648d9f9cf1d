"""The default retry curve (issue #33 item 1): a job that keeps failing under
a task's defaults is tried over more than ten minutes, so a downstream that
is down for ten minutes is ridden out, and no retry comes sooner than half
of its computed backoff ("equal jitter")."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta
from typing import Any

from helpers import Running, attempt_rows, job_row, make_app, schedule_committed

import duebox
from duebox import FailureClass, RetryPolicy
from duebox.failures import Verdict

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def backoff(policy: RetryPolicy, attempt: int) -> float:
    """The computed backoff after attempt ``attempt``, as docs/failures.md states it."""
    return min(policy.cap, policy.base * 2.0 ** min(attempt - 1, 64))


def utc(at: datetime) -> datetime:
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


class SteppedClock(duebox.FakeClock):
    """A fake clock that moves only when the test moves it: the worker's
    sleeps take a little real time instead of moving it on."""

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(min(max(0.0, seconds), 0.02))


def test_no_default_wait_is_below_half_its_backoff_nor_above_it() -> None:
    policy = RetryPolicy()
    for seed in range(200):
        rng = random.Random(seed)
        for attempt in range(1, 80):
            ceiling = min(3600.0, 15.0 * 2 ** min(attempt - 1, 64))
            for cls in (FailureClass.TRANSIENT, FailureClass.UNKNOWN):
                wait = policy.delay_for(attempt, Verdict(cls), rng)
                assert ceiling / 2 <= wait <= ceiling, (seed, attempt, wait)
    # Both ends of the band are reached: the jitter is spread, not a constant.
    waits = [policy.delay(3, random.Random(s)) for s in range(500)]
    assert min(waits) < 30 + 3
    assert max(waits) > 60 - 3


async def test_a_failing_job_under_defaults_is_tried_for_more_than_ten_minutes(
    database_url: str,
) -> None:
    clock = SteppedClock(T0)
    app = make_app(database_url, clock=clock)

    @app.task("call-downstream")  # every retry option at its default
    def call_downstream(payload: Any, ctx: duebox.JobContext) -> None:
        raise ConnectionRefusedError("downstream is down")

    task = app.get_task("call-downstream")
    job_id = schedule_committed(app, "call-downstream", {"order": 42})
    waits: list[float] = []  # each retry's wait, as the worker computed it
    try:
        async with Running(app, relays=0, workers=1) as r:
            for attempt in range(1, task.max_attempts):

                def failed(n: int = attempt) -> Any:
                    row = job_row(app.engine, job_id)
                    return row if row.attempt == n and row.state in ("SCHEDULED", "DEAD") else None

                row = await r.wait(failed, timeout=30, what=f"attempt {attempt} to fail")
                assert row.state == "SCHEDULED", f"dead after {attempt} attempts: {waits}"
                finished = utc(attempt_rows(app.engine, job_id)[-1].finished_at)
                waits.append((utc(row.due_at) - finished).total_seconds())
                clock.advance((utc(row.due_at) - clock.now()).total_seconds())
            await r.wait(lambda: job_row(app.engine, job_id).state == "DEAD", timeout=30,
                         what="the last attempt to dead-letter the job")
        attempts = attempt_rows(app.engine, job_id)
    finally:
        app.dispose()
    assert [a.number for a in attempts] == list(range(1, task.max_attempts + 1))
    first, last = attempts[0].started_at, attempts[-1].started_at
    assert last - first > timedelta(minutes=10), waits
    for n, wait in enumerate(waits, 1):
        most = backoff(task.retry, n)
        assert most / 2 <= wait <= most, (n, wait, most)
    # ...and with its first retries still soon: a blip costs seconds, not minutes.
    assert waits[0] <= 15


def test_a_tasks_own_policy_still_wins() -> None:
    app = duebox.Duebox("sqlite://")
    explicit = RetryPolicy(base=0.01, cap=0.02)

    @app.task("fast", retry=explicit, max_attempts=2)
    def fast(payload: Any, ctx: duebox.JobContext) -> None:
        return None

    task = app.get_task("fast")
    assert (task.retry, task.max_attempts) == (explicit, 2)
    assert task.retry.delay(1) <= 0.01
