"""Failed attempts keep their traceback (issue #22 item 1): stored per
attempt, bounded, masked like the payload for masked tasks; shown by
``duebox jobs show`` / ``dlq show`` and the dashboard's job page; logged
once by the worker."""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from typing import Any

import pytest
from click.testing import CliRunner
from helpers import (
    Running,
    attempt_rows,
    column_names,
    job_row,
    make_app,
    schedule_committed,
    schema_diffs,
)

import duebox
from duebox import RetryPolicy
from duebox.failures import TRACEBACK_MAX, bounded_traceback

SECRET = "4111-1111-1111-1111"


class CardDeclined(Exception):
    pass


def _charge(card: str) -> None:
    raise CardDeclined(f"card {card} declined by the bank")


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as page:
        return str(page.read().decode())


def _app(url: str) -> duebox.Duebox:
    app = make_app(url)

    @app.task("charge", max_attempts=2, retry=RetryPolicy(base=0.05, cap=0.1),
              mask=lambda p: {**p, "card": "****"})
    def charge(payload: Any, ctx: duebox.JobContext) -> None:
        _charge(payload["card"])

    @app.task("plain", max_attempts=1)
    def plain(payload: Any, ctx: duebox.JobContext) -> None:
        _charge(payload["card"])

    return app


async def test_each_attempt_keeps_its_masked_traceback_and_logs_it_once(
        database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    app = _app(database_url)
    masked_id = schedule_committed(app, "charge", {"card": SECRET, "order": 7})
    plain_id = schedule_committed(app, "plain", {"card": SECRET})
    with caplog.at_level(logging.INFO, logger="duebox"):
        async with Running(app) as r:
            await r.wait(lambda: {job_row(app.engine, j).state for j in (masked_id, plain_id)}
                         == {"DEAD"}, timeout=15, what="both jobs to be dead-lettered")
    masked_attempts = attempt_rows(app.engine, masked_id)
    plain_attempts = attempt_rows(app.engine, plain_id)
    app.dispose()

    assert len(masked_attempts) == 2
    for a in masked_attempts:
        assert a.traceback.startswith("Traceback (most recent call last):")
        assert "in _charge" in a.traceback  # the frame that raised
        assert "CardDeclined: card **** declined by the bank" in a.traceback
        assert SECRET not in a.traceback
    # A task without a mask hook keeps its traceback as it was.
    assert f"CardDeclined: card {SECRET} declined" in plain_attempts[0].traceback

    failures = [rec for rec in caplog.records if "failed" in rec.getMessage()
                or "dead after" in rec.getMessage()]
    mine = [rec for rec in failures if str(masked_id) in rec.getMessage()]
    assert [rec.levelname for rec in mine] == ["INFO", "WARNING"]  # once per attempt
    for rec in mine:
        assert SECRET not in rec.getMessage()
        assert rec.exc_text is not None
        assert "in _charge" in rec.exc_text
        assert SECRET not in rec.exc_text
        assert (rec.task, rec.attempt) == ("charge", mine.index(rec) + 1)  # type: ignore[attr-defined]
    assert SECRET not in caplog.text.replace(f"card {SECRET} declined", "")


async def test_jobs_show_and_dlq_show_print_the_masked_traceback(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from duebox.cli.main import cli
    from duebox.dashboard import DashboardServer

    app = _app(database_url)
    job_id = schedule_committed(app, "charge", {"card": SECRET})
    async with Running(app) as r:
        await r.wait(lambda: job_row(app.engine, job_id).state == "DEAD", timeout=15,
                     what="the job to be dead-lettered")
    app.dispose()
    module = types.ModuleType("traceback_app")
    module.app = _app(database_url)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "traceback_app", module)
    for command in (["jobs", "show"], ["dlq", "show"]):
        result = CliRunner().invoke(cli, [*command, str(job_id), "--app", "traceback_app:app",
                                          "--database-url", database_url])
        assert result.exit_code == 0, result.output
        assert result.output.count("Traceback (most recent call last):") == 2, result.output
        assert "CardDeclined: card **** declined by the bank" in result.output
        assert SECRET not in result.output  # error text, traceback and payload
    listed = CliRunner().invoke(cli, ["dlq", "list", "--app", "traceback_app:app",
                                      "--database-url", database_url])
    assert "CardDeclined: card **** declined" in listed.output
    assert SECRET not in listed.output
    # The dashboard's job page: each attempt's traceback, folded, masked.
    server = DashboardServer(module.app, port=0).start()  # type: ignore[attr-defined]
    try:
        html = await asyncio.to_thread(_fetch, f"{server.url}/jobs/{job_id}")
    finally:
        server.stop()
    assert html.count("<summary>traceback</summary>") == 2
    assert "CardDeclined: card **** declined by the bank" in html
    assert SECRET not in html
    module.app.dispose()  # type: ignore[attr-defined]


def test_a_huge_traceback_is_bounded_and_keeps_both_ends() -> None:
    def deep(n: int) -> None:
        if n == 0:
            raise ValueError("x" * 50_000)
        deep(n - 1)

    try:
        deep(200)
    except ValueError as exc:
        text = bounded_traceback(exc)
    assert len(text) < TRACEBACK_MAX + 100
    assert text.startswith("Traceback (most recent call last):")
    assert "characters cut" in text
    assert text.endswith("x" * 100)


def test_migration_0006_adds_and_removes_the_column(database_url_all: str) -> None:
    """On SQLite, PostgreSQL and MariaDB: head matches duebox.tables; down to
    0005 drops the column (attempts keep their rows), up again restores it."""
    from alembic import command

    from duebox import migrate

    def columns(engine: Any) -> set[str]:
        return column_names(engine, "duebox_attempt")

    def diffs(engine: Any) -> list[Any]:
        return schema_diffs(engine, "duebox_attempt")

    engine = duebox.Duebox(database_url=database_url_all).engine
    try:
        assert "traceback" in columns(engine)
        assert diffs(engine) == []
        cfg = migrate.alembic_config()
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0005")
        engine.dispose()
        assert "traceback" not in columns(engine)
        migrate.upgrade(engine)
        assert "traceback" in columns(engine)
    finally:
        engine.dispose()
