"""Sharded relays with fenced ownership (relay/shards.py): leases with a
generation, claims and marks that carry it, rebalancing without a gap or a
second owner, and a relay paused past its lease (SIGSTOP) that, resumed,
publishes and marks nothing."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from backends import Keys
from conftest import reset_tables
from scale_procs import RelayProcs, _relay_procs, poll  # noqa: F401 - the fixture

import duebox
from duebox import FakeClock, JobState
from duebox.errors import ConfigurationError
from duebox.leases import claims, dispatch_marks, recovery
from duebox.processes.heartbeat import beat
from duebox.relay.shards import ShardConfig, ShardOwner
from duebox.tables import SHARD_SLOTS, job, lease, shard_of

T0 = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
def app(database_url: str) -> Iterator[duebox.Duebox]:
    a = duebox.Duebox(database_url, "sql://", clock=FakeClock(T0))
    a.add_task("t", lambda payload, ctx: None)
    yield a
    a.dispose()


def add(app: duebox.Duebox, n: int) -> list[uuid.UUID]:
    with app.engine.begin() as conn:
        ids = app.schedule_many(conn, [app.new_job("t", None, at=T0) for _ in range(n)])
    assert isinstance(ids, list)
    return ids


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def claim(app: duebox.Duebox, owner: str, fence: Any, now: float = 0) -> list[uuid.UUID]:
    with app.engine.begin() as conn:
        recs = claims.claim_for_dispatch(conn, owner=owner, horizon=at(now), limit=1000,
                                           now=at(now), lease_until=at(now + 5), fence=fence)
    return [r.id for r in recs]


def owners(app: duebox.Duebox, count: int, now: float) -> dict[str, str | None]:
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(lease.c.name, lease.c.owner, lease.c.expires_at)
                            .where(lease.c.name.like(f"shard:%/{count}"))).all()
    return {n: (o if e is not None and e > at(now) else None) for n, o, e in rows}


def test_the_shard_slot_is_stored_at_insert_and_ranges_cover_every_slot(
        app: duebox.Duebox) -> None:
    ids = add(app, 50)
    with app.engine.connect() as conn:
        stored = dict(conn.execute(sa.select(job.c.id, job.c.shard)).all())
    assert stored == {i: shard_of(i) for i in ids}
    for n in (1, 3, 7, 1024):
        cfg = ShardConfig(n)
        covered = [s for k in range(n) for s in range(*cfg.slots(k))]
        assert covered == list(range(SHARD_SLOTS))
        assert all(cfg.shard_for(s) == k for k in range(n) for s in range(*cfg.slots(k)))
    with pytest.raises(ConfigurationError, match="shards"):
        ShardConfig(0)


def test_a_stale_generation_claims_and_marks_nothing(app: duebox.Duebox) -> None:
    """A owns every shard and claims; its lease runs out (it paused) and B
    takes over with a new generation.  A's mark — though it still holds the
    jobs' own lease token — and A's next claim both match no row; B's do."""
    cfg = ShardConfig(4, ttl=10)
    a = ShardOwner(cfg, "relay:A", margin=0.5)
    b = ShardOwner(cfg, "relay:B", margin=0.5)
    ids = add(app, 40)
    a.step(app.engine, at(0))
    assert sorted(a.owned) == [0, 1, 2, 3]
    b.step(app.engine, at(0))
    assert b.owned == {}  # nothing free: no second owner
    assert sorted(claim(app, "A#1", a.fence(at(0)))) == sorted(ids)

    b.step(app.engine, at(11))  # A's leases expired (plus the margin): B takes over
    assert sorted(b.owned) == [0, 1, 2, 3]
    assert all(b.owned[k].generation == a.owned[k].generation + 1 for k in range(4))
    with app.engine.begin() as conn:
        stale = dispatch_marks.mark_enqueued(conn, owner="A#1", ids=ids, now=at(11),
                                       fence=a.fence(at(11)))
        unfenced_would = conn.execute(sa.select(sa.func.count()).select_from(job).where(
            job.c.lease_owner == "A#1", job.c.state == JobState.DISPATCHING)).scalar_one()
    assert stale == 0
    assert unfenced_would == 40

    with app.engine.begin() as conn:  # the jobs' own leases expire; recovery frees them
        recovery.recover(conn, now=at(20), margin=0.5, redeliver_after=900, limit=1000)
    assert claim(app, "A#2", a.fence(at(20)), now=20) == []
    assert sorted(claim(app, "B#1", b.fence(at(20)), now=20)) == sorted(ids)
    with app.engine.begin() as conn:
        assert dispatch_marks.mark_enqueued(conn, owner="B#1", ids=ids, now=at(20),
                                      fence=b.fence(at(20))) == 40
    a.step(app.engine, at(20))  # A's renewal finds the shards gone and forgets them
    assert a.owned == {}
    assert a.lost == 4


