"""A slow handler never holds a fast job back (issue #32): a batched handler
that runs past its straggler time is let go (consumers/batch.py
``Batch.detach``), the jobs behind it run on other threads at once, and the
straggler finishes as a job alone, leased and fenced.

Each test runs a real relay and worker against a real database server
(PostgreSQL, MariaDB) and a real broker, with handlers that block on
events the test controls — never on sleeps: a straggler is a handler that
has not been released yet, whatever the machine's speed.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from backends import Keys
from helpers import (
    Running,
    all_final,
    attempt_rows,
    effect_rows,
    effect_values,
    effects,
    job_row,
    make_app,
)

import duebox
from duebox.failures import HandlerSessionError

# Generous: a loaded CI machine; the point is "before the straggler was
# released", which the tests assert directly.
_WAIT = 60.0


class Straggler:
    """A task ``mixed`` whose jobs with ``{"slow": true}`` block until the
    test releases them; ``write_first`` makes them write through
    ``ctx.session`` before they block (their writes then sit in the batch's
    transaction)."""

    def __init__(self, app: duebox.Duebox, *, write_first: bool = False) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.started: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        lock = threading.Lock()

        @app.task("mixed")
        def mixed(payload: Any, ctx: duebox.JobContext) -> None:
            with lock:
                self.started.setdefault(str(ctx.job_id), datetime.now(UTC).timestamp())
                self.calls[str(ctx.job_id)] = self.calls.get(str(ctx.job_id), 0) + 1
            if payload.get("busy_ms"):  # writes, then runs a little long itself
                ctx.session.execute(effects.insert().values(effect_values(ctx)))
                time.sleep(payload["busy_ms"] / 1000)
                return
            if payload.get("slow"):
                if write_first:
                    ctx.session.execute(effects.insert().values(effect_values(ctx)))
                self.entered.set()
                assert self.release.wait(_WAIT * 2), "never released"
                if not write_first:
                    ctx.session.execute(effects.insert().values(effect_values(ctx)))
                return
            ctx.session.execute(effects.insert().values(effect_values(ctx)))


def _schedule(app: duebox.Duebox, slow: int, fast: int, *, due: datetime | None = None
              ) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """``slow`` blocking jobs then ``fast`` ones, due together (the slow ones
    a millisecond first, so they lead their batch)."""
    at = due or datetime.now(UTC) - timedelta(seconds=1)
    with app.engine.begin() as conn:
        slow_ids = [app.schedule(conn, "mixed", {"slow": True}, at=at) for _ in range(slow)]
        fast_ids = [app.schedule(conn, "mixed", {"n": i}, at=at + timedelta(milliseconds=1))
                    for i in range(fast)]
    return slow_ids, fast_ids


def _seen_short(r: Running) -> None:
    """As if ``mixed`` had run short handlers here already: the lane takes a
    task's jobs only once it knows them to be short."""
    for w in r.workers:
        w.runner.policy.task_pace["mixed"] = 0.0001
        w.runner.policy.pace = 0.0001


@pytest.fixture
def new_app() -> Iterator[Any]:
    """``make_app``, its engines disposed when the test ends (a worker's
    pool holds a connection per executor)."""
    made: list[duebox.Duebox] = []

    def make(*args: Any, **kw: Any) -> duebox.Duebox:
        made.append(make_app(*args, **kw))
        return made[-1]

    yield make
    for app in made:
        app.dispose()


@pytest.fixture(params=["sql", "redis"])
def broker_url(request: pytest.FixtureRequest, redis_keys: Keys) -> str:
    return "sql://" if request.param == "sql" else redis_keys.url()


async def _published(app: duebox.Duebox, broker_url: str, ids: list[uuid.UUID]) -> None:
    """On a broker: the jobs published and marked before any worker reads
    them (a delivery whose row the relay's mark still holds takes the usual
    path, alone, not a batch).  ``sql://`` publishes nothing."""
    if broker_url.startswith("sql:"):
        return
    async with Running(app, relays=1, workers=0) as r:
        await r.wait(lambda: all_final(app.engine, ids, "ENQUEUED"), timeout=_WAIT,
                     what="the relay to publish the jobs")


