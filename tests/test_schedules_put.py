"""Schedules as code, part 1 (issue #22 item 7): the upsert
``app.schedules.put`` / ``duebox schedules add --update``, the ``cron``
error naming its field, and migration 0007 (the schedule's origin)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from helpers import column_names, schema_diffs
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from test_schedules import T0, clock_of, get, make_app

import duebox
from duebox import ValidationError
from duebox.cli.main import cli
from duebox.schedules.cron import parse_cron
from duebox.schedules.put import PutResult
from duebox.tables import audit, schedule


@pytest.fixture
def app(database_url: str) -> Iterator[duebox.Duebox]:
    a = make_app(database_url)
    yield a
    a.dispose()


def put(app: duebox.Duebox, name: str, cron: str, **kw: Any) -> PutResult:
    task = kw.pop("task", "tick")
    with Session(app.engine) as s, s.begin():
        done = app.schedules.put(s, name, task, cron, **kw)
    assert isinstance(done, PutResult)
    return done


def audit_rows(app: duebox.Duebox) -> list[Any]:
    with app.engine.connect() as conn:
        return list(conn.execute(sa.select(audit).order_by(audit.c.at)).all())


def test_put_creates_then_changes_nothing_when_nothing_changed(app: duebox.Duebox) -> None:
    first = put(app, "daily", "0 9 * * *", timezone="Europe/Berlin", payload={"a": [1, 2]})
    assert (first.outcome, first.version) == ("created", 1)
    before = get(app, "daily")
    assert before.origin == "api"
    clock_of(app).advance(3600)
    again = put(app, "daily", "0  9 * * *", timezone="Europe/Berlin", payload={"a": [1, 2]},
                operator="deploy", reason="release 42")
    assert (again.id, again.outcome, again.changed, again.version) == (
        first.id, "unchanged", (), 1)
    after = get(app, "daily")
    assert after.updated_at == before.updated_at  # no write at all
    assert audit_rows(app) == []


def test_put_changed_bumps_the_version_and_audits(app: duebox.Duebox) -> None:
    put(app, "daily", "0 9 * * *", timezone="Europe/Berlin", payload={"a": 1})
    cursor = get(app, "daily").next_fire_at
    # The payload alone: the version goes up, the fire-time cursor stays.
    done = put(app, "daily", "0 9 * * *", timezone="Europe/Berlin", payload={"a": 2},
               operator="alice", reason="new payload")
    assert (done.outcome, done.changed, done.version) == ("updated", ("payload",), 2)
    info = get(app, "daily")
    assert (info.payload, info.version, info.next_fire_at) == ({"a": 2}, 2, cursor)
    # The rule: the cursor moves to the next fire of the new rule after now.
    done = put(app, "daily", "30 6 * * *", timezone="UTC", payload={"a": 2}, jitter=5,
               operator="alice", reason="earlier")
    assert done.changed == ("cron", "timezone", "jitter_seconds")
    info = get(app, "daily")
    assert info.version == 3
    assert info.next_fire_at == T0 + timedelta(hours=6, minutes=30)
    rows = audit_rows(app)
    assert [(r.action, r.operator, r.reason) for r in rows] == [
        ("schedule_update", "alice", "new payload"), ("schedule_update", "alice", "earlier")]
    assert rows[1].details["changed"]["cron"] == ["0 9 * * *", "30 6 * * *"]
    assert rows[1].details["schedule"] == "daily"


def test_put_leaves_a_pause_alone_and_checks_everything_first(app: duebox.Duebox) -> None:
    put(app, "daily", "0 9 * * *")
    with Session(app.engine) as s, s.begin():
        app.schedules.pause(s, "daily")
    done = put(app, "daily", "0 10 * * *")  # paused=False is the default: not a resume
    assert done.outcome == "updated"
    assert get(app, "daily").paused
    with pytest.raises(ValidationError, match="cron: hour field '25' is out of range 0-23"):
        put(app, "daily", "0 25 * * *")
    with pytest.raises(ValidationError, match="misfire"):
        put(app, "daily", "0 9 * * *", misfire="sometimes")
    with pytest.raises(ValidationError, match="reason"):
        put(app, "daily", "0 9 * * *", operator="alice")
    with pytest.raises(TypeError, match="timezon"):
        put(app, "daily", "0 9 * * *", timezon="UTC")
    assert get(app, "daily").cron == "0 10 * * *"


def test_add_of_an_existing_name_points_at_put(app: duebox.Duebox) -> None:
    put(app, "daily", "0 9 * * *")
    with pytest.raises(ValidationError, match="schedules add --update"), \
            Session(app.engine) as s, s.begin():
        app.schedules.add(s, "daily", "tick", "0 9 * * *")


@pytest.mark.asyncio
async def test_put_on_an_async_session(database_url: str) -> None:
    app = make_app(database_url)
    try:
        async with AsyncSession(app.async_engine) as s, s.begin():
            first = await app.schedules.put(s, "nightly", "report", "30 2 * * *")
        async with AsyncSession(app.async_engine) as s, s.begin():
            again = await app.schedules.put(s, "nightly", "report", "30 3 * * *")
        assert (first.outcome, again.outcome, again.version) == ("created", "updated", 2)
    finally:
        await app.adispose()


@pytest.mark.parametrize(("expr", "message"), [
    ("61 * * * *", "minute field '61' is out of range 0-59"),
    ("* 24 * * *", "hour field '24' is out of range 0-23"),
    ("* * 0 * *", "day-of-month field '0' is out of range 1-31"),
    ("* * * 13 *", "month field '13' is out of range 1-12"),
    ("* * * * 8", "day-of-week field '8' is out of range 0-7"),
    ("* * * * fri-xyz", "day-of-week field 'xyz' is not a number from 0 to 7 or a name"),
    ("*/0 * * * *", "minute field step '0' must be a whole number >= 1"),
    ("75 0 * * * *", "second field '75' is out of range 0-59"),
    ("1,,2 * * * *", "minute field '' is empty"),
])
def test_the_cron_error_names_the_field(expr: str, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        parse_cron(expr)
    assert str(caught.value).startswith(f"cron: {message}")
    assert caught.value.field == "cron"


# --- the CLI ----------------------------------------------------------------------------


def test_cli_add_update(runner: CliRunner, database_url: str,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUEBOX_APP", "tests.apps.cli_app:app")
    def add(*args: str) -> str:
        result = runner.invoke(cli, ["schedules", "add", "nightly", "cli.noop", *args])
        assert result.exit_code == 0, result.output
        return result.output

    assert " added: '30 2 * * *'" in add("30 2 * * *", "--update")
    assert "unchanged: '30 2 * * *' in UTC, version 1" in add("30 2 * * *", "--update")
    out = add("30 3 * * *", "--tz", "Europe/Berlin", "--update", "--operator", "ci",
              "--reason", "deploy")
    assert "updated to version 2 (cron, timezone)" in out
    refused = runner.invoke(cli, ["schedules", "add", "nightly", "cli.noop", "30 3 * * *"])
    assert refused.exit_code == 1
    assert "--update" in refused.output
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            (row,) = conn.execute(sa.select(audit)).all()
            version = conn.execute(sa.select(schedule.c.version)).scalar_one()
    finally:
        engine.dispose()
    assert (row.action, row.operator, row.reason, version) == (
        "schedule_update", "ci", "deploy", 2)
    shown = runner.invoke(cli, ["schedules", "show", "nightly"]).output
    assert "made by hand" in shown
    listed = runner.invoke(cli, ["schedules", "list"]).output.splitlines()
    assert listed[0].split()[-2:] == ["origin", "id"]
    assert listed[1].split()[-2] == "api"


# --- migration 0007 -------------------------------------------------------------------


def test_migration_0007_adds_and_removes_the_origin(database_url_all: str) -> None:
    """On SQLite, PostgreSQL and MariaDB: head matches duebox.tables; down to
    0006 drops both columns (schedules keep their rows), up again restores
    them and marks the existing schedules as made by hand."""
    from alembic import command

    from duebox import migrate

    def columns(engine: sa.Engine) -> set[str]:
        return column_names(engine, "duebox_schedule")

    def diffs(engine: sa.Engine) -> list[Any]:
        return schema_diffs(engine, "duebox_schedule")

    app = make_app(database_url_all)
    engine = app.engine
    try:
        assert {"origin", "retired_at"} <= columns(engine)
        assert diffs(engine) == []
        put(app, "kept", "0 9 * * *")
        cfg = migrate.alembic_config()
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0006")
        engine.dispose()
        assert not {"origin", "retired_at"} & columns(engine)
        migrate.upgrade(engine)
        assert {"origin", "retired_at"} <= columns(engine)
        assert diffs(engine) == []
        info = get(app, "kept")
        assert (info.origin, info.retired_at) == ("api", None)
        assert isinstance(info.id, uuid.UUID)
    finally:
        app.dispose()
