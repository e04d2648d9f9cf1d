"""The dispatch policy on ``sql://``, where workers claim rows themselves
(brokers/sql.py → core/fairness/claim.py): priority with aging, weighted fair
shares, tenant quotas and rate limits shared across worker processes, the
configuration that reaches both relay and worker, and the error for what
cannot apply.  Each behaviour is also run with the policy off, showing what
it changes.  The claim and the buckets run on SQLite, PostgreSQL and MariaDB
(``DUEBOX_TEST_MYSQL``, default root@127.0.0.1:3306)."""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import reset_tables
from test_processes import Procs, poll

import duebox
from duebox import FakeClock, Settings
from duebox.brokers.sql import SQLBroker
from duebox.errors import ConfigurationError
from duebox.fairness.buckets import Limit, lock_buckets, spend_buckets
from duebox.fairness.policy import DispatchPolicy
from duebox.relay import Relay
from duebox.relay.shards import ShardConfig
from duebox.tables import attempt, job, rate_bucket

T0 = datetime(2030, 1, 1, tzinfo=UTC)
LAUNCHER = Path(__file__).parent / "procs" / "sql_fair_worker.py"


@pytest.fixture
def db_url(database_url_all: str) -> str:
    """A migrated, empty database: SQLite, PostgreSQL, MariaDB (conftest)."""
    return database_url_all


@pytest.fixture(autouse=True)
def _no_policy_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUEBOX_DISPATCH_POLICY", raising=False)
    monkeypatch.delenv("DUEBOX_SHARDS", raising=False)


class Worker:
    """A ``sql://`` worker's claim, driven step by step on a fake clock: what
    its claimer task would take, without running the handlers."""

    def __init__(self, url: str, clock: FakeClock, policy: DispatchPolicy | None) -> None:
        settings = Settings(poll_interval=1.0, catchup_after=3600.0, dispatch_policy=policy)
        self.app = duebox.Duebox(url, "sql://?lookahead=0", clock=clock, settings=settings)
        self.app.add_task("bulk", lambda payload, ctx: None, queue="bulk")
        self.app.add_task("mail", lambda payload, ctx: None, queue="mail")
        broker = self.app.broker("w1")
        assert isinstance(broker, SQLBroker)
        self.broker = broker
        self.claimed: list[tuple[datetime, Any]] = []

    def claim(self, limit: int) -> float:
        owner = f"w1#{uuid.uuid4().hex[:6]}"
        records, wake_in = self.broker._claim(owner, limit, ["bulk", "mail"])
        now = self.app.clock.now()
        self.claimed += [(now, r) for r in records]
        return wake_in

    def add(self, task: str, n: int, at: datetime, **kw: Any) -> set[uuid.UUID]:
        with self.app.engine.begin() as conn:
            ids = self.app.schedule_many(conn, [self.app.new_job(task, None, at=at, **kw)
                                                for _ in range(n)])
        assert isinstance(ids, list)
        return set(ids)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for w in made:
        w.app.dispose()


@pytest.mark.parametrize("mode", ["aging", "no aging", "policy off"])
def test_low_priority_work_overtakes_a_stream_of_urgent_jobs_by_aging(
        db_url: str, workers: list[Worker], mode: str) -> None:
    """One queue, one tenant, a 10 jobs/s limit and a steady stream of fresh
    priority-3 jobs that uses all of it.  Five priority-0 jobs waiting since
    the start run once they waited 3 x aging_step (15 s); without aging they
    never do; with the policy off the claim is in due order only: the
    priority-0 jobs, due first, go first and priority means nothing."""
    clock = FakeClock(T0)
    policy = {"aging": DispatchPolicy(rate=10.0, aging_step=5.0),
              "no aging": DispatchPolicy(rate=10.0, aging_step=1e9),
              "policy off": None}[mode]
    w = Worker(db_url, clock, policy)
    workers.append(w)
    low = w.add("bulk", 5, T0, priority=0)
    w.add("bulk", 10, T0, priority=3)
    for _ in range(100):  # 30 s, 10 fresh urgent jobs a second (the capacity)
        clock.advance(0.3)
        w.add("bulk", 3, clock.now(), priority=3)
        w.claim(50)
    when = {r.id: at for at, r in w.claimed}
    if mode == "aging":
        assert low <= set(when)
        worst = max((when[i] - T0).total_seconds() for i in low)
        assert 15 <= worst <= 15 + 5, worst
        assert len(w.claimed) <= 10 * 30 + 10 + 1  # the rate held
    elif mode == "no aging":
        assert not low & set(when)
    else:
        assert low <= set(when)
        assert max((when[i] - T0).total_seconds() for i in low) < 1, "due order"


