"""duebox.testing (issue #33 item 5): an app's jobs run in a test, in
process, on SQLite and ``memory://``, each at its due time on a FakeClock,
in due order, with retries, results and schedules; the pytest fixture
``duebox_harness`` (duebox.pytest_plugin); and the app put back afterwards.
docs/testing.md is the user's page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import duebox
from duebox.testing import Harness, run_due

START = datetime(2031, 3, 1, 9, tzinfo=UTC)


def _app(url: str = "sqlite:///unused.db") -> tuple[duebox.Duebox, list[tuple[str, Any, datetime]]]:
    """An app whose handlers note (task, payload, the clock's now) as they run."""
    app = duebox.Duebox(url, "sql://")
    seen: list[tuple[str, Any, datetime]] = []

    @app.task("remind")
    def remind(payload: Any, ctx: duebox.JobContext) -> None:
        seen.append(("remind", payload, app.clock.now()))
        assert app.clock.now() == ctx.due_at  # run at its due time, exactly

    @app.task("flaky", retry=duebox.RetryPolicy(base=60, cap=60, minimum=60))
    def flaky(payload: Any, ctx: duebox.JobContext) -> None:
        seen.append(("flaky", ctx.attempt, app.clock.now()))
        if ctx.attempt < 3:
            raise ConnectionError("downstream down")

    @app.task("total", store_result=True)
    async def total(payload: Any, ctx: duebox.JobContext) -> Any:
        seen.append(("total", payload, app.clock.now()))
        return sum(payload)

    return app, seen


def test_a_job_runs_when_its_due_time_comes_on_the_fake_clock() -> None:
    app, seen = _app()
    with Harness(app, start=START) as h:
        job_id = app.enqueue("remind", {"order": 42}, delay=timedelta(days=1))
        assert h.run_due() == []  # nothing due yet
        assert h.run_due(until=timedelta(hours=23)) == []
        assert h.clock.now() == START + timedelta(hours=23)  # moved to `until`
        [info] = h.run_due(until=START + timedelta(days=2))
        assert info.id == job_id
        assert info.state == duebox.JobState.SUCCEEDED
        assert seen == [("remind", {"order": 42}, START + timedelta(days=1))]
        assert h.clock.now() == START + timedelta(days=2)


def test_jobs_run_in_due_order_and_retries_at_their_backoff() -> None:
    app, seen = _app()
    with Harness(app, start=START) as h:
        late = app.enqueue("remind", "late", delay=300)
        flaky = app.enqueue("flaky", None, delay=10)
        early = app.enqueue("remind", "early", delay=5)
        infos = h.run_due(until=timedelta(hours=1))
    assert [i.id for i in infos] == [early, flaky, late]  # first run, in due order
    assert [i.state for i in infos] == [duebox.JobState.SUCCEEDED] * 3
    assert infos[1].attempts == 3
    at = START + timedelta(seconds=10)
    assert seen == [
        ("remind", "early", START + timedelta(seconds=5)),
        ("flaky", 1, at), ("flaky", 2, at + timedelta(seconds=60)),
        ("flaky", 3, at + timedelta(seconds=120)),
        ("remind", "late", START + timedelta(seconds=300)),
    ]


async def test_in_an_event_loop_with_an_async_handler_and_its_result() -> None:
    app, _ = _app()
    with Harness(app, start=START) as h:
        job_id = await app.aenqueue("total", [1, 2, 3], delay=60)
        [info] = await h.arun_due(until=60)
        assert info.id == job_id
        assert info.result == 6
        assert (await app.wait_for_async(job_id, timeout=5)).result == 6
        with pytest.raises(duebox.ConfigurationError, match="arun_due"):
            h.run_due()  # the sync form would need a loop of its own


def test_a_schedule_fires_at_each_of_its_times() -> None:
    app, seen = _app()
    app.task("tick", schedule="*/20 * * * *")(
        lambda payload, ctx: seen.append(("tick", None, app.clock.now())))
    with Harness(app, start=START) as h:
        h.run_due(until=timedelta(hours=1))
    assert [t for name, _, t in seen if name == "tick"] == [
        START + timedelta(minutes=m) for m in (20, 40, 60)]  # the first fire after the start


def test_the_app_is_put_back_and_bad_calls_are_refused(tmp_path: Any) -> None:
    app, _ = _app(f"sqlite:///{tmp_path}/own.db")
    settings, clock = app.settings, app.clock
    with Harness(app, start=START) as h:
        assert app.settings.broker_url.startswith("memory://")
        assert app.clock is h.clock
        for bad in (datetime(2031, 3, 2), START - timedelta(seconds=1), "soon", True):
            with pytest.raises(duebox.ValidationError, match=r"^until: "):
                h.run_due(until=bad)  # type: ignore[arg-type]
    assert app.settings is settings
    assert app.clock is clock
    with pytest.raises(duebox.ConfigurationError, match="FakeClock"):
        run_due(app)
    given = duebox.Duebox(engine=app.engine)
    with pytest.raises(duebox.ConfigurationError, match="engine of its own"):
        Harness(given)


@pytest.fixture
def duebox_app() -> duebox.Duebox:
    app, _ = _app()
    return app


def test_the_pytest_fixture(duebox_harness: Harness) -> None:
    app = duebox_harness.app
    job_id = app.enqueue("remind", {"order": 7}, delay=86_400)
    [info] = duebox_harness.run_due(until=86_400)
    assert info.id == job_id
    assert info.state == duebox.JobState.SUCCEEDED
