"""The ``duebox`` command, driven through click's runner against real databases."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from duebox import migrate
from duebox.cli.main import cli
from duebox.tables import audit, job
from tests.apps import cli_app


def _schedule(database_url: str, **kw: object) -> uuid.UUID:
    app = cli_app.app
    with Session(app.engine) as session, session.begin():
        job_id = app.schedule(session, "cli.noop", {"x": 1}, **kw)  # type: ignore[arg-type]
    app.dispose()
    assert isinstance(job_id, uuid.UUID)
    return job_id


def test_db_upgrade_is_idempotent_and_reports_revision(runner: CliRunner) -> None:
    head = migrate.head_revision()
    assert head is not None
    for _ in range(2):
        result = runner.invoke(cli, ["db", "upgrade"])
        assert result.exit_code == 0, result.output
        assert f"revision {head}" in result.output
    result = runner.invoke(cli, ["db", "current"])
    assert f"current {head}  head {head}" in result.output


def test_jobs_show_prints_timeline_and_where_it_is(runner: CliRunner, database_url: str) -> None:
    job_id = _schedule(database_url, delay=3600, key="order-7")
    result = runner.invoke(cli, ["jobs", "show", str(job_id), "--app", "tests.apps.cli_app:app"])
    assert result.exit_code == 0, result.output
    assert f"job {job_id}" in result.output
    assert "parked in the database, due in" in result.output
    assert "key order-7" in result.output
    listed = runner.invoke(cli, ["jobs", "list", "--state", "scheduled"])
    assert str(job_id) in listed.output


def test_jobs_show_prints_the_payload_masked_and_its_hint_names_a_real_option(
        runner: CliRunner, database_url: str) -> None:
    """`jobs show` printed no payload, and without --app told people to pass
    --show-unregistered-payloads, which it did not have (#33 item 8)."""
    app = cli_app.app
    with Session(app.engine) as session, session.begin():
        job_id = app.schedule(session, "cli.noop", {"user": "bob", "password": "hunter2"},
                              delay=3600)
    app.dispose()
    known = runner.invoke(cli, ["jobs", "show", str(job_id), "--app", "tests.apps.cli_app:app"])
    assert known.exit_code == 0, known.output
    assert '  payload {"password": "****", "user": "bob"}' in known.output, known.output
    unknown = runner.invoke(cli, ["jobs", "show", str(job_id)])
    assert unknown.exit_code == 0, unknown.output
    assert "hunter2" not in unknown.output
    assert "bob" not in unknown.output
    [hint] = [line for line in unknown.output.splitlines() if "payload" in line]
    assert "--show-unregistered-payloads" in hint, unknown.output
    for command in (["jobs", "show"], ["dlq", "show"]):
        asked = runner.invoke(cli, [*command, str(job_id), "--show-unregistered-payloads"])
        assert asked.exit_code == 0, asked.output
        # Shown, and the app's secret keys still apply.
        assert '  payload {"password": "****", "user": "bob"}' in asked.output, asked.output


def test_jobs_cancel_requires_operator_and_reason_and_writes_audit(
    runner: CliRunner, database_url: str
) -> None:
    job_id = _schedule(database_url, delay=60)
    refused = runner.invoke(cli, ["jobs", "cancel", str(job_id), "--reason", "x"])
    assert refused.exit_code != 0
    assert "--operator" in refused.output
    engine = create_engine(database_url)
    with engine.connect() as conn:
        assert conn.execute(select(job.c.state).where(job.c.id == job_id)).scalar() == "SCHEDULED"
    done = runner.invoke(cli, ["jobs", "cancel", str(job_id), "--operator", "alice",
                               "--reason", "customer asked"])
    assert done.exit_code == 0, done.output
    with engine.connect() as conn:
        state, version = conn.execute(
            select(job.c.state, job.c.version).where(job.c.id == job_id)).one()
        row = conn.execute(select(audit).where(audit.c.job_id == job_id)).one()
    engine.dispose()
    assert (state, version) == ("CANCELLED", 2)
    assert (row.operator, row.action, row.reason) == ("alice", "cancel", "customer asked")


def test_status_json_counts_due_backlog(runner: CliRunner, database_url: str) -> None:
    _schedule(database_url)
    _schedule(database_url, delay=3600)
    result = runner.invoke(cli, ["status", "--json"])
    assert result.exit_code == 4, result.output  # due work and no relay or worker
    report = json.loads(result.output)
    assert report["verdict"] == "unhealthy"
    assert "no live worker" in report["problems"]
    assert report["states"] == {"SCHEDULED": 2}
    assert report["queues"]["default"]["due_backlog"] == 1


def test_status_counts_only_work_due_soon_against_missing_processes(
        runner: CliRunner, database_url: str) -> None:
    """No relay and the only job due in an hour: degraded (3), not unhealthy
    (4), since a relay started meanwhile takes it in time (#33 item 9);
    --due-within says how far ahead a job counts."""
    _schedule(database_url, delay=3600)
    later = runner.invoke(cli, ["status", "--json"])
    assert later.exit_code == 3, later.output
    report = json.loads(later.output)
    assert report["problems"] == []
    assert "no live worker" in report["warnings"]
    assert any(w.startswith("no live relay") for w in report["warnings"])
    ahead = runner.invoke(cli, ["status", "--json", "--due-within", "7200"])
    assert ahead.exit_code == 4, ahead.output
    assert "no live worker" in json.loads(ahead.output)["problems"]
    bad = runner.invoke(cli, ["status", "--due-within", "-1"])
    assert bad.exit_code == 2
    assert "--due-within" in bad.output


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("nocolon", "must be 'module:attribute'"),
        ("tests.apps.cli_app:", "must be 'module:attribute'"),
        ("no.such.module:app", "cannot import module"),
        ("tests.apps.cli_app:missing", "has no attribute"),
        ("tests.apps.cli_app:not_an_app", "not a duebox.Duebox"),
    ],
)
def test_malformed_app_is_a_clear_error(spec: str, needle: str) -> None:
    result = CliRunner().invoke(cli, ["worker", "--app", spec])
    assert result.exit_code == 1
    assert "ConfigurationError: --app:" in result.output
    assert needle in result.output