@pytest.mark.parametrize("fair", [True, False])
def test_a_small_class_keeps_progressing_under_a_flood_on_sql(
        db_url: str, workers: list[Worker], fair: bool) -> None:
    """2000 priority-9 jobs of one tenant due first (an outage's backlog) and
    20 of another tenant in another queue: with fair shares the small class
    drains within 10 s while the flood keeps most of its backlog; in due
    order (policy off) it gets nothing in the same time."""
    clock = FakeClock(T0)
    w = Worker(db_url, clock, DispatchPolicy(fair=True, rate=40.0) if fair else None)
    workers.append(w)
    w.add("bulk", 2000, T0 - timedelta(seconds=30), tenant="big", priority=9)
    w.add("mail", 20, T0 - timedelta(seconds=1), tenant="small")
    for _ in range(40):
        clock.advance(0.25)
        w.claim(10)
    sent = Counter(r.task for _, r in w.claimed)
    if fair:
        assert sent["mail"] == 20, sent
        assert sent["bulk"] + sent["mail"] <= 40 * (10 + 1) + 1, sent
    else:
        assert sent["mail"] == 0, sent


def test_weights_and_reserved_slots_shape_a_worker_claim(db_url: str,
                                                        workers: list[Worker]) -> None:
    clock = FakeClock(T0)
    w = Worker(db_url, clock, DispatchPolicy(queue_weights={"bulk": 3, "mail": 1}))
    workers.append(w)
    w.add("bulk", 300, T0 - timedelta(seconds=5))
    w.add("mail", 300, T0)
    for _ in range(10):
        clock.advance(0.1)
        w.claim(20)
    sent = Counter(r.task for _, r in w.claimed)
    assert sent == {"bulk": 150, "mail": 50}, sent


def test_a_dry_bucket_makes_the_worker_sleep_until_it_refills(db_url: str,
                                                            workers: list[Worker]) -> None:
    """Due jobs waiting for tokens: the claimer is told to wait for 50 ms of
    rate, not to come back at once (the next due time is already past)."""
    clock = FakeClock(T0)
    w = Worker(db_url, clock, DispatchPolicy(rate=20.0, burst_seconds=0.5))
    workers.append(w)
    w.add("bulk", 100, T0)
    assert w.claim(50) == pytest.approx(0.05)
    assert len(w.claimed) == 10
    clock.advance(1.0)
    w.claim(50)
    assert len(w.claimed) == 20  # 1 s of 20/s, capped by the 10-token burst


def test_the_bucket_keeps_fractions_of_a_second_on_every_database(db_url: str) -> None:
    """MariaDB's DATETIME columns keep whole seconds: a level stored at
    12:00:00.9 and read back at 12:00:00 would refill 0.9 s twice.  The level
    is stored as of the instant the row can hold, so the budget is exact."""
    engine = duebox.Duebox(db_url).engine
    limits = {"global": Limit(rate=100.0, burst=100.0)}
    spent = 0
    try:
        for k in range(1, 31):  # every 0.3 s, take all there is: 30 tokens
            at = T0 + timedelta(seconds=0.3 * k)
            with engine.begin() as conn:
                held = lock_buckets(conn, limits, at)["global"]
                held.spent = held.available
                spent += held.spent
                spend_buckets(conn, [held], at)
        # 100 to start + 9 s x 100/s, within a token of rounding per claim.
        assert 100 + 900 - 30 <= spent <= 100 + 900, spent
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(rate_bucket)).scalar() == 1
    finally:
        engine.dispose()


