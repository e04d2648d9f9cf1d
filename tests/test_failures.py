"""Failure classes, backoff and retries through the outbox (issue: consumers)."""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from helpers import Running, attempt_rows, job_row, make_app, schedule_committed

import duebox
from duebox import FailureClass, Permanent, RetryPolicy, Throttled, Transient
from duebox.failures import DEFAULT_CLASSIFIER, Verdict, parse_retry_after


class _HTTPError(Exception):
    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status}")
        self.response = type("R", (), {"status_code": status, "headers": headers or {}})()


class PaymentDeclined(Exception):
    pass


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (Permanent("bad"), Verdict(FailureClass.PERMANENT)),
        (Transient("blip"), Verdict(FailureClass.TRANSIENT)),
        (Throttled("slow", retry_after=7), Verdict(FailureClass.THROTTLED, 7)),
        (TimeoutError(), Verdict(FailureClass.TRANSIENT)),
        (ConnectionResetError(), Verdict(FailureClass.TRANSIENT)),
        (_HTTPError(429, {"Retry-After": "12"}), Verdict(FailureClass.THROTTLED, 12.0)),
        (_HTTPError(503), Verdict(FailureClass.TRANSIENT)),
        (_HTTPError(404), Verdict(FailureClass.PERMANENT)),
        (KeyError("x"), Verdict(FailureClass.UNKNOWN)),
    ],
)
def test_default_classification(exc: BaseException, expected: Verdict) -> None:
    assert DEFAULT_CLASSIFIER.classify(exc) == expected


def test_classifier_extends_along_the_mro_and_by_callable() -> None:
    class Declined(PaymentDeclined):
        pass

    c = DEFAULT_CLASSIFIER.extend({
        PaymentDeclined: "permanent",
        ValueError: lambda e: FailureClass.THROTTLED if "rate" in str(e) else None,
    })
    assert c.classify(Declined()).failure_class == FailureClass.PERMANENT
    assert c.classify(ValueError("rate limit")).failure_class == FailureClass.THROTTLED
    assert c.classify(ValueError("other")).failure_class == FailureClass.UNKNOWN
    # the default classifier is unchanged
    assert DEFAULT_CLASSIFIER.classify(Declined()).failure_class == FailureClass.UNKNOWN


def test_retry_after_parsing() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after("Tue, 01 Jan 2030 00:00:30 GMT", now) == 30.0
    assert parse_retry_after("Tue, 31 Dec 2029 00:00:30 GMT", now) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_backoff_is_capped_jittered_and_throttling_waits_longer() -> None:
    policy = RetryPolicy(base=1.0, cap=30.0)
    rng = random.Random(7)
    for attempt in range(1, 20):
        d = policy.delay_for(attempt, Verdict(FailureClass.TRANSIENT), rng)
        assert 0.0 <= d <= min(30.0, 2 ** (attempt - 1))
    samples = {policy.delay_for(3, Verdict(FailureClass.UNKNOWN), rng) for _ in range(50)}
    assert len(samples) > 40  # jittered, not synchronised
    for _ in range(50):
        assert policy.delay_for(1, Verdict(FailureClass.THROTTLED, 40.0), rng) >= 40.0
        assert policy.delay_for(1, Verdict(FailureClass.THROTTLED), rng) >= 2.0


async def test_permanent_failure_goes_straight_to_dead_with_history(database_url: str) -> None:
    app = make_app(database_url)

    @app.task("declined", max_attempts=5)
    def declined(payload: Any, ctx: duebox.JobContext) -> None:
        raise Permanent("card declined")

    job_id = schedule_committed(app, "declined")
    async with Running(app) as r:
        await r.wait(lambda: job_row(app.engine, job_id).state == "DEAD", timeout=10,
                     what="the job to be dead-lettered")
    row = job_row(app.engine, job_id)
    attempts = attempt_rows(app.engine, job_id)
    app.dispose()
    assert (row.attempt, row.error_class) == (1, "permanent")
    assert "card declined" in row.last_error
    assert [(a.outcome, a.error_class) for a in attempts] == [("failed", "permanent")]