def test_rebalance_hands_shards_over_without_a_gap_or_a_second_owner(
        app: duebox.Duebox) -> None:
    """A alone owns all four shards; B starts, and A hands two over (never one
    it has work in flight for); B stops renewing (it died) and A takes them
    back once the lease ran out.  At every step each shard has at most one
    owner, and every shard is owned or about to be taken by a relay below
    its share."""
    cfg = ShardConfig(4, ttl=10)
    a = ShardOwner(cfg, "relay:A", margin=0.5)
    b = ShardOwner(cfg, "relay:B", margin=0.5)

    def alive(name: str, now: float) -> None:  # the relay's heartbeat row
        with app.engine.begin() as conn:
            beat(conn, name=name, now=at(now), ttl=5, info={})

    def check(now: float) -> None:
        assert not set(a.owned) & set(b.owned)
        held = owners(app, 4, now)
        assert all(held.get(cfg.name(k)) == "relay:A" for k in a.owned)
        assert all(held.get(cfg.name(k)) == "relay:B" for k in b.owned)

    alive("relay:A", 0)
    a.step(app.engine, at(0))
    check(0)
    assert len(a.owned) == 4
    alive("relay:B", 1)
    b.step(app.engine, at(1))
    check(1)
    assert b.owned == {}  # nothing free: B waits for A's hand-over
    alive("relay:A", 2)
    a.step(app.engine, at(2), busy={3})  # B holds fewer than its share
    check(2)
    assert sorted(a.owned) == [0, 3]
    b.step(app.engine, at(2))
    check(2)
    assert sorted(b.owned) == [1, 2]
    assert set(owners(app, 4, 2).values()) == {"relay:A", "relay:B"}  # every shard owned
    for t in (3, 4, 5):  # steady state: renewals only, nothing moves
        alive("relay:A", t)
        alive("relay:B", t)
        a.step(app.engine, at(t))
        b.step(app.engine, at(t))
        check(t)
    assert (sorted(a.owned), sorted(b.owned)) == ([0, 3], [1, 2])
    alive("relay:A", 15)  # B stopped at 5: its leases ran out at 15 (+ the margin)
    a.step(app.engine, at(15.6))
    assert sorted(a.owned) == [0, 1, 2, 3]
    assert set(owners(app, 4, 15.6).values()) == {"relay:A"}
    ids = add(app, 20)  # B, were it only paused, would find nothing to act on
    assert claim(app, "B#9", b.fence(at(15.6)), now=15.6) == []
    assert sorted(claim(app, "A#9", a.fence(at(15.6)), now=15.6)) == sorted(ids)


# --- SIGSTOP --------------------------------------------------------------------------


def snapshot(engine: sa.Engine) -> dict[uuid.UUID, tuple[Any, ...]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(job.c.id, job.c.state, job.c.version, job.c.published_at,
                                      job.c.lease_owner, job.c.lease_generation,
                                      job.c.updated_at)).all()
    return {r[0]: tuple(r[1:]) for r in rows}


def leased_to(engine: sa.Engine, prefix: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(job).where(
            job.c.lease_owner.like(f"{prefix}#%"),
            job.c.state == JobState.DISPATCHING)).scalar_one())


def enqueued(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(job).where(
            job.c.state == JobState.ENQUEUED)).scalar_one())