def test_bad_job_id_and_unknown_broker_scheme(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["jobs", "show", "not-a-uuid"])
    assert result.exit_code == 1
    assert "job 'not-a-uuid': no such job" in result.output
    result = runner.invoke(cli, ["status", "--broker-url", "carrier-pigeon://x"])
    assert result.exit_code == 1
    assert "broker_url: unknown scheme 'carrier-pigeon'" in result.output


def test_unreachable_database_is_a_database_error() -> None:
    result = CliRunner().invoke(
        cli, ["status", "--database-url", "postgresql+psycopg://127.0.0.1:1/nowhere"])
    assert result.exit_code == 1
    assert "DatabaseError" in result.output


@pytest.mark.slow
def test_demo_holds_every_guarantee(tmp_path: Path) -> None:
    """The README's first command, as a user runs it: a fresh directory, SQLite."""
    proc = subprocess.run(
        [sys.executable, "-m", "duebox.cli", "demo", "--jobs", "200", "--spread", "3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "ran 190" in out
    assert "ran before due time: 0" in out
    assert "ran twice: 0" in out
    assert "cancelled but ran: 0" in out
    assert (tmp_path / "duebox.db").exists()


def test_the_demo_stores_its_instants_to_the_microsecond(database_url_all: str) -> None:
    """The demo tells early starts from two epoch instants it stores.  On
    MySQL/MariaDB a FLOAT column rounded both to 128 s: lateness read
    0.0 ms and a start 0.5 ms early was invisible.  A table an earlier
    version created that way is replaced."""
    import sqlalchemy as sa

    import duebox
    from duebox.cli import demo

    app = duebox.Duebox(database_url_all, "sql://")
    try:
        if app.engine.dialect.name in ("mysql", "mariadb"):
            old = sa.MetaData()
            sa.Table(demo.effect.name, old, sa.Column("job_id", sa.String(36), primary_key=True),
                     sa.Column("run_id", sa.String(32)), sa.Column("due", sa.Float),
                     sa.Column("started", sa.Float))
            old.create_all(app.engine)
        demo.create_effect_table(app)
        due = 1_780_000_000.123456
        with app.engine.begin() as conn:
            conn.execute(demo.effect.insert().values(job_id="j", run_id="r", due=due,
                                                     started=due - 0.0005))
            row = conn.execute(select(demo.effect.c.due, demo.effect.c.started)).one()
        assert row.started - row.due == pytest.approx(-0.0005, abs=1e-5)
    finally:
        demo.effect.drop(app.engine, checkfirst=True)
        app.dispose()