async def test_transient_failures_retry_through_the_outbox(database_url: str) -> None:
    app = make_app(database_url)
    seen: list[tuple[int, int, str]] = []

    @app.task("flaky", max_attempts=4, retry=RetryPolicy(base=0.05, cap=0.2))
    def flaky(payload: Any, ctx: duebox.JobContext) -> None:
        seen.append((ctx.attempt, ctx.version, ctx.idempotency_key))
        if ctx.attempt < 3:
            raise ConnectionResetError("peer reset")

    job_id = schedule_committed(app, "flaky", key="order-9")
    async with Running(app) as r:
        await r.wait(lambda: job_row(app.engine, job_id).state == "SUCCEEDED", timeout=15,
                     what="the job to succeed on its third attempt")
    attempts = attempt_rows(app.engine, job_id)
    row = job_row(app.engine, job_id)
    app.dispose()
    assert [a.number for a in attempts] == [1, 2, 3]
    assert [(a.outcome, a.error_class) for a in attempts] == [
        ("failed", "transient"), ("failed", "transient"), ("succeeded", None)]
    assert len({a.id for a in attempts}) == 3
    # same job id, attempt + 1, a new version each retry, a stable idempotency key
    assert [(a, v) for a, v, _ in seen] == [(1, 1), (2, 2), (3, 3)]
    assert {k for _, _, k in seen} == {"order-9"}
    assert row.version == 3
    for failed, nxt in itertools.pairwise(attempts):
        assert nxt.started_at >= failed.finished_at


async def test_exhausted_attempts_go_to_dead(database_url: str) -> None:
    app = make_app(database_url)

    @app.task("always", max_attempts=2, retry=RetryPolicy(base=0.01, cap=0.02))
    def always(payload: Any, ctx: duebox.JobContext) -> None:
        raise KeyError("missing")

    job_id = schedule_committed(app, "always")
    async with Running(app) as r:
        await r.wait(lambda: job_row(app.engine, job_id).state == "DEAD", timeout=10,
                     what="dead after two attempts")
    row = job_row(app.engine, job_id)
    app.dispose()
    assert (row.attempt, row.error_class) == (2, "unknown")


async def test_throttled_handler_waits_at_least_retry_after(database_url: str) -> None:
    app = make_app(database_url)

    @app.task("rate-limited", max_attempts=3, retry=RetryPolicy(base=0.01, cap=0.02))
    def rate_limited(payload: Any, ctx: duebox.JobContext) -> None:
        if ctx.attempt == 1:
            raise Throttled("429 from the provider", retry_after=1.5)

    job_id = schedule_committed(app, "rate-limited")
    async with Running(app) as r:
        await r.wait(lambda: job_row(app.engine, job_id).state == "SUCCEEDED", timeout=15,
                     what="the throttled job to succeed")
    first, second = attempt_rows(app.engine, job_id)
    app.dispose()
    assert first.error_class == "throttled"
    assert second.started_at - first.finished_at >= timedelta(seconds=1.5)


async def test_message_for_a_task_this_worker_lacks_is_dead_lettered(database_url: str) -> None:
    producer = make_app(database_url)

    @producer.task("elsewhere")
    def elsewhere(payload: Any, ctx: duebox.JobContext) -> None:  # pragma: no cover
        raise AssertionError("the worker app does not have this task")

    job_id = schedule_committed(producer, "elsewhere")
    worker_app = make_app(database_url)
    async with Running(worker_app) as r:
        await r.wait(lambda: job_row(worker_app.engine, job_id).state == "DEAD", timeout=10,
                     what="the orphan job to be dead-lettered")
    row = job_row(worker_app.engine, job_id)
    producer.dispose()
    worker_app.dispose()
    assert row.error_class == "permanent"
    assert "task" in row.last_error
