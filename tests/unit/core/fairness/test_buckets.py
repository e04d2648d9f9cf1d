"""duebox.fairness.buckets on a real SQLite database: a bucket starts full,
refills by elapsed time at its rate up to its burst, keeps what a committed
claim spent and nothing of a rolled-back one, and never counts an interval
twice when a claimer's clock is behind the row's."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from duebox.fairness.buckets import Limit, bucket_wait, lock_buckets, spend_buckets

T0 = datetime(2030, 1, 1, tzinfo=UTC)
LIMITS = {"global": Limit(rate=10.0, burst=20.0), "tenant:a": Limit(rate=2.0, burst=4.0)}


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def engine(sqlite_url: str) -> Iterator[sa.Engine]:
    made = sa.create_engine(sqlite_url)
    yield made
    made.dispose()


def claim(engine: sa.Engine, now: datetime, take: dict[str, int], *, commit: bool = True
          ) -> dict[str, float]:
    """Lock the buckets at ``now``, spend ``take``, commit or roll back;
    the levels seen before spending."""
    with engine.connect() as conn:
        tx = conn.begin()
        held = lock_buckets(conn, LIMITS, now)
        seen = {name: b.tokens for name, b in held.items()}
        for name, n in take.items():
            held[name].spent += n
        spend_buckets(conn, held.values(), now)
        (tx.commit if commit else tx.rollback)()
    return seen


def test_a_new_bucket_is_full(engine: sa.Engine) -> None:
    assert claim(engine, at(0), {}) == {"global": 20.0, "tenant:a": 4.0}


def test_spent_tokens_are_gone_and_come_back_at_the_rate(engine: sa.Engine) -> None:
    claim(engine, at(0), {"global": 15, "tenant:a": 4})
    assert claim(engine, at(0), {}) == {"global": 5.0, "tenant:a": 0.0}
    assert claim(engine, at(0.5), {}) == {"global": 10.0, "tenant:a": 1.0}
    assert claim(engine, at(100), {}) == {"global": 20.0, "tenant:a": 4.0}  # up to the burst


def test_a_rolled_back_claim_spends_nothing(engine: sa.Engine) -> None:
    claim(engine, at(0), {"global": 20}, commit=False)
    assert claim(engine, at(0), {})["global"] == 20.0


def test_a_claimer_behind_the_rows_time_refills_nothing_and_moves_nothing_back(
        engine: sa.Engine) -> None:
    claim(engine, at(10), {"global": 20})
    assert claim(engine, at(5), {"global": 0})["global"] == 0.0  # behind: nothing accrued
    # The row still stands at t=10: one second later 10 tokens, not 60.
    assert claim(engine, at(11), {})["global"] == 10.0


def test_what_a_bucket_allows_and_how_long_until_it_allows_more(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        held = lock_buckets(conn, LIMITS, at(0))
        held["global"].spent = 18
        held["tenant:a"].spent = 1
        assert [b.available for b in held.values()] == [2, 3]
        assert bucket_wait(held.values(), 1) == 0.0
        assert bucket_wait(held.values(), 3) == pytest.approx(0.1)  # global: 1 token at 10/s
        assert bucket_wait(held.values(), 4) == pytest.approx(0.5)  # tenant: 1 token at 2/s
        # More than a bucket's burst never waits for more than the burst.
        assert bucket_wait(held.values(), 1000) == pytest.approx(max(18 / 10, 1 / 2))
