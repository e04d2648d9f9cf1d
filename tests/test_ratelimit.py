"""Shared dispatch rate limits and tenant quotas (core/fairness/buckets.py): token
buckets in the database, so several relay processes share one budget."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import ClassVar

import pytest
import sqlalchemy as sa
from backends import Keys
from conftest import reset_tables
from scale_procs import RelayProcs, _relay_procs, poll  # noqa: F401 - the fixture

import duebox
from duebox.fairness.buckets import Limit, bucket_wait, lock_buckets, spend_buckets
from duebox.tables import job

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def test_one_bucket_is_one_budget_across_connections(database_url: str) -> None:
    """Two claimers (two connections, as two relays would be) draw from the
    same row: what one spends the other cannot, and it refills by time."""
    engine = duebox.Duebox(database_url).engine
    limits = {"tenant:acme": Limit(rate=10.0, burst=10.0)}
    try:
        with engine.begin() as conn:
            held = lock_buckets(conn, limits, T0)
            assert held["tenant:acme"].available == 10
            held["tenant:acme"].spent = 7
            spend_buckets(conn, held.values(), T0)
        with engine.begin() as conn:
            held = lock_buckets(conn, limits, T0)
            assert held["tenant:acme"].available == 3
            held["tenant:acme"].spent = 3
            spend_buckets(conn, held.values(), T0)
        with engine.begin() as conn:  # a claim that rolls back spends nothing
            held = lock_buckets(conn, limits, T0 + timedelta(seconds=0.5))
            assert held["tenant:acme"].available == 5
            held["tenant:acme"].spent = 5
            spend_buckets(conn, held.values(), T0 + timedelta(seconds=0.5))
            conn.rollback()
        with engine.begin() as conn:
            held = lock_buckets(conn, limits, T0 + timedelta(seconds=60))
            assert held["tenant:acme"].available == 10  # never beyond the burst
            assert bucket_wait(held.values(), 5) == 0.0
    finally:
        engine.dispose()


def published_times(engine: sa.Engine, tenant: str) -> list[datetime]:
    """When the published jobs were claimed: the claim is where tokens are
    spent (the publish and its mark follow within the pass)."""
    with engine.connect() as conn:
        return sorted(conn.execute(
            sa.select(job.c.claimed_at).where(job.c.tenant == tenant,
                                                job.c.published_at.is_not(None))).scalars())


def test_a_claimer_with_an_older_clock_never_moves_the_bucket_back(database_url: str) -> None:
    """A relay that waited for the row lock (or runs a little behind) must not
    rewind ``updated_at``: the interval would be refilled twice."""
    engine = duebox.Duebox(database_url).engine
    limits = {"global": Limit(rate=10.0, burst=10.0)}

    def take(at: float, n: int) -> int:
        with engine.begin() as conn:
            held = lock_buckets(conn, limits, T0 + timedelta(seconds=at))
            got = min(n, held["global"].available)
            held["global"].spent = got
            spend_buckets(conn, held.values(), T0 + timedelta(seconds=at))
        return got

    try:
        assert take(10, 10) == 10
        assert take(9, 10) == 0  # behind the row: nothing refilled
        assert take(10.5, 10) == 5  # 0.5 s since 10, not 1.5 s since 9
    finally:
        engine.dispose()


@pytest.mark.postgres
@pytest.mark.slow
def test_a_tenant_quota_holds_across_two_relay_processes(
    pg_server_url: str, redis_keys: Keys, relay_procs: RelayProcs,
) -> None:
    """Tenant ``acme`` may dispatch 20 jobs/s in all, however many relays run
    and however high its priority; ``beta`` has no quota and is not held
    back.  Two relay processes each with a per-process limit would release
    40/s: the check below fails then."""
    rate = 20.0
    reset_tables(pg_server_url)
    app = duebox.Duebox(pg_server_url, "sql://")
    app.add_task("proc_job", lambda payload, ctx: None)
    now = datetime.now(UTC)
    with app.engine.begin() as conn:
        app.schedule_many(conn, [app.new_job("proc_job", None, at=now, tenant="acme",
                                             priority=100) for _ in range(600)])
        app.schedule_many(conn, [app.new_job("proc_job", None, at=now, tenant="beta")
                                 for _ in range(40)])
    env = {"DUEBOX_DISPATCH_POLICY": f'{{"tenant_rates": {{"acme": {rate}}}}}'}
    broker = redis_keys.url()
    for name in ("r1", "r2"):
        relay_procs.start_relay(pg_server_url, broker, f"{name}-{uuid.uuid4().hex[:6]}", env=env)
    try:
        poll("beta drained and acme past 100 jobs",
             lambda: len(published_times(app.engine, "beta")) == 40
             and len(published_times(app.engine, "acme")) >= 100,
             timeout=30, check=relay_procs.check)
        totals = [relay_procs.stop(name) for name in list(relay_procs.procs)]
        assert all(t["published"] > 0 for t in totals), totals  # both relays worked
        times = published_times(app.engine, "acme")
        first = times[0]
        for i, t in enumerate(times):  # never more than burst + rate x elapsed
            allowed = rate + rate * (t - first).total_seconds()
            assert i + 1 <= allowed + 2, f"{i + 1} acme jobs dispatched {t - first} in"
        span = (times[-1] - first).total_seconds()
        assert len(times) >= 0.7 * rate * span, (len(times), span)  # and it progresses
    finally:
        app.dispose()


# --- backpressure ---------------------------------------------------------------------


def test_aimd_halves_on_overload_and_recovers_step_by_step() -> None:
    from duebox.relay.backpressure import Backpressure

    bp = Backpressure(step=0.25)
    bp.observe(100, 0.01)  # the baseline: 0.1 ms a message
    assert bp.limit(500) == 500
    assert bp.pause(1.0) == 0.0
    bp.observe(100, 0.01, refused=3)
    bp.observe(100, 2.0)  # 200x slower per message: a stall (flow control, throttling)
    assert bp.factor == 0.25
    assert bp.limit(500) == 125
    assert bp.pause(1.0) == 0.75
    bp.observe(100, 0.01)
    bp.observe(100, 0.01)
    assert bp.factor == 0.75
    bp.observe(100, 0.01)
    assert bp.factor == 1.0


async def test_a_throttling_broker_slows_the_relay_down(database_url: str) -> None:
    """The broker refuses (throttles) every message for a while: the relay's
    batches shrink by half each time instead of re-offering the whole batch,
    and grow back once the broker accepts again; the gauge follows."""
    from test_catchup import RecordingBroker

    from duebox import FakeClock, Settings
    from duebox.brokers.base import BrokerContext, Outgoing, PublishResult
    from duebox.metrics import Metrics
    from duebox.relay import Relay

    class Throttling(RecordingBroker):
        throttled = True
        sizes: ClassVar[list[int]] = []

        async def publish(self, batch: list[Outgoing]) -> list[PublishResult]:  # type: ignore[override]
            self.sizes.append(len(batch))
            if self.throttled:
                return [PublishResult(o.message.job_id, False, error="throttled")
                        for o in batch]
            return await super().publish(batch)

    clock = FakeClock(T0)
    app = duebox.Duebox(database_url, "sql://", clock=clock,
                        settings=Settings(batch_size=64, catchup_after=3600.0))
    app.add_task("t", lambda payload, ctx: None)
    broker = Throttling("recording://", BrokerContext(app.engine, clock, app.settings))
    relay = Relay(app, broker=broker, recover_interval=3600, metrics=Metrics())
    try:
        with app.engine.begin() as conn:
            app.schedule_many(conn, [app.new_job("t", None, at=T0) for _ in range(500)])
        for _ in range(2):
            await relay.run_pass()
        sizes = list(broker.sizes)
        # Each refusal halves the factor.  The relay claims the next batch
        # while the broker answers for this one, so a claim has seen the
        # refusals of all the batches before it, or of all but the last.
        assert len(sizes) >= 3, sizes
        assert all(n in (64 >> i, 64 >> max(0, i - 1)) for i, n in enumerate(sizes)), sizes
        assert sizes == sorted(sizes, reverse=True), sizes
        factor = 0.5 ** len(sizes)
        assert relay.metrics.sample("duebox_relay_backpressure_factor") == factor
        broker.throttled = False
        broker.sizes.clear()
        for _ in range(3):
            await relay.run_pass()
        assert broker.sizes[0] == 64 * factor, broker.sizes
        assert broker.sizes[-1] > broker.sizes[0], broker.sizes
        assert relay.metrics.sample("duebox_relay_backpressure_factor") > 0.125
    finally:
        app.dispose()