# --- configuration ----------------------------------------------------------------


def test_one_setting_configures_relay_and_sql_worker_alike(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/d.db"
    reset_tables(url)
    env = {"DUEBOX_DATABASE_URL": url, "DUEBOX_BROKER_URL": "sql://",
           "DUEBOX_DISPATCH_POLICY": '{"tenant_rates": {"*": 5}, "aging_step": 2}'}
    app = duebox.Duebox.from_env(env)
    try:
        expected = DispatchPolicy(tenant_rates={"*": 5}, aging_step=2)
        assert app.settings.dispatch_policy == expected
        broker = app.broker("w")
        assert isinstance(broker, SQLBroker)
        assert broker.fair is not None
        assert broker.fair.policy == expected
        assert Relay(app).policy == expected
        app.configure(dispatch_policy={"fair": True})
        assert Relay(app).policy == DispatchPolicy(fair=True)
    finally:
        app.dispose()


def test_no_policy_is_the_plain_due_order_claim(tmp_path: Path) -> None:
    app = duebox.Duebox(f"sqlite:///{tmp_path}/d.db", "sql://")
    broker = app.broker("w")
    assert isinstance(broker, SQLBroker)
    assert broker.fair is None
    app.dispose()


@pytest.mark.parametrize(("value", "field"), [
    ('{"tenant_rates": {"a": -1}}', "tenant_rates['a']"),
    ('{"rates": 5}', "dispatch_policy: unknown keys ['rates']"),
    ("not json", "dispatch_policy: not JSON"),
    ({"aging_step": 0}, "aging_step"),
    ({"fair": "yes"}, "fair"),
])
def test_a_bad_policy_setting_names_the_field(value: Any, field: str) -> None:
    with pytest.raises(ConfigurationError, match=f"^{field}".replace("[", r"\[")):
        Settings(dispatch_policy=value)


def test_shards_on_sql_are_refused_not_ignored(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharding fences a relay's claim for a broker; sql:// workers are not
    sharded, so asking for it there is an error naming the setting."""
    monkeypatch.setenv("DUEBOX_SHARDS", "4")
    app = duebox.Duebox(f"sqlite:///{tmp_path}/d.db", "sql://")
    try:
        with pytest.raises(ConfigurationError, match=r"DUEBOX_SHARDS='4'.*sql://"):
            app.broker("w")
    finally:
        app.dispose()


def test_shards_given_to_a_relay_on_sql_are_refused_not_ignored(tmp_path: Path) -> None:
    app = duebox.Duebox(f"sqlite:///{tmp_path}/d.db", "sql://")
    try:
        with pytest.raises(ConfigurationError, match=r"^shards: .*sql://"):
            Relay(app, shards=ShardConfig(count=4))
    finally:
        app.dispose()


# --- real worker processes -------------------------------------------------------


class WorkerProcs(Procs):
    def start_worker(self, url: str, name: str, env: dict[str, str]) -> None:
        import subprocess
        import sys

        log = (self.tmp / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, str(LAUNCHER), url, name], stdout=log, stderr=subprocess.STDOUT,
            cwd=LAUNCHER.parents[2], env={**os.environ, **env})
        log.close()


@pytest.fixture
def worker_procs(tmp_path: Path) -> Iterator[WorkerProcs]:
    procs = WorkerProcs(tmp_path, LAUNCHER)
    try:
        yield procs
    finally:
        procs.stop_all()


def claimed_times(engine: sa.Engine, tenant: str | None = None) -> list[datetime]:
    """When jobs were claimed by a worker: where their tokens were spent."""
    stmt = sa.select(job.c.claimed_at).where(job.c.claimed_at.is_not(None))
    if tenant is not None:
        stmt = stmt.where(job.c.tenant == tenant)
    with engine.connect() as conn:
        return sorted(conn.execute(stmt).scalars())


def workers_used(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return {w.split("-")[0] for w in conn.execute(sa.select(attempt.c.worker).distinct())
                .scalars()}


def seed(url: str, jobs: list[tuple[int, str | None, int]]) -> duebox.Duebox:
    """(count, tenant, priority) groups, all due now."""
    app = duebox.Duebox(url, "sql://")
    app.add_task("proc_job", lambda payload, ctx: None)
    now = datetime.now(UTC)
    with app.engine.begin() as conn:
        for n, tenant, priority in jobs:
            app.schedule_many(conn, [app.new_job("proc_job", None, at=now, tenant=tenant,
                                                 priority=priority) for _ in range(n)])
    return app


@pytest.mark.postgres
@pytest.mark.slow
def test_a_tenant_quota_holds_across_two_sql_worker_processes(
        pg_server_url: str, worker_procs: WorkerProcs) -> None:
    """Tenant ``acme`` may start 20 jobs/s in all, however many workers run
    and however high its priority; ``beta`` has no quota and is not held
    back.  Per-process buckets would let two workers start 40/s."""
    rate = 20.0
    reset_tables(pg_server_url)
    app = seed(pg_server_url, [(600, "acme", 100), (40, "beta", 0)])
    env = {"DUEBOX_DISPATCH_POLICY": f'{{"tenant_rates": {{"acme": {rate}}}}}'}
    for name in ("wa", "wb"):
        worker_procs.start_worker(pg_server_url, f"{name}-{uuid.uuid4().hex[:6]}", env)
    try:
        poll("beta drained and acme past 100 jobs",
             lambda: len(claimed_times(app.engine, "beta")) == 40
             and len(claimed_times(app.engine, "acme")) >= 100,
             timeout=30, check=worker_procs.check)
        times = claimed_times(app.engine, "acme")
        assert workers_used(app.engine) == {"wa", "wb"}
        first = times[0]
        for i, t in enumerate(times):  # never more than burst + rate x elapsed
            allowed = rate + rate * (t - first).total_seconds()
            assert i + 1 <= allowed + 2, f"{i + 1} acme jobs started {t - first} in"
        span = (times[-1] - first).total_seconds()
        assert len(times) >= 0.7 * rate * span, (len(times), span)  # and it progresses
    finally:
        app.dispose()


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("mariadb", marks=pytest.mark.mariadb)])
def server_db_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(f"{request.param}_server_url"
                                       if request.param == "mariadb" else "pg_server_url")
    reset_tables(url)
    return url


def claimed_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(job)
                                .where(job.c.claimed_at.is_not(None))).scalar_one())


@pytest.mark.slow
def test_a_global_rate_holds_across_two_sql_workers(
        server_db_url: str, worker_procs: WorkerProcs) -> None:
    """50 jobs/s shared by two worker processes: counted at the claim times
    the database recorded, the n-th claim never comes before the bucket
    held n tokens (burst + rate x elapsed), however the two workers race.
    Per-process buckets would let them claim 100/s.  (How close to the
    limit the workers get is a throughput figure, bench/fairness.py's, not
    a correctness one: this test measured it within ±10 % over 5 s and
    failed 3 times in 13 on a loaded machine.)"""
    rate = 50.0
    app = seed(server_db_url, [(2000, None, 0)])
    env = {"DUEBOX_DISPATCH_POLICY": f'{{"rate": {rate}}}'}
    for name in ("wa", "wb"):
        worker_procs.start_worker(server_db_url, f"{name}-{uuid.uuid4().hex[:6]}", env)
    try:
        poll("six seconds' worth of jobs claimed by both workers",
             lambda: claimed_count(app.engine) >= 7 * rate
             and workers_used(app.engine) == {"wa", "wb"},
             timeout=60, check=worker_procs.check)
        times = claimed_times(app.engine)
        first = times[0]
        for i, t in enumerate(times):
            allowed = rate + rate * (t - first).total_seconds()  # a burst of one second
            assert i + 1 <= allowed + 2, f"{i + 1} jobs claimed {t - first} in"
    finally:
        app.dispose()