@pytest.mark.postgres
@pytest.mark.slow
def test_a_relay_paused_past_its_lease_publishes_and_marks_nothing(
    pg_server_url: str, redis_keys: Keys, relay_procs: RelayProcs,
) -> None:
    """Relay A (sharded, 1.5 s shard leases) claims 20 near-due jobs and holds
    them until their due time (``max_delay=0``: the relay publishes at due
    time).  SIGSTOP A; relay B takes the shards over, recovers the jobs and
    publishes them.  SIGCONT A: it must drop what it held, unpublished, and
    change no row; Redis holds exactly one message per job."""
    n = 20
    reset_tables(pg_server_url)
    app = duebox.Duebox(pg_server_url, "sql://")
    app.add_task("proc_job", lambda payload, ctx: None)
    broker = redis_keys.url(max_delay=0)
    a_name, b_name = f"A-{uuid.uuid4().hex[:6]}", f"B-{uuid.uuid4().hex[:6]}"
    try:
        relay_procs.start_relay(pg_server_url, broker, a_name, 2, 1.5)
        poll("A to own its shards", lambda: sum(
            1 for o in owners_now(app.engine).values() if o == a_name) == 2,
            timeout=20, check=relay_procs.check)
        due = datetime.now(UTC) + timedelta(seconds=2.5)
        with app.engine.begin() as conn:
            app.schedule_many(conn, [app.new_job("proc_job", None, at=due) for _ in range(n)])
        poll("A to claim and hold every job", lambda: leased_to(app.engine, a_name) == n,
             timeout=20, check=relay_procs.check)
        relay_procs.signal(a_name, signal.SIGSTOP)

        relay_procs.start_relay(pg_server_url, broker, b_name, 2, 1.5)
        poll("B to publish every job", lambda: enqueued(app.engine) == n, timeout=30,
             check=relay_procs.check)
        before = snapshot(app.engine)
        assert redis_keys.stream_len() + redis_keys.parked() == n

        relay_procs.signal(a_name, signal.SIGCONT)
        poll("A to notice it lost its shards and drop its held jobs",
             lambda: "shard lease was lost" in relay_procs.log(a_name), timeout=20,
             check=relay_procs.check)
        a_totals = relay_procs.stop(a_name)
        b_totals = relay_procs.stop(b_name)
        assert (a_totals["published"], a_totals["marked"]) == (0, 0), a_totals
        assert (a_totals["fenced"], a_totals["claimed"]) == (n, n), a_totals
        assert (b_totals["published"], b_totals["marked"]) == (n, n), b_totals
        after = snapshot(app.engine)
        changed = {k for k in after if after[k][:5] != before[k][:5]}
        assert not changed, f"{len(changed)} rows changed after A resumed"
        assert redis_keys.stream_len() + redis_keys.parked() == n  # no duplicate publish
    finally:
        app.dispose()


@pytest.mark.postgres
@pytest.mark.slow
def test_a_relay_paused_inside_its_shard_transaction_holds_no_shard_for_long(
    pg_server_url: str, redis_keys: Keys, relay_procs: RelayProcs,
) -> None:
    """Relay A is SIGSTOPped while its shard step's transaction is open (it
    had renewed its shard leases, not committed): the rows it updated stay
    locked for as long as it is paused.  Relay B must still take the shards
    over once the leases ran out — the server ends A's idle transaction
    after the lease's ttl — and publish the jobs; before, B's acquire waited
    for A's locks forever."""
    reset_tables(pg_server_url)
    app = duebox.Duebox(pg_server_url, "sql://")
    app.add_task("proc_job", lambda payload, ctx: None)
    broker = redis_keys.url()
    a_name, b_name = f"A-{uuid.uuid4().hex[:6]}", f"B-{uuid.uuid4().hex[:6]}"
    db = pg_server_url.rsplit("/", 1)[1]
    try:
        relay_procs.start_relay(pg_server_url, broker, a_name, 2, 1.5)
        poll("A to own its shards", lambda: sum(
            1 for o in owners_now(app.engine).values() if o == a_name) == 2,
            timeout=20, check=relay_procs.check)
        _pause_inside_the_shard_transaction(relay_procs, a_name, app.engine, db)
        with app.engine.begin() as conn:
            ids = app.schedule_many(conn, [app.new_job("proc_job", None) for _ in range(10)])
        relay_procs.start_relay(pg_server_url, broker, b_name, 2, 1.5)
        poll("B to own the shards A holds paused", lambda: sum(
            1 for o in owners_now(app.engine).values() if o == b_name) == 2,
            timeout=60, check=relay_procs.check)
        poll("B to publish every job", lambda: enqueued(app.engine) == len(ids), timeout=60,
             check=relay_procs.check)
        relay_procs.signal(a_name, signal.SIGCONT)
        relay_procs.stop(a_name)
        assert relay_procs.stop(b_name)["published"] == len(ids)
    finally:
        app.dispose()


def _pause_inside_the_shard_transaction(procs: RelayProcs, name: str, engine: sa.Engine,
                                        db: str) -> None:
    """SIGSTOP relay ``name`` while one of its sessions is idle inside a
    transaction that updated ``duebox_lease`` (its shard step), tried again
    until the stop lands inside it (the step lasts milliseconds a pass)."""
    watch = sa.text("SELECT pid, xact_start FROM pg_stat_activity WHERE datname = :db "
                    "AND state = 'idle in transaction' AND query LIKE 'UPDATE duebox_lease%'")
    deadline = time.monotonic() + 120
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        while time.monotonic() < deadline:
            seen = conn.execute(watch, {"db": db}).all()
            if not seen:
                continue
            procs.signal(name, signal.SIGSTOP)
            still = {tuple(r) for r in conn.execute(watch, {"db": db}).all()}
            if any(tuple(r) in still for r in seen):
                return  # stopped with the transaction open
            procs.signal(name, signal.SIGCONT)
    raise AssertionError(f"{name} was never caught inside its shard transaction")


