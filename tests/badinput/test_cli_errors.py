"""Every ``duebox`` command meets a database it cannot use the same way: one
line naming the cause and what to do, exit status 1, never a traceback.

Three databases it cannot use: a role without grants (PostgreSQL), a
database without duebox's tables (SQLite and PostgreSQL), and nothing at all
listening (a URL to a closed port, so no shared server is stopped).  The
relay and the worker are not here: they outlive database outages by design,
retrying until the database is back (docs/failures.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from duebox import migrate
from duebox.cli.main import cli
from tests.apps import cli_app

from .common import scratch_database

APP = ["--app", "tests.apps.cli_app:app"]
JOB = str(uuid.UUID(int=1))
WHO = ["--operator", "alice", "--reason", "checking"]
CLOSED = "postgresql+psycopg://127.0.0.1:1/nowhere?connect_timeout=3"

COMMANDS: dict[str, list[str]] = {
    "db current": ["db", "current"],
    "jobs list": ["jobs", "list"],
    "jobs show": ["jobs", "show", JOB],
    "jobs cancel": ["jobs", "cancel", JOB, *WHO],
    "status": ["status"],
    "status --json": ["status", "--json"],
    "dlq list": ["dlq", "list"],
    "dlq show": ["dlq", "show", JOB],
    "dlq replay": ["dlq", "replay", "--all", *WHO],
    "dlq purge": ["dlq", "purge", "--all", "--yes", *WHO],
    "schedules list": ["schedules", "list"],
    "schedules show": ["schedules", "show", "nightly"],
    "schedules next": ["schedules", "next", "nightly"],
    "schedules add": ["schedules", "add", "nightly", "cli.noop", "* * * * *"],
    "schedules pause": ["schedules", "pause", "nightly", *WHO],
    "schedules resume": ["schedules", "resume", "nightly", *WHO],
    "schedules delete": ["schedules", "delete", "nightly", *WHO],
    "dashboard": ["dashboard", "--port", "0"],
}
# Commands that answer correctly without duebox's tables: `db current` says
# there is no revision; `db upgrade` (not listed) creates them.
ANSWER_WITHOUT_TABLES = {"db current"}


def invoke(url: str, args: list[str]) -> Result:
    cli_app.app.configure(database_url=url)
    try:
        return CliRunner().invoke(cli, [args[0], *args[1:2], *APP, *args[2:]]
                                  if args[0] in ("db", "jobs", "dlq", "schedules")
                                  else [args[0], *APP, *args[1:]],
                                  env={"DUEBOX_DATABASE_URL": url, "DUEBOX_OPERATOR": ""})
    finally:
        cli_app.app.dispose()


def one_line_naming(result: Result, *needles: str) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception  # not a crash
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unreachable_database_is_one_line_saying_so(command: str) -> None:
    line = one_line_naming(invoke(CLOSED, COMMANDS[command]), "DatabaseError",
                           "database unavailable", "Connection refused")
    assert "check that the server is running" in line


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database that exists but has no duebox tables."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/empty.db"
        return
    with scratch_database("duebox_empty") as url:
        yield url


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - ANSWER_WITHOUT_TABLES))
def test_a_database_without_the_tables_is_one_line_saying_upgrade(
    empty_database: str, command: str
) -> None:
    one_line_naming(invoke(empty_database, COMMANDS[command]), "duebox db upgrade")


@pytest.fixture(scope="module")
def ungranted() -> Iterator[str]:
    """A migrated PostgreSQL database and the URL of a role that may log in
    and nothing else."""
    role = f"duebox_nobody_{uuid.uuid4().hex[:8]}"
    with scratch_database("duebox_nogrant", [role]) as url:
        owner = sa.create_engine(url)
        migrate.upgrade(owner)
        owner.dispose()
        yield sa.make_url(url).set(username=role).render_as_string(hide_password=False)


@pytest.mark.postgres
@pytest.mark.parametrize("command", sorted({*COMMANDS, "db upgrade"}))
def test_a_role_without_grants_is_one_line_naming_the_privilege(
    ungranted: str, command: str
) -> None:
    args = COMMANDS.get(command, ["db", "upgrade"])
    one_line_naming(invoke(ungranted, args), "PermissionDeniedError", "permission denied",
                    "docs/operators.md")


@pytest.mark.parametrize("args", [
    ["jobs", "list", *APP, "--queue", "q\udcff"], ["dlq", "list", *APP, "--task", "t\x00"],
    ["dlq", "replay", *APP, "--all", "--task", "t\udcff", *WHO],
])
def test_command_line_text_a_database_cannot_take_names_the_option(
    tmp_path: Path, args: list[str]
) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates; the driver
    used to fail on them with a raw UnicodeEncodeError."""
    url = f"sqlite:///{tmp_path}/d.db"
    cli_app.app.configure(database_url=url)
    try:
        migrate.upgrade(cli_app.app.engine)
        result = CliRunner().invoke(cli, args, env={"DUEBOX_DATABASE_URL": url})
    finally:
        cli_app.app.dispose()
    assert result.exit_code == 2, (result.output, result.exception)
    assert "--queue" in result.output or "--task" in result.output
    assert "lone surrogate" in result.output or "NUL" in result.output
