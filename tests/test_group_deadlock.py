"""Two groups whose handlers deadlock, on PostgreSQL and on MariaDB: how many
times each handler is *called* (issue #24: a handler ran twice with no
process dying).

Two workers, one per queue, each with one executor: a gate job holds it
while the rest of its queue waits, then the four waiting jobs run as one
group — two plain jobs, a "cross" job, one more plain job.  The cross jobs
update two shared rows in opposite orders, meeting at a barrier between the
two updates, so one of them deterministically deadlocks with the other
(no sleeps: the gates, the barrier and the database's deadlock detector
decide the order).

What must happen (docs/worker.md, "Group commit"):

- PostgreSQL: the deadlock is one statement's error inside the victim's
  savepoint; that handler alone fails (its attempt recorded) and is
  retried.  Every other handler runs once.
- MariaDB: InnoDB rolls the victim's whole transaction back.  The handlers
  of that group that had run (the two plain jobs and the victim) run again
  alone, counted in ``WorkerStats.reran``; the rest once.  Never may the
  group go on in a new transaction and complete jobs whose writes were
  rolled back (what it did before: their effects were lost).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import _migrated
from helpers import (
    Running,
    all_final,
    attempt_rows,
    effect_rows,
    effect_values,
    effects,
    make_app,
)

import duebox
from duebox.consumers import Worker, policy
from duebox.tasks import RetryPolicy

shared_metadata = sa.MetaData()
shared = sa.Table(
    "group_deadlock_rows", shared_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("n", sa.Integer, nullable=False),
)


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("mariadb", marks=pytest.mark.mariadb)])
def server_url(request: pytest.FixtureRequest, tmp_path: object) -> str:
    return _migrated(request, tmp_path)


@pytest.fixture(autouse=True)
def groups_of_the_backlog(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups from two waiting jobs on, and no budget cut on a loaded machine:
    each worker's four waiting jobs make exactly one group."""
    monkeypatch.setattr(policy, "BUDGET", 30.0)
    monkeypatch.setattr(policy, "GROUP_LEAST", 2)


class Scene:
    """The tasks: per queue a gate, plain jobs and a cross job; every call
    logged as (job id, attempt)."""

    def __init__(self, app: duebox.Duebox) -> None:
        self.calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.entered = {"a": threading.Event(), "b": threading.Event()}
        self.release = threading.Event()
        # Both cross handlers hold their first row when they pass it.
        self.meet = threading.Barrier(2, timeout=60)

        def log_call(ctx: duebox.JobContext) -> int:
            with self.lock:
                self.calls.append((str(ctx.job_id), ctx.attempt))
                return sum(1 for j, _ in self.calls if j == str(ctx.job_id))

        for queue, (first, second) in (("a", (1, 2)), ("b", (2, 1))):
            self._register(app, queue, first, second, log_call)

    def _register(self, app: duebox.Duebox, queue: str, first: int, second: int,
                  log_call: Any) -> None:
        entered = self.entered[queue]

        @app.task(f"gate_{queue}", queue=queue)
        def gate(payload: Any, ctx: duebox.JobContext) -> None:
            log_call(ctx)
            entered.set()
            assert self.release.wait(60), "the test never released the gates"

        @app.task(f"plain_{queue}", queue=queue)
        def plain(payload: Any, ctx: duebox.JobContext) -> None:
            log_call(ctx)
            ctx.session.execute(effects.insert().values(effect_values(ctx)))

        @app.task(f"cross_{queue}", queue=queue, retry=RetryPolicy(base=0.05, cap=0.1))
        def cross(payload: Any, ctx: duebox.JobContext) -> None:
            nth = log_call(ctx)
            ctx.session.execute(effects.insert().values(effect_values(ctx)))
            bump = sa.update(shared).values(n=shared.c.n + 1)
            ctx.session.execute(bump.where(shared.c.id == first))
            if nth == 1:  # the first call meets the other group's; later ones go through
                self.meet.wait()
            ctx.session.execute(bump.where(shared.c.id == second))

    def count(self, job_id: uuid.UUID) -> int:
        return sum(1 for j, _ in self.calls if j == str(job_id))


