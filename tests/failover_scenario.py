"""The PostgreSQL failover scenario's parts, shared by tests/test_pg_failover.py
(its invariants) and bench/pg_failover.py (its figures).

A primary and a streaming standby (tests/pg_pair.py); a relay and workers as
real processes (tests/procs/app_for_tests.py: the task ``proc_effect`` writes
an ``effects`` row through ``ctx.session``) on a multi-host URL; a
:class:`Producer` thread scheduling one job per transaction throughout.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from backends import Procs, poll
from helpers import create_effects, effects
from pg_pair import PgPair

import duebox
from duebox import migrate
from duebox.tables import job, lease

LAUNCHER = Path(__file__).parent / "procs" / "app_for_tests.py"


class Producer:
    """Schedules one job per transaction from a thread, through the
    failover, each due within ``spread`` seconds.  ``acked``: the jobs whose
    commit returned, with when (``time.monotonic()``); ``unsure``: those
    whose commit raised — committed or not, a client cannot tell."""

    def __init__(self, app: duebox.Duebox, seed: int, *, spread: float = 2.0,
                 pause: float = 0.02) -> None:
        self.app = app
        self.rng = random.Random(seed)
        self.spread = spread
        self.pause = pause
        self.acked: list[tuple[uuid.UUID, float]] = []
        self.unsure: list[uuid.UUID] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="producer", daemon=True)

    def __enter__(self) -> Producer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    def _run(self) -> None:
        n = 0
        while not self.stop.wait(self.pause):
            n += 1
            try:
                with self.app.engine.connect() as conn:
                    tx = conn.begin()
                    job_id = self.app.schedule(
                        conn, "proc_effect", {"n": n},
                        delay=timedelta(seconds=self.rng.uniform(0, self.spread)))
                    try:
                        tx.commit()
                    except Exception:
                        self.unsure.append(job_id)
                        continue
                self.acked.append((job_id, time.monotonic()))
            except Exception:  # the database is away: nothing was committed
                self.stop.wait(0.1)

    def acked_after(self, since: float) -> int:
        return sum(1 for _, at in self.acked if at > since)

    def first_after(self, since: float) -> float | None:
        return next((at for _, at in self.acked if at > since), None)

    def ids(self, before: float = float("inf"), after: float = float("-inf")) -> list[uuid.UUID]:
        return [i for i, at in self.acked if after < at < before]


def answering(look: Callable[[], Any]) -> Callable[[], Any]:
    """``look``, taken as not-yet while the database is away (the caller's
    own engine rides the failover as duebox's processes do)."""
    def guarded() -> Any:
        try:
            return look()
        except (sa.exc.OperationalError, sa.exc.InterfaceError):
            return None
    return guarded


def prepare(pair: PgPair, broker: str) -> duebox.Duebox:
    """The tests' app (tests/procs/app_for_tests.py) on the pair's
    multi-host URL, with duebox's tables and the effects table."""
    sys.path.insert(0, str(LAUNCHER.parent))
    try:
        from app_for_tests import build_app
    finally:
        sys.path.remove(str(LAUNCHER.parent))
    app = build_app(pair.multi_host_url(), broker)
    migrate.upgrade(app.engine)
    create_effects(app.engine)
    return app


def start_processes(app: duebox.Duebox, procs: Procs, url: str, broker: str,
                    workers: list[str]) -> None:
    """Relay ``r1`` and the named workers, each its own process on ``url``;
    returns once each has registered."""
    procs.start("r1", "relay", url, broker, "r1")
    for name in workers:
        procs.start(name, "worker", url, broker, name)
    rows = {"relay:r1-relay", *(f"worker:{w}-worker" for w in workers)}
    poll("every process to beat", lambda: registered(app) >= rows, timeout=60, check=procs.check)


def registered(app: duebox.Duebox) -> set[str]:
    with app.engine.connect() as conn:
        return set(conn.execute(sa.select(lease.c.name)).scalars())


def effects_count(app: duebox.Duebox, worker_prefix: str = "", since_us: int = 0) -> int:
    with app.engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).select_from(effects)
            .where(effects.c.worker.startswith(worker_prefix), effects.c.started_us > since_us)
        ).scalar_one())


def job_states(engine: sa.Engine, ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    with engine.connect() as conn:
        return {i: str(s) for i, s in conn.execute(
            sa.select(job.c.id, job.c.state).where(job.c.id.in_(ids)))}


def all_succeeded(engine: sa.Engine, ids: list[uuid.UUID]) -> bool:
    states = job_states(engine, ids)
    return len(states) == len(ids) and set(states.values()) <= {"SUCCEEDED"}


def effect_runs(engine: sa.Engine) -> dict[str, tuple[int, int]]:
    """Each committed effect: job id → (due, started) in microseconds."""
    with engine.connect() as conn:
        return {r.job_id: (r.due_us, r.started_us) for r in conn.execute(
            sa.select(effects.c.job_id, effects.c.due_us, effects.c.started_us))}


def takeovers(procs: Procs) -> int:
    """How many processes relay ``r1`` took for dead (its whole log: a
    process's ``log()`` is only the tail)."""
    return (procs.tmp / "r1.log").read_text(errors="replace").count(
        " is gone (its database session ended)")