def _cancel_without_waiting(app: duebox.Duebox, job_id: uuid.UUID) -> bool:
    """``app.cancel`` in a transaction that may wait at most a second for a
    row lock: a cancel that had to wait for a batch would raise here."""
    with app.engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("SET LOCAL lock_timeout = '1s'")
        else:
            conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 1")
        result = app.cancel(conn, job_id)
    assert isinstance(result, bool)
    return result


async def test_the_jobs_behind_a_straggler_run_while_it_blocks(
        server_url: str, broker_url: str, new_app: Any) -> None:
    """A slow handler among fast ones of the same task, in one batch: the
    fast ones finish while it still blocks, a cancel of one of them returns
    at once, and the straggler — leased and heartbeaten meanwhile —
    completes once when released, its effect written once."""
    # A lease longer than the test: nothing here may wait for one to expire.
    app = new_app(server_url, broker_url, lease_seconds=300.0)
    straggler = Straggler(app)
    slow_ids, fast_ids = _schedule(app, 1, 12)
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        _seen_short(r)
        await r.wait(lambda: all_final(app.engine, fast_ids), timeout=_WAIT,
                     what="the fast jobs to finish while the slow one blocks")
        assert straggler.entered.is_set()
        assert not straggler.release.is_set()
        slow = job_row(app.engine, slow_ids[0])
        # Let go by its batch: started for real, leased to this worker.
        assert slow.state == "RUNNING"
        assert slow.lease_owner is not None
        assert slow.lease_owner.startswith(r.workers[0].name + "#")
        assert [a.outcome for a in attempt_rows(app.engine, slow_ids[0])] == [None]
        assert not _cancel_without_waiting(app, fast_ids[-1])  # done: nothing to cancel
        straggler.release.set()
        await r.wait(lambda: all_final(app.engine, slow_ids), timeout=_WAIT,
                     what="the straggler to complete")
    rows = effect_rows(app.engine)
    assert sorted(rows) == sorted(str(j) for j in slow_ids + fast_ids)
    assert all(n == 1 for n in straggler.calls.values()), straggler.calls
    assert [a.outcome for a in attempt_rows(app.engine, slow_ids[0])] == ["succeeded"]
    for job_id in fast_ids:  # none early, none waiting for the release
        assert straggler.started[str(job_id)] >= job_row(app.engine, job_id).due_at.timestamp()


async def test_a_hanging_handler_holds_only_its_own_job(
        server_url: str, broker_url: str, new_app: Any) -> None:
    """A handler that hangs (no timeout set): the jobs behind it and those
    due later run on time, a cancel of a job of its batch returns at once,
    and a cancel of the hanging job itself wins — its late writes roll back."""
    app = new_app(server_url, broker_url, lease_seconds=300.0)
    straggler = Straggler(app)
    slow_ids, fast_ids = _schedule(app, 1, 8)
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        _seen_short(r)
        await r.wait(lambda: all_final(app.engine, fast_ids), timeout=_WAIT,
                     what="the jobs of the hanging handler's batch to finish")
        later = datetime.now(UTC) + timedelta(seconds=1)
        _, due_later = _schedule(app, 0, 20, due=later)
        await r.wait(lambda: all_final(app.engine, due_later), timeout=_WAIT,
                     what="jobs due later to run while the handler hangs")
        assert not straggler.release.is_set()
        for job_id in due_later:
            assert straggler.started[str(job_id)] >= later.timestamp()
        assert _cancel_without_waiting(app, slow_ids[0])  # RUNNING: the cancel wins
        straggler.release.set()
        await r.wait(lambda: r.worker_total("lease_lost") >= 1, timeout=_WAIT,
                     what="the cancelled handler's completion to be fenced")
    assert job_row(app.engine, slow_ids[0]).state == "CANCELLED"
    assert str(slow_ids[0]) not in effect_rows(app.engine)  # its writes rolled back