@pytest.fixture
def scene_app(server_url: str) -> Iterator[tuple[duebox.Duebox, Scene]]:
    app = make_app(server_url)
    shared_metadata.drop_all(app.engine)
    shared_metadata.create_all(app.engine)
    with app.engine.begin() as conn:
        conn.execute(shared.insert(), [{"id": 1, "n": 0}, {"id": 2, "n": 0}])
    scene = Scene(app)
    try:
        yield app, scene
    finally:
        app.dispose()


def schedule_queue(app: duebox.Duebox, queue: str) -> dict[str, uuid.UUID]:
    """Gate, plain 1, plain 2, cross, plain 3: already due, in this order."""
    first = datetime.now(UTC) - timedelta(seconds=1)
    names = ["gate", "plain1", "plain2", "cross", "plain3"]
    with app.engine.begin() as conn:
        return {name: app.schedule(conn, f"{name.rstrip('123')}_{queue}", None,
                                   at=first + timedelta(milliseconds=i))
                for i, name in enumerate(names)}


async def test_a_deadlock_between_two_groups_repeats_no_handler_it_need_not(
        scene_app: tuple[duebox.Duebox, Scene]) -> None:
    app, scene = scene_app
    jobs = {q: schedule_queue(app, q) for q in ("a", "b")}
    every = [i for by_name in jobs.values() for i in by_name.values()]
    r = Running(app, relays=0, workers=0)
    r.workers = [Worker(app, queues=[q], concurrency=1, group_commit=8) for q in ("a", "b")]
    for w in r.workers:
        w.runner.policy.pace = 0.0001  # takes in its whole queue at once (see test_group_commit)
    try:
        async with r:
            for q in ("a", "b"):
                assert await asyncio.to_thread(scene.entered[q].wait, 60), f"gate {q} never ran"
            # Each worker's four other jobs are in hand, waiting for its executor.
            await r.wait(lambda: all(len(w.runner._leased) == 4 for w in r.workers),
                         timeout=60, what="both workers to hold their four waiting jobs")
            scene.release.set()
            await r.wait(lambda: all_final(app.engine, every), timeout=60,
                         what="every job to succeed")
    finally:
        scene.release.set()
        scene.meet.abort()
    calls = {i: scene.count(i) for i in every}
    assert sorted(effect_rows(app.engine)) == sorted(str(i) for i in every if i not in
                                                     (jobs["a"]["gate"], jobs["b"]["gate"]))
    with app.engine.connect() as conn:
        assert conn.execute(sa.select(shared.c.n).order_by(shared.c.id)).scalars().all() == [2, 2]
    # The victim: the cross job called twice.
    victims = [q for q in ("a", "b") if calls[jobs[q]["cross"]] == 2]
    assert len(victims) == 1, calls
    victim, other = victims[0], "b" if victims[0] == "a" else "a"
    expected = dict.fromkeys(every, 1)
    expected[jobs[victim]["cross"]] = 2
    reran = {"a": 0, "b": 0}
    grouped = {"a": 4, "b": 4}  # each worker ran its four waiting jobs as one group
    cross_attempts = [a.outcome for a in attempt_rows(app.engine, jobs[victim]["cross"])]
    if app.engine.dialect.name == "postgresql":
        # Its savepoint took the deadlock: that handler failed alone, as a
        # recorded attempt, and was retried; nothing else ran twice.
        assert cross_attempts == ["failed", "succeeded"]
        assert "deadlock" in (attempt_rows(app.engine, jobs[victim]["cross"])[0].error or "")
    else:
        # InnoDB rolled the victim's group back whole: the handlers that had
        # run in it ran once more, alone, and were counted; plain 3 had not
        # run and ran once.
        expected[jobs[victim]["plain1"]] = expected[jobs[victim]["plain2"]] = 2
        reran[victim] = 3
        grouped[victim] = 0  # its group was lost: its jobs then ran alone
        assert cross_attempts == ["succeeded"]
    assert calls == expected
    by_queue = dict(zip(("a", "b"), r.workers, strict=True))
    assert {q: w.stats.reran for q, w in by_queue.items()} == reran
    assert {q: w.stats.grouped for q, w in by_queue.items()} == grouped
    assert all(a.outcome == "succeeded" for i in jobs[other].values()
               for a in attempt_rows(app.engine, i))
