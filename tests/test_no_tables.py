"""Before the tables exist (issue #22 item 3): commands say "run `duebox db
upgrade`" and exit non-zero, a read-only command never creates a database,
and a ``postgres://`` URL (what platforms hand out) is PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from duebox.cli.main import cli
from duebox.db import parse_database_url
from tests.badinput.common import scratch_database

APP = ["--app", "tests.apps.cli_app:app"]


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["jobs", "list"],
                                  ["dlq", "list"], ["db", "current"]])
def test_a_read_only_command_creates_no_database(tmp_path: Path, args: list[str]) -> None:
    """As a new user runs it: no configuration, a fresh directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUEBOX_")}
    done = subprocess.run([sys.executable, "-m", "duebox", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert not (tmp_path / "duebox.db").exists()
    if args == ["db", "current"]:
        assert done.returncode == 0, done.stderr
        assert "current None" in done.stdout
        assert "no database file at duebox.db" in done.stdout
        return
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "no database at duebox.db (the file does not exist): run `duebox db upgrade`" \
        in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.postgres
@pytest.mark.parametrize("args", [["status"], ["relay", *APP], ["worker", *APP],
                                  ["jobs", "show", "reminder:order-1"]])
def test_an_empty_postgresql_database_says_run_db_upgrade(args: list[str]) -> None:
    with scratch_database("duebox_notables") as url:
        result = CliRunner().invoke(cli, [*args, "--database-url", url])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "no duebox tables in this database" in lines[0]
    assert "run `duebox db upgrade`" in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.postgres
def test_a_postgres_url_is_postgresql_with_the_installed_driver() -> None:
    assert parse_database_url("postgres://u:p@db.example:5432/shop").drivername == \
        "postgresql+psycopg"
    assert parse_database_url("postgres+psycopg://db.example/shop").drivername == \
        "postgresql+psycopg"
    with scratch_database("duebox_pgscheme") as url:
        heroku = sa.make_url(url).set(drivername="postgres").render_as_string(
            hide_password=False)
        runner = CliRunner()
        up = runner.invoke(cli, ["db", "upgrade", "--database-url", heroku])
        assert up.exit_code == 0, up.output
        status = runner.invoke(cli, ["status", "--json", "--database-url", heroku])
        probe = runner.invoke(cli, ["status", "--degraded-ok", "--database-url", heroku])
    assert probe.exit_code == 0, probe.output
    assert "DEGRADED" in probe.output
    # Read through psycopg: no work, so no relay or worker is only a warning.
    assert status.exit_code == 3, status.output
    report = json.loads(status.output)
    assert report["verdict"] == "degraded"
    assert report["warnings"][0].startswith("no live relay")