async def test_a_straggler_that_wrote_first_isolates_its_task(
        server_url: str, broker_url: str, new_app: Any) -> None:
    """A straggler that wrote through ``ctx.session`` before it ran long has
    its writes in its batch's transaction: that batch waits for it (the
    documented limit), and its task then runs alone, so its next slow run
    holds nothing but itself."""
    app = new_app(server_url, broker_url, lease_seconds=300.0)
    straggler = Straggler(app, write_first=True)
    slow_ids, _ = _schedule(app, 1, 0)
    await _published(app, broker_url, slow_ids)
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        _seen_short(r)
        policy = r.workers[0].runner.policy
        await r.wait(lambda: policy.isolated("mixed"), timeout=_WAIT,
                     what="the task to be isolated once its straggler held the batch")
        straggler.release.set()
        await r.wait(lambda: all_final(app.engine, slow_ids), timeout=_WAIT,
                     what="the first straggler to complete")
        straggler.release.clear()
        straggler.entered.clear()
        slow_again, fast_ids = _schedule(app, 1, 8)
        await r.wait(lambda: all_final(app.engine, fast_ids), timeout=_WAIT,
                     what="the fast jobs to finish while the next slow one blocks")
        assert not straggler.release.is_set()
        straggler.release.set()
        await r.wait(lambda: all_final(app.engine, slow_again), timeout=_WAIT,
                     what="the second straggler to complete")
    assert sorted(effect_rows(app.engine)) == sorted(str(j) for j in
                                                     slow_ids + slow_again + fast_ids)
    assert all(n == 1 for n in straggler.calls.values()), straggler.calls


# --- handlers that end duebox's transaction (issue #36, item 3) ---------------------------

_MISUSES = {
    "commit": lambda s: s.commit(),
    "rollback": lambda s: s.rollback(),
    "close": lambda s: s.close(),
    "begin": lambda s: s.begin(),
    "invalidate": lambda s: s.connection().invalidate(),
}


@pytest.mark.parametrize("misuse", sorted(_MISUSES))
@pytest.mark.parametrize("grouped", [True, False], ids=["batch", "alone"])
async def test_a_handler_that_ends_its_transaction_fails_and_its_effect_rolls_back(
        server_url: str, misuse: str, grouped: bool, new_app: Any) -> None:
    """``ctx.session.commit()`` (or rollback, close, a second begin, an
    invalidated connection) is refused or caught: the attempt fails with
    HandlerSessionError naming the rule, the job goes to the dead-letter
    queue (a retry would break the rule again), nothing it wrote is
    committed — not even half of it — and its batch-mates succeed."""
    app = new_app(server_url)
    caught: list[BaseException] = []

    @app.task("rude", group_commit=grouped)
    def rude(payload: Any, ctx: duebox.JobContext) -> None:
        ctx.session.execute(effects.insert().values(effect_values(ctx)))
        try:
            _MISUSES[misuse](ctx.session)
        except HandlerSessionError as exc:  # swallowed: must not help
            caught.append(exc)

    at = datetime.now(UTC) - timedelta(seconds=1)
    with app.engine.begin() as conn:
        rude_id = app.schedule(conn, "rude", None, at=at)
        others = [app.schedule(conn, "effect", {"n": i}, at=at + timedelta(milliseconds=1))
                  for i in range(6)]
    async with Running(app, relays=1, workers=1, concurrency=2) as r:
        for w in r.workers:
            w.runner.policy.task_pace.update(rude=0.0001, effect=0.0001)
        await r.wait(lambda: all_final(app.engine, [rude_id], "DEAD"), timeout=_WAIT,
                     what="the rule-breaking job to be dead-lettered")
        await r.wait(lambda: all_final(app.engine, others), timeout=_WAIT,
                     what="the other jobs to succeed")
    row = job_row(app.engine, rude_id)
    assert "HandlerSessionError" in (row.last_error or "")
    assert "must not end the transaction" in (row.last_error or "")
    assert str(rude_id) not in effect_rows(app.engine)
    assert sorted(effect_rows(app.engine)) == sorted(str(j) for j in others)
    if misuse != "invalidate":
        assert caught, "the call itself was refused"
    with app.engine.connect() as conn:  # nothing half-committed by the misuse
        assert conn.execute(sa.select(sa.func.count()).select_from(effects)
                            .where(effects.c.job_id == str(rude_id))).scalar_one() == 0


