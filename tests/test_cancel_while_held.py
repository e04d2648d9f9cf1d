"""Version-checked execution when a job is leased ahead of its due time.

The sql:// worker claims a moment ahead (``?lookahead=``) and a worker starts
a message that arrives a moment early, holding the handler until the due
time.  A cancel committed in between — before the due time — must still win:
the worker reads the job again right before running it (invariant 4)."""

from __future__ import annotations

from contract.base import message_of
from helpers import (
    Running,
    cancel_committed,
    job_row,
    make_app,
    memory_url,
    schedule_committed,
)

from duebox.brokers.base import Outgoing


async def test_a_job_claimed_ahead_and_cancelled_before_due_never_runs(
        database_url: str) -> None:
    app = make_app(database_url, "sql://?lookahead=1.5")
    try:
        job_id = schedule_committed(app, delay=1.2)
        async with Running(app, relays=0, workers=1) as r:
            await r.wait(lambda: job_row(app.engine, job_id).state == "RUNNING", timeout=10,
                         what="the worker to claim the job ahead of its due time")
            assert cancel_committed(app, job_id)
            await r.wait(lambda: r.discarded.get("cancelled", 0) >= 1, timeout=10,
                         what="the worker to drop the cancelled job at its due time")
        assert app.calls.log == []  # type: ignore[attr-defined]
        assert job_row(app.engine, job_id).state == "CANCELLED"
    finally:
        await app.adispose()


async def test_a_message_started_early_and_cancelled_before_due_never_runs(
        database_url: str) -> None:
    app = make_app(database_url, memory_url())
    try:
        job_id = schedule_committed(app, delay=0.9)
        msg = message_of(app, job_id)
        broker = app.broker("early")
        # Handed over now, 0.9 s before its due time: the worker starts it
        # (leased, version-checked) and holds the handler.
        [res] = await broker.publish([Outgoing(msg, 0.0)])
        assert res.ok, res
        async with Running(app, relays=0, workers=1) as r:
            await r.wait(lambda: job_row(app.engine, job_id).state == "RUNNING", timeout=10,
                         what="the worker to start the early message")
            assert cancel_committed(app, job_id)
            await r.wait(lambda: r.discarded.get("cancelled", 0) >= 1, timeout=10,
                         what="the worker to drop the cancelled job at its due time")
        await broker.close()
        assert app.calls.log == []  # type: ignore[attr-defined]
        assert job_row(app.engine, job_id).state == "CANCELLED"
    finally:
        await app.adispose()


async def test_waiting_is_not_enough_to_be_dropped(database_url: str) -> None:
    """The re-read only drops what changed: a job claimed ahead and left
    alone runs once, at its due time."""
    app = make_app(database_url, "sql://?lookahead=1.0")
    try:
        job_id = schedule_committed(app, delay=0.6)
        async with Running(app, relays=0, workers=1) as r:
            await r.wait(lambda: job_row(app.engine, job_id).state == "SUCCEEDED", timeout=10,
                         what="the job to run")
        assert [c[0] for c in app.calls.log] == [str(job_id)]  # type: ignore[attr-defined]
        assert not r.discarded
    finally:
        await app.adispose()


async def test_many_jobs_claimed_ahead_are_read_again_together(database_url: str) -> None:
    """Forty jobs due at the same instant, claimed ahead, ten cancelled before
    it: their re-reads are batched, and exactly the cancelled ones do not run."""
    from datetime import UTC, datetime, timedelta

    from helpers import all_final

    # Due 4 s ahead, within the 5 s lookahead: claimed at once, and cancelled
    # before due even where a busy machine (a parallel run) takes seconds to
    # claim all forty (at 1.2 s ahead some had started before the cancels).
    app = make_app(database_url, "sql://?lookahead=5")
    try:
        due = datetime.now(UTC) + timedelta(seconds=4)
        with app.engine.begin() as conn:
            ids = [app.schedule(conn, "effect", None, at=due) for _ in range(40)]
        cancelled = ids[::4]
        async with Running(app, relays=0, workers=1, concurrency=4) as r:
            await r.wait(lambda: all(job_row(app.engine, i).state == "RUNNING" for i in ids),
                         timeout=10, what="the worker to claim all forty ahead of their due time")
            for job_id in cancelled:
                assert cancel_committed(app, job_id)
            others = [i for i in ids if i not in cancelled]
            await r.wait(lambda: all_final(app.engine, others), timeout=20,
                         what="the thirty others to succeed")
            await r.wait(lambda: r.discarded.get("cancelled", 0) >= 10, timeout=10,
                         what="the worker to drop the ten cancelled jobs")
        ran = {c[0] for c in app.calls.log}  # type: ignore[attr-defined]
        assert ran == {str(i) for i in others}
        assert all(job_row(app.engine, i).state == "CANCELLED" for i in cancelled)
    finally:
        await app.adispose()
