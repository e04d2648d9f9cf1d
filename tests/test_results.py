"""Job results (issue #33 item 4), through the real relay and worker on
SQLite and PostgreSQL: ``@app.task(store_result=True)`` keeps what the
handler returns, with its completion; ``app.get_job`` / ``app.wait_for``
return it; a result that is not JSON or too large is a permanent failure
that rolls the handler's writes back; a relay deletes results past their
``result_ttl``; ``duebox jobs show`` shows it masked like the payload.
What a result may be (pure): tests/unit/core/reads/test_results.py; masking a
result: tests/unit/core/test_masking.py; the dashboard's job page:
tests/dashboard/test_dashboard_results.py."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from helpers import Running, count, effect_values, effects, make_app, memory_url

import duebox
from duebox import FakeClock, JobState
from duebox.cli.main import cli
from duebox.relay import Relay


def _app(url: str, **settings: Any) -> duebox.Duebox:
    app = make_app(url, memory_url(), **settings)

    @app.task("total", store_result=True)
    def total(payload: Any, ctx: duebox.JobContext) -> Any:
        ctx.session.execute(effects.insert().values(effect_values(ctx)))
        return {"sum": sum(payload["n"]), "token": "tk-secret-1"}

    @app.task("total_async", store_result=True)
    async def total_async(payload: Any, ctx: duebox.JobContext) -> Any:
        await ctx.session.execute(effects.insert().values(effect_values(ctx)))
        return sum(payload["n"]) + 0.5  # a bare float is kept exactly

    @app.task("unkept")
    def unkept(payload: Any, ctx: duebox.JobContext) -> Any:
        return {"dropped": True}

    @app.task("odd", store_result=True, max_attempts=5)
    def odd(payload: Any, ctx: duebox.JobContext) -> Any:
        ctx.session.execute(effects.insert().values(effect_values(ctx)))
        return {1, 2} if payload == "set" else "x" * 70_000

    return app


def _enqueue(app: duebox.Duebox, task: str, payload: Any, **kw: Any) -> uuid.UUID:
    return app.enqueue(task, payload, **kw)


async def test_a_kept_result_is_read_back_after_the_job_ends(database_url: str) -> None:
    app = _app(database_url)
    kept = _enqueue(app, "total", {"n": [1, 2, 3]})
    kept_async = _enqueue(app, "total_async", {"n": [4]})
    unkept = _enqueue(app, "unkept", {})
    async with Running(app):
        info = await app.wait_for_async(kept, timeout=60)
        info_async = await app.wait_for_async(kept_async, timeout=60)
        plain = await app.wait_for_async(unkept, timeout=60)
    assert info.state == JobState.SUCCEEDED
    assert info.result == {"sum": 6, "token": "tk-secret-1"}  # the app's own: unmasked
    assert info.has_result
    assert info_async.result == 4.5
    assert info_async.has_result
    assert plain.state == JobState.SUCCEEDED
    assert plain.result is None
    assert not plain.has_result
    with app.engine.connect() as conn:  # get_job reads the same
        assert app.get_job(conn, kept).result == {"sum": 6, "token": "tk-secret-1"}
    assert app.wait_for(kept, timeout=5) == info  # sync, already ended
    app.dispose()


@pytest.mark.parametrize(("payload", "rule"), [
    ("set", "result: must be JSON-serialisable"),
    ("large", "result: must encode to at most 65536 bytes of JSON (max_result_bytes)"),
])
async def test_a_result_that_cannot_be_kept_fails_the_job_permanently(
        database_url: str, payload: str, rule: str) -> None:
    app = _app(database_url)
    job_id = _enqueue(app, "odd", payload)
    async with Running(app):
        info = await app.wait_for_async(job_id, timeout=60)
    assert info.state == JobState.DEAD  # not retried: it would return the same
    assert info.attempts == 1
    assert info.error_class == "permanent"
    assert info.last_error is not None
    assert rule in info.last_error
    assert not info.has_result
    assert count(app.engine, effects) == 0  # the handler's writes rolled back
    app.dispose()


async def test_a_relay_deletes_results_past_their_ttl(database_url: str) -> None:
    app = _app(database_url)
    job_id = _enqueue(app, "total", {"n": [1]})
    async with Running(app):
        assert (await app.wait_for_async(job_id, timeout=60)).has_result
    # A relay a day and a minute later (the default result_ttl is a day).
    later = duebox.Duebox(database_url, "sql://",
                          clock=FakeClock(datetime.now(UTC) + timedelta(days=1, minutes=1)))
    before = duebox.Duebox(database_url, "sql://",
                           clock=FakeClock(datetime.now(UTC) + timedelta(hours=23)))
    try:
        await Relay(before).run_pass()
        assert app.wait_for(job_id, timeout=5).has_result  # not yet
        await Relay(later).run_pass()
        info = app.wait_for(job_id, timeout=5)
        assert info.state == JobState.SUCCEEDED
        assert not info.has_result
    finally:
        later.dispose()
        before.dispose()
        app.dispose()


def test_waiting_for_a_job_that_does_not_end_in_time(database_url: str) -> None:
    app = _app(database_url)
    job_id = _enqueue(app, "total", {"n": [1]}, delay=3600)
    with pytest.raises(duebox.WaitTimeoutError) as caught:
        app.wait_for(job_id, timeout=0.05)
    assert isinstance(caught.value, duebox.DueboxError)
    assert caught.value.job.state == JobState.SCHEDULED
    assert str(job_id) in str(caught.value)
    for bad in (0, -1, float("nan"), "5", None):
        with pytest.raises(duebox.ValidationError, match=r"^timeout: "):
            app.wait_for(job_id, timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(duebox.JobNotFoundError):
        app.wait_for(uuid.uuid4(), timeout=1)
    app.dispose()


async def test_jobs_show_prints_the_result_masked_like_the_payload(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    app = _app(database_url)
    job_id = _enqueue(app, "total", {"n": [2, 3]})
    async with Running(app):
        await app.wait_for_async(job_id, timeout=60)
    monkeypatch.setenv("DUEBOX_DATABASE_URL", database_url)
    shown = CliRunner().invoke(cli, ["jobs", "show", str(job_id),
                                     "--app", "tests.apps.results_app:app"])
    assert shown.exit_code == 0, shown.output
    assert 'result {"sum": 5, "token": "****"}' in shown.output
    assert "tk-secret-1" not in shown.output
    app.dispose()
