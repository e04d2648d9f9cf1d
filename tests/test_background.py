"""``duebox.Background``: a relay and a worker inside the caller's event loop
(a web app's lifespan), stopped cleanly; a part that fails is not hidden."""

from __future__ import annotations

import asyncio
import logging

import pytest
from helpers import make_app, memory_url, schedule_committed, states, wait_for

import duebox


async def test_runs_jobs_through_relay_and_worker_and_stops_cleanly(database_url: str) -> None:
    app = make_app(database_url, memory_url())  # a broker: the relay must hand jobs over
    ids = [schedule_committed(app, "effect", delay=0.2) for _ in range(3)]
    async with duebox.Background(app) as bg:
        assert bg.relay is not None
        assert bg.worker is not None
        await wait_for(lambda: states(app.engine).get("SUCCEEDED") == len(ids), timeout=30,
                       what="three jobs to run")
    assert len(app.calls.log) == 3  # type: ignore[attr-defined]
    assert all(t.done() for t in asyncio.all_tasks() if t.get_name().startswith("duebox-"))
    app.dispose()


async def test_a_part_that_fails_is_logged_and_raised_at_stop(
        database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(database_url)

    class Broken(duebox.Worker):
        async def run(self, stop: asyncio.Event | None = None) -> None:
            raise RuntimeError("handler pool exploded")

    bg = duebox.Background(app, worker=Broken(app))
    with caplog.at_level(logging.ERROR, logger="duebox.background"):
        await bg.start()
        await wait_for(lambda: "stopped with an error" in caplog.text, timeout=10,
                       what="the failure to be logged")
    assert bg.relay is not None  # the relay keeps running until stop()
    with pytest.raises(RuntimeError, match="handler pool exploded"):
        await bg.stop()
    app.dispose()


async def test_bad_arguments_are_clear_errors(tmp_path: object) -> None:
    app = duebox.Duebox(database_url=f"sqlite:///{tmp_path}/bg.db")
    with pytest.raises(duebox.ConfigurationError, match="worker: must be True, False or a"):
        duebox.Background(app, worker="yes")  # type: ignore[arg-type]
    with pytest.raises(duebox.ConfigurationError, match="registers no tasks"):
        await duebox.Background(app, relay=False).start()
