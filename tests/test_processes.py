"""Crash tests with real OS processes (tests/procs/app_for_tests.py).

Relays and workers run as separate processes with a 2 s lease and small
batches; one relay and one worker are SIGKILLed mid-run, once they have done
some of the work (seen in the effects table, never guessed with a sleep).
Then every job that was not cancelled must succeed, exactly once, never
before its due time, and no cancelled job may have run.
"""

from __future__ import annotations

import random
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from backends import Procs, poll
from helpers import check_no_early_start, create_effects, effect_rows, effects, memory_url
from sqlalchemy.orm import Session

import duebox
from duebox.tables import attempt, job, lease

pytestmark = pytest.mark.slow

LAUNCHER = Path(__file__).parent / "procs" / "app_for_tests.py"


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path, LAUNCHER)
    try:
        yield p
    finally:
        p.stop_all()


def effects_by(engine: sa.Engine, worker_prefix: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).select_from(effects)
            .where(effects.c.worker.startswith(worker_prefix))
        ).scalar_one())


def unfinished(engine: sa.Engine, ids: list[uuid.UUID]) -> int:
    with engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).select_from(job)
            .where(job.c.id.in_(ids), job.c.state != "SUCCEEDED")
        ).scalar_one())


def leased_to(engine: sa.Engine, owner_prefix: str) -> list[tuple[uuid.UUID, str]]:
    """Jobs a process held a lease on (claimed, being published or running)."""
    with engine.connect() as conn:
        return [(r.id, r.state) for r in conn.execute(
            sa.select(job.c.id, job.c.state).where(job.c.lease_owner.startswith(owner_prefix)))]


def all_running(engine: sa.Engine, names: list[str]) -> bool:
    """Whether each of these processes has written its heartbeat row: it is
    past its start-up (imports, connections, warm-up) and taking work."""
    with engine.connect() as conn:
        beating = set(conn.execute(sa.select(lease.c.name)).scalars())
    return beating >= set(names)


def wait_until_running(app: duebox.Duebox, procs: Procs, names: list[str]) -> None:
    """Jobs are scheduled only once every process runs: a process that
    started seconds after the others (an import on a loaded machine) would
    otherwise find the others done with the work it was to be killed in."""
    poll("every process to beat", lambda: all_running(app.engine, names), timeout=60,
         check=procs.check)


def schedule_jobs(app: duebox.Duebox, n: int, rng: random.Random) -> list[uuid.UUID]:
    with Session(app.engine) as s, s.begin():
        ids = app.schedule_many(s, [app.new_job("proc_effect", {"i": i},
                                                delay=rng.uniform(0, 4)) for i in range(n)])
    assert isinstance(ids, list)
    return ids


def cancel_some(app: duebox.Duebox, ids: list[uuid.UUID]) -> set[uuid.UUID]:
    cancelled = set()
    with app.engine.begin() as conn:
        # In duebox's lock order (docs/worker.md, "Limits"): in another, this
        # transaction and a worker's batch can each hold a row the other
        # waits for, and PostgreSQL aborts one of them as a deadlock.
        for job_id in sorted(ids):
            if app.cancel(conn, job_id):
                cancelled.add(job_id)
    return cancelled


def check_outcome(app: duebox.Duebox, ids: list[uuid.UUID], cancelled: set[uuid.UUID],
                  orphans: list[tuple[uuid.UUID, str]]) -> None:
    engine = app.engine
    wanted = [i for i in ids if i not in cancelled]
    with engine.connect() as conn:
        states = dict(conn.execute(sa.select(job.c.id, job.c.state)
                                   .where(job.c.id.in_(ids))).all())
        outcomes = conn.execute(
            sa.select(attempt.c.job_id, attempt.c.outcome, attempt.c.error)
        ).all()
    # Nothing lost: every job that was not cancelled succeeded; every
    # cancelled one stayed cancelled.
    assert {i for i in wanted if states[i] != "SUCCEEDED"} == set()
    assert {states[i] for i in cancelled} <= {"CANCELLED"}
    # Including what the killed process held a lease on when it died.
    assert {states[i] for i, _ in orphans} <= {"SUCCEEDED", "CANCELLED"}, orphans
    # Exactly once: one committed effect per succeeded job (the primary key
    # would turn a second one into a failed attempt, counted next), none for
    # a cancelled job.
    rows = effect_rows(engine)
    assert set(rows) == {str(i) for i in wanted}
    assert not any(str(i) in rows for i in cancelled)
    succeeded: dict[uuid.UUID, int] = {}
    for job_id, outcome, error in outcomes:
        assert outcome in ("succeeded", "lost", None), (job_id, outcome, error)
        if outcome == "succeeded":
            succeeded[job_id] = succeeded.get(job_id, 0) + 1
    assert succeeded == dict.fromkeys(wanted, 1)
    # Never early.
    check_no_early_start(engine)