async def test_a_detach_that_fails_loses_nothing(
        server_url: str, broker_url: str, monkeypatch: pytest.MonkeyPatch,
        new_app: Any) -> None:
    """Letting a straggler go fails at its commit (the connection drops):
    the batch's transaction is lost, so the jobs that ran before the
    straggler run again (their handlers a second time, their effects once),
    the ones behind it run, and the straggler — its start rolled back —
    runs again after its first run finds no lease; every job succeeds, each
    effect once."""
    from duebox.consumers import batch as batch_module
    from duebox.errors import DatabaseError

    real = batch_module.Batch._complete
    failed: list[bool] = []

    def fail_first_detach(self: Any, conn: Any) -> None:
        if self.running is not None and not failed:  # inside detach, not at a batch's end
            failed.append(True)
            raise DatabaseError("batch: database connection lost (injected)")
        real(self, conn)

    monkeypatch.setattr(batch_module.Batch, "_complete", fail_first_detach)
    app = new_app(server_url, broker_url, lease_seconds=300.0)
    straggler = Straggler(app)
    at = datetime.now(UTC) - timedelta(seconds=1)
    with app.engine.begin() as conn:
        before = [app.schedule(conn, "mixed", {"n": i}, at=at) for i in range(3)]
        slow = app.schedule(conn, "mixed", {"slow": True}, at=at + timedelta(milliseconds=1))
        after = [app.schedule(conn, "mixed", {"n": i}, at=at + timedelta(milliseconds=2))
                 for i in range(6)]
    ids = [*before, slow, *after]
    await _published(app, broker_url, ids)
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        _seen_short(r)
        await r.wait(lambda: straggler.entered.is_set() and failed, timeout=_WAIT,
                     what="a detach to fail")
        await r.wait(lambda: all_final(app.engine, [*before, *after]), timeout=_WAIT,
                     what="the jobs before and behind the straggler to succeed")
        straggler.release.set()
        await r.wait(lambda: all_final(app.engine, ids), timeout=_WAIT,
                     what="the straggler to succeed too")
    assert sorted(effect_rows(app.engine)) == sorted(str(j) for j in ids)
    assert straggler.calls[str(slow)] <= 2


async def test_a_straggler_behind_a_handler_that_ran_long_attached_is_still_let_go(
        server_url: str, broker_url: str, new_app: Any) -> None:
    """In one batch: a handler that writes and then runs 30 ms (past the
    straggler time, but it wrote first: the batch waits for it), then a
    blocked one that wrote nothing, then fast ones.  The watchdog looks at
    each handler afresh: the blocked one is let go and the fast ones finish
    while it blocks.  (It once marked the batch long for good at the first
    handler, and never let the second go.)"""
    app = new_app(server_url, broker_url, lease_seconds=300.0)
    straggler = Straggler(app)
    at = datetime.now(UTC) - timedelta(seconds=1)
    with app.engine.begin() as conn:
        busy = app.schedule(conn, "mixed", {"busy_ms": 30}, at=at)
        slow = app.schedule(conn, "mixed", {"slow": True}, at=at + timedelta(milliseconds=1))
        fast = [app.schedule(conn, "mixed", {"n": i}, at=at + timedelta(milliseconds=2))
                for i in range(6)]
    await _published(app, broker_url, [busy, slow, *fast])
    async with Running(app, relays=1, workers=1, concurrency=4) as r:
        _seen_short(r)
        await r.wait(lambda: all_final(app.engine, [busy, *fast]), timeout=_WAIT,
                     what="the jobs around the blocked handler to finish while it blocks")
        assert not straggler.release.is_set()
        straggler.release.set()
        await r.wait(lambda: all_final(app.engine, [slow]), timeout=_WAIT,
                     what="the blocked handler's job to finish")
    assert sorted(effect_rows(app.engine)) == sorted(str(j) for j in [busy, slow, *fast])
