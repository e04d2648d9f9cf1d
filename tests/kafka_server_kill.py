"""A Kafka-protocol server SIGKILLed mid-run and started again, empty, at the
same address: the scenario of tests/test_kafka_tansu.py's server-kill test
and of bench/kafka_server_kill.py.

tansu (tests/services/tansu.py) keeps its log in memory only, so its restart
is the worst data loss a broker can have: every message the relay published
and the server acknowledged is gone, with the topics, the consumer group and
its committed offsets.  The SQL outbox is the source of truth; the scenario
checks that it is enough:

* a relay and a worker run as real processes (tests/procs/recovery_proc.py,
  production settings: 30 s leases); a few slow jobs are running (the
  worker's eight slots held) and fast ones are published and waiting in the
  topic behind them when the server is SIGKILLed; more fall due while it is
  down; it is started again, empty, ``outage`` seconds later;
* then every job must run (nothing lost), none before its due time, none
  twice in effect (the effect is a row written through ``ctx.session``, the
  job's own transaction);
* **lateness** of each start is measured from ``max(due time, restart)``:
  a job due while the server was down cannot start before it is back.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from backends import KafkaNames, free_port, poll, tansu
from helpers import create_effects, effect_rows, effects
from recovery_scenario import Fleet, percentile, registered, wait_finished
from sqlalchemy.orm import Session

import duebox
from duebox.tables import attempt, job

# Jobs that hold the worker's eight slots (recovery_proc.py's concurrency)
# across the kill, so the fast ones due meanwhile wait in the topic.
SLOW = 8
SLOW_SECONDS = 4.0


@dataclass
class KillOutcome:
    """What one run measured."""

    jobs: int
    succeeded: int
    unfinished: int
    published_before_kill: int  # ENQUEUED or running when the server died
    lateness: list[float]  # seconds, per start, from max(due, restart)
    lateness_outage: list[float]  # the same, for the jobs due while it was down
    double_effects: int
    early: int
    reconciled: int  # relay log lines saying enqueued jobs were published again
    restarted_after: float  # seconds the server was down
    unfinished_states: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def max_lateness(self) -> float:
        return max(self.lateness, default=0.0)

    def line(self) -> str:
        p = functools.partial(percentile, self.lateness)
        outage = max(self.lateness_outage, default=0.0)
        parts = [
            f"{self.succeeded}/{self.jobs} ran, {self.unfinished} unfinished",
            f"{self.published_before_kill} published or running at the kill",
            f"down {self.restarted_after:.2f} s",
            f"lateness from max(due, restart) p50 {p(0.5):.2f} s, p99 {p(0.99):.2f} s, "
            f"max {self.max_lateness:.2f} s",
            f"max of the {len(self.lateness_outage)} due while down {outage:.2f} s",
            f"double {self.double_effects}, early {self.early}",
            f"relay republished {self.reconciled} times",
        ]
        if self.unfinished_states:
            parts.append(f"unfinished by state {self.unfinished_states}")
        return "kafka server killed: " + "; ".join(parts)


@contextlib.contextmanager
def restartable_tansu() -> Iterator[tuple[str, Any]]:
    """A tansu nobody's child (tests/services/tansu.py ``start_background``:
    SIGKILLed and started again at the same port by the scenario), stopped
    at the end.  Yields its address and a function that kills it and starts
    an empty one there."""
    server = tansu()
    port = free_port()
    address = server.start_background(port)

    def restart(down: float) -> None:
        server.stop_background(server.pidfile_for(port), signal.SIGKILL)
        time.sleep(down)  # the outage itself: nothing to wait for
        server.start_background(port)

    try:
        yield address, restart
    finally:
        server.stop_background(server.pidfile_for(port))


def run(database_url: str, tmp: Path, *, fast: int = 60, spread: float = 5.0,
        kill_after: float = 2.0, outage: float = 2.0, wait: float = 30.0,
        **url_params: object) -> KillOutcome:
    """One run on a tansu of its own; processes started and stopped here."""
    tmp.mkdir(parents=True, exist_ok=True)
    with restartable_tansu() as (bootstrap, restart):
        broker_url = KafkaNames(bootstrap).url(**url_params)
        app = duebox.Duebox(database_url, broker_url)
        app.task("rec_effect")(lambda payload, ctx: None)  # scheduling only
        create_effects(app.engine)
        tag = uuid.uuid4().hex[:4]
        relay, worker = f"kk-r1-{tag}", f"kk-w1-{tag}"
        fleet = Fleet(tmp, database_url, broker_url)
        try:
            fleet.start_role("relay", relay)
            fleet.start_role("worker", worker)
            poll("the relay and the worker to register",
                 lambda: registered(app.engine, [relay, worker]), timeout=60,
                 check=fleet.check)
            # The group has formed and the topic exists before the measured
            # jobs: a deployment that has been up for a while.
            with Session(app.engine) as s, s.begin():
                warm = app.schedule(s, "rec_effect", {"warm_up": True})
            poll("a warm-up job to run", lambda: str(warm) in effect_rows(app.engine),
                 timeout=60, check=fleet.check)
            t0 = datetime.now(UTC) + timedelta(seconds=0.5)
            with Session(app.engine) as s, s.begin():
                slow = app.schedule_many(s, [app.new_job(
                    "rec_effect", {"slow": i, "sleep": {worker: SLOW_SECONDS}}, at=t0)
                    for i in range(SLOW)])
                step = spread / fast
                rest = app.schedule_many(s, [app.new_job(
                    "rec_effect", {"i": i}, at=t0 + timedelta(seconds=0.5 + i * step))
                    for i in range(fast)])
            assert isinstance(slow, list)
            assert isinstance(rest, list)
            ids = slow + rest
            poll("the slow jobs to start", lambda: _running(app.engine, slow) == SLOW,
                 timeout=30, check=fleet.check, interval=0.05)
            kill_wall = t0 + timedelta(seconds=kill_after)
            poll("the kill time", lambda: datetime.now(UTC) >= kill_wall, timeout=30,
                 check=fleet.check, interval=0.01)
            published = _published(app.engine, ids)
            killed_at, killed = time.monotonic(), datetime.now(UTC)
            restart(outage)
            restarted = datetime.now(UTC)
            down = time.monotonic() - killed_at
            notes = wait_finished(app.engine, ids, wait, fleet)
            relay_log = (tmp / f"{relay}.log").read_text(errors="replace")
            return _measure(app.engine, ids, published, (killed, restarted), down,
                            relay_log, notes)
        finally:
            fleet.stop_all()
            app.dispose()


def _running(engine: sa.Engine, ids: list[uuid.UUID]) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(job).where(
            job.c.id.in_(ids), job.c.state == "RUNNING")).scalar_one())


def _states(engine: sa.Engine, ids: list[uuid.UUID]) -> dict[str, int]:
    with engine.connect() as conn:
        return {str(state): int(n) for state, n in conn.execute(
            sa.select(job.c.state, sa.func.count()).where(
                job.c.id.in_(ids), job.c.state != "SUCCEEDED").group_by(job.c.state))}


def _published(engine: sa.Engine, ids: list[uuid.UUID]) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(job).where(
            job.c.id.in_(ids), job.c.state.in_(["ENQUEUED", "RUNNING"]))).scalar_one())


def _measure(engine: sa.Engine, ids: list[uuid.UUID], published: int,
             outage: tuple[datetime, datetime], down: float, relay_log: str,
             notes: list[str]) -> KillOutcome:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(job.c.id, job.c.state, job.c.due_at)
                            .where(job.c.id.in_(ids))).all()
        succeeded_twice = conn.execute(
            sa.select(sa.func.count()).select_from(
                sa.select(attempt.c.job_id).where(attempt.c.job_id.in_(ids),
                                                  attempt.c.outcome == "succeeded")
                .group_by(attempt.c.job_id).having(sa.func.count() > 1).subquery())
        ).scalar_one()
        repeated = conn.execute(
            sa.select(sa.func.count()).select_from(
                sa.select(effects.c.job_id).group_by(effects.c.job_id)
                .having(sa.func.count() > 1).subquery())).scalar_one()
    started = effect_rows(engine)
    killed_us, restart_us = (int(at.timestamp() * 1_000_000) for at in outage)
    lateness, lateness_outage, early = [], [], 0
    for job_id, _, due in rows:
        e = started.get(str(job_id))
        if e is None:
            continue
        due_us = int((due if due.tzinfo else due.replace(tzinfo=UTC)).timestamp() * 1_000_000)
        early += e.started_us < due_us
        late = (e.started_us - max(due_us, restart_us)) / 1e6
        lateness.append(late)
        if killed_us <= due_us <= restart_us:
            lateness_outage.append(late)
    return KillOutcome(
        jobs=len(ids), succeeded=sum(1 for _, s, _ in rows if s == "SUCCEEDED"),
        unfinished=sum(1 for _, s, _ in rows if s != "SUCCEEDED"),
        published_before_kill=published, lateness=lateness, lateness_outage=lateness_outage,
        double_effects=int(succeeded_twice) + int(repeated), early=early,
        reconciled=relay_log.count("publishing them again"), restarted_after=down,
        unfinished_states=_states(engine, ids), notes=notes)