def prepare(url: str, broker: str) -> duebox.Duebox:
    sys.path.insert(0, str(LAUNCHER.parent))
    try:
        from app_for_tests import build_app
    finally:
        sys.path.remove(str(LAUNCHER.parent))
    app = build_app(url, broker)
    create_effects(app.engine)
    return app


def test_separate_relays_and_workers_survive_sigkill(database_url: str, procs: Procs) -> None:
    """sql://: two relays (they recover expired leases) and two workers (they
    claim due rows), each its own process; one of each is killed."""
    rng = random.Random(7)
    app = prepare(database_url, "sql://")
    try:
        for name in ("r1", "r2"):
            procs.start(name, "relay", database_url, "sql://", name)
        for name in ("w1", "w2"):
            procs.start(name, "worker", database_url, "sql://", name)
        wait_until_running(app, procs, ["relay:r1-relay", "relay:r2-relay",
                                        "worker:w1-worker", "worker:w2-worker"])
        ids = schedule_jobs(app, 500, rng)
        # Cancel a tenth, at random, while the first jobs come due.
        cancelled = cancel_some(app, rng.sample(ids, 50))
        poll("w1 to commit some effects", lambda: effects_by(app.engine, "w1-") >= 40,
             timeout=30, check=procs.check)
        procs.kill("r1")
        procs.kill("w1")  # with claimed and running jobs, mid-transaction
        orphans = leased_to(app.engine, "w1-")
        # And a few cancels that may find jobs running or done already.
        cancelled |= cancel_some(app, rng.sample(ids, 20))
        poll("every job to finish", lambda: unfinished(app.engine, [
            i for i in ids if i not in cancelled]) == 0, timeout=40, check=procs.check)
        assert effects_by(app.engine, "w2-") > 0
        check_outcome(app, ids, cancelled, orphans)
    finally:
        app.dispose()


def test_colocated_relay_and_worker_processes_on_memory_survive_sigkill(
    database_url: str, procs: Procs
) -> None:
    """memory://: each process is a relay plus a worker sharing an in-process
    broker.  Killing one loses its claimed jobs, its running jobs and every
    message still waiting in its broker (published, marked ENQUEUED, never
    delivered); the survivor must recover them all."""
    rng = random.Random(11)
    # A short ceiling: each relay claims only what is due within 0.5 s, so the
    # two processes share the work instead of the first relay taking it all.
    broker = memory_url() + "?max_delay=0.5"
    app = prepare(database_url, broker)
    try:
        for name in ("p1", "p2"):
            procs.start(name, "both", database_url, broker, name)
        wait_until_running(app, procs, ["relay:p1-relay", "relay:p2-relay",
                                        "worker:p1-worker", "worker:p2-worker"])
        ids = schedule_jobs(app, 400, rng)
        cancelled = cancel_some(app, rng.sample(ids, 40))
        poll("p1 to commit some effects", lambda: effects_by(app.engine, "p1-") >= 40,
             timeout=30, check=procs.check)
        procs.kill("p1")  # claimed, published-but-undelivered and running jobs
        orphans = leased_to(app.engine, "p1-")
        cancelled |= cancel_some(app, rng.sample(ids, 20))
        poll("every job to finish", lambda: unfinished(app.engine, [
            i for i in ids if i not in cancelled]) == 0, timeout=40, check=procs.check)
        check_outcome(app, ids, cancelled, orphans)
    finally:
        app.dispose()