def owners_now(engine: sa.Engine) -> dict[str, str | None]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(lease.c.name, lease.c.owner)
                            .where(lease.c.name.like("shard:%"))).all()
    return dict(rows)


async def test_shard_metrics_and_a_fenced_hold_in_process(app: duebox.Duebox) -> None:
    """An in-process relay (held jobs: no native delay) owns both shards; a
    second owner takes them over once the leases ran out in database time.
    The relay's held jobs are dropped unpublished, and the metrics say so."""
    from test_catchup import RecordingBroker

    from duebox.brokers.base import BrokerContext
    from duebox.metrics import Metrics
    from duebox.relay import Relay

    clock = app.clock
    assert isinstance(clock, FakeClock)
    broker = RecordingBroker("recording://", BrokerContext(app.engine, clock, app.settings),
                             max_delay=0.0)
    relay = Relay(app, broker=broker, recover_interval=3600, hold_window=5.0,
                  shards=ShardConfig(2, ttl=3), metrics=Metrics())
    with app.engine.begin() as conn:
        app.schedule_many(conn, [app.new_job("t", None, at=at(4)) for _ in range(10)])
    await relay.run_pass()
    m = relay.metrics
    assert m.sample("duebox_relay_shards_owned", {"relay": relay.name}) == 2
    assert m.sample("duebox_relay_shard_generation", {"relay": relay.name, "shard": "0"}) == 1
    assert relay.totals.held == 10
    assert broker.log == []

    clock.advance(10)  # the relay "paused": its leases ran out; B takes over
    other = ShardOwner(ShardConfig(2, ttl=3), "relay:B", margin=0.2)
    other.step(app.engine, clock.now())
    assert sorted(other.owned) == [0, 1]
    await relay.run_pass()
    assert broker.log == []  # nothing published with the stale generation
    assert relay.totals.fenced == 10
    assert m.sample("duebox_relay_jobs_fenced_total", {"backend": "recording"}) == 10
    assert m.sample("duebox_relay_shards_owned", {"relay": relay.name}) == 0
    assert m.sample("duebox_relay_shards_lost_total", {"relay": relay.name}) == 2


def test_status_shows_shards_their_owners_and_each_relays_share(app: duebox.Duebox) -> None:
    from duebox.cli.status_view import render
    from duebox.reads.status import build_report

    a = ShardOwner(ShardConfig(2, ttl=10), "relay:A", margin=0.5)
    with app.engine.begin() as conn:
        beat(conn, name="relay:A", now=at(0), ttl=60, info={"backend": "redis"})
    a.step(app.engine, at(0))
    report = build_report(app.engine, at(1))
    assert [(s.shard, s.owner, s.generation) for s in report.shards] == [
        ("0/2", "relay:A", 1), ("1/2", "relay:A", 1)]
    assert report.relays[0].shards == ["0/2", "1/2"]
    assert "shards 0/2,1/2" in render(report)
    later = build_report(app.engine, at(30))  # the leases ran out: no live owner
    assert [s.owner for s in later.shards] == [None, None]


def test_migration_0003_backfills_the_slot_of_existing_jobs(database_url: str) -> None:
    """Jobs written before 0003 get their slot from their id, like new ones."""
    from duebox import migrate
    from duebox.tables import UTCDateTime

    engine = duebox.Duebox(database_url).engine
    try:
        with engine.begin() as conn:
            for name in (*reversed([t.name for t in duebox.metadata.sorted_tables]),
                         "duebox_alembic_version"):
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        migrate.upgrade(engine, "0002")
        old = sa.table("duebox_job", sa.column("id", sa.Uuid()), *(sa.column(c) for c in (
            "task", "queue", "state", "version", "attempt", "max_attempts", "priority",
            "lease_generation")), sa.column("due_at", UTCDateTime()),
            sa.column("created_at", UTCDateTime()), sa.column("updated_at", UTCDateTime()))
        ids = [uuid.uuid4() for _ in range(1500)]  # more than one backfill page
        with engine.begin() as conn:
            conn.execute(old.insert(), [
                {"id": i, "task": "t", "queue": "q", "state": "SCHEDULED", "version": 1,
                 "attempt": 0, "max_attempts": 3, "priority": 0, "lease_generation": 0,
                 "due_at": T0, "created_at": T0, "updated_at": T0} for i in ids])
        migrate.upgrade(engine)
        with engine.connect() as conn:
            stored = dict(conn.execute(sa.select(job.c.id, job.c.shard)).all())
        assert stored == {i: shard_of(i) for i in ids}
    finally:
        engine.dispose()
