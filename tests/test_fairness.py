"""Fair dispatch (core/fairness/claim.py, core/fairness/policy.py): weighted
shares, reserved capacity, aging and the bounded class walk, with an
injected clock and a recording broker so every figure is exact.  Each flood
test also runs the same load with fairness off and shows the starvation it
prevents."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import reset_tables
from test_catchup import _APPS, RecordingBroker, _dispose  # noqa: F401 - the fixture

import duebox
from duebox import FakeClock, Settings
from duebox.brokers.base import BrokerContext
from duebox.errors import ConfigurationError
from duebox.fairness.claim import classes
from duebox.fairness.policy import DispatchPolicy, effective_priority, plan
from duebox.leases.claims import ClassKey, class_candidates
from duebox.relay import Relay
from duebox.tables import job

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def make(url: str, clock: FakeClock, policy: DispatchPolicy | None, batch: int = 20,
         **settings_kw: Any) -> tuple[duebox.Duebox, Relay, RecordingBroker]:
    settings = Settings(**{"poll_interval": 1.0, "batch_size": batch,
                           "catchup_after": 3600.0, **settings_kw})
    app = duebox.Duebox(url, "sql://", clock=clock, settings=settings)
    _APPS.append(app)
    app.add_task("bulk", lambda payload, ctx: None, queue="bulk")
    app.add_task("mail", lambda payload, ctx: None, queue="mail")
    broker = RecordingBroker("recording://", BrokerContext(app.engine, clock, app.settings))
    relay = Relay(app, broker=broker, recover_interval=3600, policy=policy)
    return app, relay, broker


def add(app: duebox.Duebox, task: str, n: int, at: datetime, **kw: Any) -> list[uuid.UUID]:
    with app.engine.begin() as conn:
        ids = app.schedule_many(conn, [app.new_job(task, None, at=at, **kw) for _ in range(n)])
    assert isinstance(ids, list)
    return ids


def published(broker: RecordingBroker) -> Counter[str]:
    return Counter(msg.task for _, _, msg in broker.log)


async def run_for(relay: Relay, clock: FakeClock, seconds: float, step: float = 0.25) -> None:
    for _ in range(round(seconds / step)):
        clock.advance(step)
        await relay.run_pass()


# --- the share arithmetic ----------------------------------------------------------


def test_weights_split_a_batch_and_tenants_share_their_queue_equally() -> None:
    policy = DispatchPolicy(queue_weights={"a": 3})
    shares = plan([("a", None), ("b", "x"), ("b", "y")], 40, policy, {})
    assert shares == {("a", None): 30, ("b", "x"): 5, ("b", "y"): 5}


def test_reserved_slots_come_first_and_fractions_carry_over() -> None:
    policy = DispatchPolicy(reserved={"pay": 4}, queue_weights={"bulk": 1000})
    deficits: dict[tuple[str, str | None], float] = {}
    shares = plan([("bulk", None), ("pay", None)], 10, policy, deficits)
    assert shares[("pay", None)] >= 4
    # A 1-in-1000 weight still gets a slot within a few batches: deficits carry.
    tiny = DispatchPolicy(queue_weights={"big": 99})
    deficits = {}
    got = 0
    for _ in range(10):
        got += plan([("big", None), ("small", None)], 10, tiny, deficits)[("small", None)]
        deficits[("small", None)] -= 0  # nothing consumed: the relay subtracts what it took
    assert got >= 1


def test_aging_adds_one_priority_step_per_aging_step_waited() -> None:
    assert effective_priority(2, T0, T0 - timedelta(seconds=5), 10) == 2  # not due yet
    assert effective_priority(2, T0, T0 + timedelta(seconds=29), 10) == 4


@pytest.mark.parametrize(("field", "value"), [
    ("queue_weights", {"a": 0}), ("reserved", {"a": -1}), ("rate", 0), ("aging_step", -1),
    ("tenant_rates", {"t": "fast"}), ("max_classes", 0),
])
def test_bad_policy_values_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=field):
        DispatchPolicy(**{field: value})


def test_policy_from_the_environment() -> None:
    env = {"DUEBOX_DISPATCH_POLICY": '{"rate": 50, "tenant_rates": {"*": 5}}'}
    policy = DispatchPolicy.from_env(env)
    assert policy.enabled
    assert policy.rate == 50
    assert policy.tenant_rate("anyone") == 5
    with pytest.raises(ConfigurationError, match="unknown keys"):
        DispatchPolicy.from_env({"DUEBOX_DISPATCH_POLICY": '{"rat": 5}'})
    assert not DispatchPolicy.from_env({}).enabled


# --- against the database ----------------------------------------------------------


def test_the_class_walk_finds_every_class_with_one_seek_each(database_url: str) -> None:
    clock = FakeClock(T0)
    app, _, _ = make(database_url, clock, DispatchPolicy(fair=True))
    add(app, "bulk", 30, T0, tenant="big", priority=5)
    add(app, "bulk", 3, T0 + timedelta(seconds=9), tenant=None)
    add(app, "mail", 2, T0 - timedelta(seconds=1), tenant="small")
    with app.engine.connect() as conn:
        found = dict(classes(conn, cap=100))
    assert found == {ClassKey("bulk", None, 0): T0 + timedelta(seconds=9),
                     ClassKey("bulk", "big", 5): T0,
                     ClassKey("mail", "small", 0): T0 - timedelta(seconds=1)}


@pytest.mark.parametrize("fair", [True, False])
async def test_a_small_class_keeps_progressing_under_a_flood(database_url: str,
                                                             fair: bool) -> None:
    """2000 high-priority jobs of one tenant, due first, and 20 of another
    tenant in another queue: with fair shares the small class drains while the
    flood still has most of its backlog; in due order (fairness off) it gets
    nothing in the same time.  40 jobs/s shared limit either way."""
    clock = FakeClock(T0)
    policy = DispatchPolicy(fair=fair, rate=40.0) if fair else DispatchPolicy()
    app, relay, broker = make(database_url, clock, policy)
    add(app, "bulk", 2000, T0 - timedelta(seconds=30), tenant="big", priority=9)
    add(app, "mail", 20, T0 - timedelta(seconds=1), tenant="small")
    if not fair:
        relay.pipelines[0].batch_size = 10  # the same throughput, in due order: one batch a pass
        await run_for_unfair(relay, clock, 10)
    else:
        await run_for(relay, clock, 10)
    sent = published(broker)
    if fair:
        assert sent["mail"] == 20, sent
        assert 300 <= sent["bulk"] + sent["mail"] <= 40 * (10 + 1) + 1, sent  # the rate held
    else:
        assert sent["mail"] == 0, sent


async def run_for_unfair(relay: Relay, clock: FakeClock, seconds: float) -> None:
    """Fairness off has no rate limit: claim one bounded batch per quarter
    second (40 jobs/s) straight from the jobstore, as the relay would."""
    for _ in range(round(seconds / 0.25)):
        clock.advance(0.25)
        owner = f"{relay.name}#{uuid.uuid4().hex[:6]}"
        (pipeline,) = relay.pipelines
        records = pipeline.claim(owner)[:10]
        await pipeline.publish(records, owner, relay_stats())


def relay_stats() -> Any:
    from duebox.relay import PassStats

    return PassStats()


@pytest.mark.parametrize("aging_step", [5.0, 1e9])
async def test_aging_bounds_the_wait_of_low_priority_work(database_url: str,
                                                          aging_step: float) -> None:
    """One queue, one tenant: a steady stream of fresh priority-3 jobs uses
    all of a 10 jobs/s limit.  Five priority-0 jobs waiting since the start
    overtake the stream once they waited 3 x aging_step seconds; without
    aging they never do."""
    clock = FakeClock(T0)
    policy = DispatchPolicy(rate=10.0, aging_step=aging_step)
    app, relay, broker = make(database_url, clock, policy)
    low = set(add(app, "bulk", 5, T0, priority=0))
    add(app, "bulk", 10, T0, priority=3)
    for _ in range(100):  # 30 s, 10 fresh urgent jobs a second (the capacity)
        clock.advance(0.3)
        add(app, "bulk", 3, clock.now(), priority=3)
        await relay.run_pass()
    sent = {msg.job_id: now for now, _, msg in broker.log}
    if aging_step < 1e6:
        assert low <= set(sent)
        worst = max((sent[i] - T0).total_seconds() for i in low)
        assert 15 <= worst <= 15 + 5, worst  # 3 steps of 5 s, then the next batches
    else:
        assert not low & set(sent)


async def test_reserved_capacity_serves_a_queue_before_any_weight(database_url: str) -> None:
    clock = FakeClock(T0)
    policy = DispatchPolicy(rate=20.0, burst_seconds=0.25, reserved={"mail": 2},
                            queue_weights={"bulk": 1000})
    app, relay, broker = make(database_url, clock, policy)
    add(app, "bulk", 500, T0 - timedelta(seconds=5))
    add(app, "mail", 20, T0)
    await run_for(relay, clock, 5)
    sent = published(broker)
    # 5 s x 20/s = 100 jobs; a 1000:1 weight alone would give mail ~0.1.
    assert sent["mail"] >= 15, sent


@pytest.mark.postgres
def test_claims_stay_index_backed_on_postgres(pg_server_url: str) -> None:
    """The per-class read is an index range scan in due order: no sort, no
    sequential scan (the plan docs/scale.md shows)."""
    reset_tables(pg_server_url)
    clock = FakeClock(T0)
    app, _, _ = make(pg_server_url, clock, DispatchPolicy(fair=True))
    add(app, "bulk", 2000, T0, tenant="big")
    with app.engine.begin() as conn:
        conn.execute(sa.text("ANALYZE duebox_job"))
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
        stmt = sa.select(job.c.id).where(job.c.state == "SCHEDULED", job.c.queue == "bulk",
                                         job.c.tenant == "big", job.c.priority == 0,
                                         job.c.due_at <= T0)
        plan_text = "\n".join(r[0] for r in conn.execute(
            sa.text("EXPLAIN " + str(stmt.order_by(job.c.due_at).limit(20).compile(
                dialect=conn.dialect, compile_kwargs={"literal_binds": True})))))
        assert "ix_duebox_job_class_due" in plan_text, plan_text
        assert "Sort" not in plan_text, plan_text
        assert len(class_candidates(conn, ClassKey("bulk", "big", 0), horizon=T0, after=None,
                                    limit=20)) == 20


async def test_rate_limit_metrics_move_with_the_limit(database_url: str) -> None:
    """The rate-limited gauge reads 1 while the global bucket runs dry and 0
    once the backlog fits; the wait gauge says how long until tokens."""
    from duebox.metrics import Metrics

    clock = FakeClock(T0)
    app, relay, _ = make(database_url, clock, DispatchPolicy(rate=20.0, burst_seconds=0.25))
    relay.metrics = Metrics()
    add(app, "bulk", 40, T0)
    await run_for(relay, clock, 0.5)
    m = relay.metrics
    assert m.sample("duebox_relay_rate_limited_buckets", {"kind": "global"}) == 1
    assert m.sample("duebox_relay_rate_wait_seconds") > 0
    await run_for(relay, clock, 5)
    assert m.sample("duebox_relay_rate_limited_buckets", {"kind": "global"}) == 0
    assert m.sample("duebox_relay_rate_wait_seconds") == 0


async def test_fair_mode_drains_overdue_jobs_at_the_policy_rate(database_url: str) -> None:
    """Jobs overdue by hours (an outage) go through the fair claim and its
    shared rate, not the per-relay catch-up claim (1 job/s here)."""
    clock = FakeClock(T0)
    app, relay, broker = make(database_url, clock, DispatchPolicy(rate=40.0),
                              catchup_after=60.0, catchup_rate=1.0)
    add(app, "bulk", 200, T0 - timedelta(hours=2))
    await run_for(relay, clock, 2)
    assert 60 <= len(broker.log) <= 40 * 3 + 1, len(broker.log)
