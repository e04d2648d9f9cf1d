"""One line per finished job (issue #33 item 2), off by default: a worker
with ``log_jobs`` writes one ``duebox.jobs`` line for every job it finishes,
alone or several in a transaction, whatever the outcome, with its fields in
JSON; without it, none.  The line's own format: tests/unit/consumers/
test_job_lines.py.  The cost per job, measured: bench/job_lines.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from helpers import Running, all_final, make_app, memory_url, schedule_committed

import duebox
from duebox.cli.processes import child_command
from duebox.observability.logformat import JsonFormatter


@pytest.fixture
def job_lines(caplog: pytest.LogCaptureFixture) -> Callable[[], list[dict[str, Any]]]:
    """The ``duebox.jobs`` lines written so far, as ``--log-format json``
    writes them."""
    caplog.set_level(logging.INFO, logger="duebox.jobs")
    formatter = JsonFormatter()
    return lambda: [json.loads(formatter.format(r)) for r in caplog.records
                    if r.name == "duebox.jobs"]


def _app(url: str, **settings: Any) -> duebox.Duebox:
    app = make_app(url, memory_url(), **settings)

    @app.task("broken", max_attempts=1)
    def broken(payload: Any, ctx: duebox.JobContext) -> None:
        raise ValueError("no")

    return app


async def test_a_worker_logs_one_line_per_finished_job(
        database_url: str, job_lines: Callable[[], list[dict[str, Any]]]) -> None:
    app = _app(database_url, log_jobs=True)
    ok = [schedule_committed(app, "effect", {"n": n}) for n in range(40)]
    dead = schedule_committed(app, "broken", {})
    async with Running(app) as r:
        await r.wait(lambda: all_final(app.engine, ok) and all_final(app.engine, [dead], "DEAD"),
                     timeout=60, what="every job finished")
    lines = job_lines()
    by_job = {line["job_id"]: line for line in lines}
    assert len(lines) == len(by_job) == 41, lines  # one each, no more
    assert {by_job[str(j)]["outcome"] for j in ok} == {"succeeded"}
    assert by_job[str(dead)]["outcome"] == "dead"
    for line in lines:
        assert line["logger"] == "duebox.jobs"
        assert line["level"] == "INFO"
        assert line["attempt"] == 1
        assert line["run_s"] >= 0
        assert line["late_s"] >= 0
        assert line["message"].startswith(f"job {line['job_id']} {line['task']} attempt 1 ")
    app.dispose()


async def test_no_job_lines_by_default(
        database_url: str, job_lines: Callable[[], list[dict[str, Any]]]) -> None:
    app = _app(database_url)
    ids = [schedule_committed(app, "effect", {"n": n}) for n in range(5)]
    async with Running(app) as r:
        await r.wait(lambda: all_final(app.engine, ids), timeout=60, what="the jobs ran")
    assert job_lines() == []
    app.dispose()


def test_log_jobs_reaches_every_worker_process_and_the_environment() -> None:
    options = {"app_spec": "shop.jobs:app", "concurrency": None, "group_commit": None,
               "queues": (), "database_url": None, "broker_url": None, "log_jobs": True}
    args, _ = child_command(options)
    assert "--log-jobs" in args
    assert "--log-jobs" not in child_command({**options, "log_jobs": False})[0]
    assert duebox.Settings.from_env({"DUEBOX_LOG_JOBS": "1"}).log_jobs is True
    assert duebox.Settings().log_jobs is False
