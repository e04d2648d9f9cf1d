"""Operator actions are authorised and audited.  ``duebox dlq replay``,
``duebox dlq purge`` and ``duebox jobs cancel`` refuse to run without an
operator identity and a reason, record both in the audit table, and — who
may run them at all is the database's business — a role without the
privilege gets a PermissionDeniedError and changes nothing
(docs/operators.md)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from conftest import PG_ADMIN_URL, reset_tables, service_missing
from helpers import Running, all_final, make_app, schedule_committed

import duebox
from duebox import PermissionDeniedError, ValidationError, dlq
from duebox.cli.main import cli
from duebox.tables import audit, job
from tests.apps import cli_app

from .common import SQLITE_ONLY, snapshot

APP = ["--app", "tests.apps.cli_app:app"]


def dead_job(app: duebox.Duebox, task: str = "cli.noop") -> uuid.UUID:
    """A job as the worker leaves one that failed for good."""
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, task, {"n": 1})
        conn.execute(sa.update(job).where(job.c.id == job_id).values(
            state="DEAD", attempt=1, error_class="permanent", last_error="Boom: failed",
            finished_at=app.clock.now()))
    assert isinstance(job_id, uuid.UUID)
    return job_id


def audit_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(audit).order_by(audit.c.at)))


COMMANDS = {
    "replay": ["dlq", "replay", *APP],
    "purge": ["dlq", "purge", "--yes", *APP],
    "cancel": ["jobs", "cancel", *APP],
}


@SQLITE_ONLY
@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("extra", "named"), [
    ([], "--operator"),
    (["--operator", "alice"], "--reason"),
    (["--reason", "why"], "--operator"),
    (["--operator", "   ", "--reason", "why"], "operator"),
    (["--operator", "alice", "--reason", " "], "reason"),
])
def test_an_operator_action_without_who_and_why_is_refused_and_changes_nothing(
    runner: CliRunner, command: str, extra: list[str], named: str
) -> None:
    app = cli_app.app
    job_id = dead_job(app) if command != "cancel" else _scheduled(app)
    before = snapshot(app.engine)
    result = runner.invoke(cli, [*COMMANDS[command], str(job_id), *extra])
    assert result.exit_code != 0, result.output
    assert named in result.output
    assert snapshot(app.engine) == before


def _scheduled(app: duebox.Duebox) -> uuid.UUID:
    with app.engine.begin() as conn:
        job_id = app.schedule(conn, "cli.noop", delay=3600)
    assert isinstance(job_id, uuid.UUID)
    return job_id


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_operator_action_records_who_what_why_and_which_job(
    runner: CliRunner, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = cli_app.app
    job_id = dead_job(app) if command != "cancel" else _scheduled(app)
    monkeypatch.setenv("DUEBOX_OPERATOR", "alice@ops")  # the identity may come from the env
    result = runner.invoke(cli, [*COMMANDS[command], str(job_id), "--reason", "ticket 42"])
    assert result.exit_code == 0, result.output
    [row] = audit_rows(app.engine)
    assert (row.operator, row.action, row.job_id, row.reason) == (
        "alice@ops", command, job_id, "ticket 42")


@SQLITE_ONLY
def test_replay_and_purge_through_the_api_refuse_without_an_operator(
    database_url: str,
) -> None:
    app = make_app(database_url)
    try:
        job_id = dead_job(app, "effect")
        before = snapshot(app.engine)
        for action in (dlq.replay, dlq.purge):
            for operator, reason, field in [(None, "why", "operator"), ("", "why", "operator"),
                                            ("bob", None, "reason")]:
                with pytest.raises(ValidationError) as info:
                    action(app, operator=operator, reason=reason,  # type: ignore[arg-type]
                           ids=[job_id])
                assert info.value.field == field
        for rate in (0, -1, float("nan"), float("inf"), True):
            with pytest.raises(ValidationError, match="rate"):
                dlq.replay(app, operator="bob", reason="why", ids=[job_id], rate=rate)
        assert snapshot(app.engine) == before
    finally:
        app.dispose()


# --- database roles ------------------------------------------------------------------------


@dataclass
class Roles:
    """One database of this test's own and roles that may log into it."""

    admin_url: str
    names: dict[str, str]

    def url(self, role: str) -> str:
        parts = sa.make_url(self.admin_url)
        return parts.set(username=self.names[role]).render_as_string(hide_password=False)


# What docs/operators.md grants, statement for statement.
GRANTS = {
    "operator": [
        "GRANT SELECT, UPDATE, DELETE ON duebox_job TO {role}",
        "GRANT SELECT, DELETE ON duebox_attempt TO {role}",
        "GRANT SELECT, INSERT ON duebox_audit TO {role}",
    ],
    "dashboard": ["GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}"],
    "runtime": [
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}",
        "REVOKE UPDATE, DELETE ON duebox_audit FROM {role}",
    ],
}


@pytest.fixture
def roles() -> Iterator[Roles]:
    token = uuid.uuid4().hex[:8]
    db = f"duebox_roles_{token}"
    names = {kind: f"duebox_{kind}_{token}" for kind in GRANTS}
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{db}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        service_missing("PostgreSQL", exc)
    url = sa.make_url(PG_ADMIN_URL).set(database=db).render_as_string(hide_password=False)
    try:
        with admin.connect() as conn:
            for name in names.values():
                conn.execute(sa.text(f'CREATE ROLE "{name}" LOGIN'))
        reset_tables(url)
        owner = sa.create_engine(url)
        with owner.begin() as conn:
            for kind, statements in GRANTS.items():
                conn.execute(sa.text(f'GRANT USAGE ON SCHEMA public TO "{names[kind]}"'))
                for statement in statements:
                    conn.execute(sa.text(statement.format(role=f'"{names[kind]}"')))
        owner.dispose()
        yield Roles(url, names)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
            for name in names.values():
                conn.execute(sa.text(f'DROP ROLE IF EXISTS "{name}"'))
        admin.dispose()


def as_role(roles: Roles, role: str) -> duebox.Duebox:
    """An app connected as ``role`` (``owner``: the database's owner)."""
    app = duebox.Duebox(roles.admin_url if role == "owner" else roles.url(role))
    app.add_task("cli.noop", lambda p, c: None)
    return app


@pytest.mark.postgres
def test_a_role_without_the_privilege_cannot_replay_purge_or_cancel(roles: Roles) -> None:
    owner, viewer = as_role(roles, "owner"), as_role(roles, "dashboard")
    try:
        dead = dead_job(owner)
        live = _scheduled(owner)
        before = snapshot(owner.engine)
        with pytest.raises(PermissionDeniedError) as info:
            dlq.replay(viewer, operator="mallory", reason="let me", ids=[dead])
        assert "permission denied" in str(info.value)
        assert "duebox_job" in str(info.value)  # the driver's words name the table
        with pytest.raises(PermissionDeniedError):
            dlq.purge(viewer, operator="mallory", reason="let me", ids=[dead])
        assert snapshot(owner.engine) == before
        # The command line says the same, in one line, with exit status 1.
        result = cli_as(viewer, ["dlq", "replay", str(dead), "--operator", "mallory",
                                 "--reason", "let me"])
        assert result.exit_code == 1, result.output
        assert "PermissionDeniedError" in result.output
        assert "docs/operators.md" in result.output
        result = cli_as(viewer, ["jobs", "cancel", str(live), "--operator", "mallory",
                                 "--reason", "let me"])
        assert result.exit_code == 1, result.output
        assert "PermissionDeniedError" in result.output
        assert snapshot(owner.engine) == before
    finally:
        viewer.dispose()
        owner.dispose()


@pytest.mark.postgres
def test_the_operator_role_can_act_but_cannot_rewrite_the_audit_trail(roles: Roles) -> None:
    owner, operator = as_role(roles, "owner"), as_role(roles, "operator")
    try:
        replayed, purged = dead_job(owner), dead_job(owner)
        live = _scheduled(owner)
        assert dlq.replay(operator, operator="alice", reason="fixed", ids=[replayed]).replayed
        assert dlq.purge(operator, operator="alice", reason="junk", ids=[purged]) == 1
        with operator.engine.begin() as conn:
            assert operator.cancel(conn, live, operator="alice", reason="asked")
        assert [(r.action, r.job_id) for r in audit_rows(owner.engine)] == [
            ("replay", replayed), ("purge", purged), ("cancel", live)]
        for statement in ("DELETE FROM duebox_audit", "UPDATE duebox_audit SET reason = 'x'"):
            with pytest.raises(sa.exc.ProgrammingError, match="permission denied"), \
                    operator.engine.begin() as conn:
                conn.execute(sa.text(statement))
        assert len(audit_rows(owner.engine)) == 3
    finally:
        operator.dispose()
        owner.dispose()


def cli_as(app: duebox.Duebox, args: list[str]) -> Result:
    cli_app.app.configure(database_url=app.settings.database_url)
    try:
        return CliRunner().invoke(cli, [*args[:2], *APP, *args[2:]])
    finally:
        cli_app.app.dispose()


@pytest.mark.postgres
async def test_relays_and_workers_run_as_the_runtime_role(roles: Roles) -> None:
    app = make_app(roles.admin_url)  # the owner creates the tests' effects table
    owner = sa.create_engine(roles.admin_url)
    try:
        runtime = roles.names["runtime"]
        with owner.begin() as conn:
            conn.execute(sa.text(f'GRANT ALL ON effects TO "{runtime}"'))
        app.configure(database_url=roles.url("runtime"))
        with app.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT current_user")).scalar() == runtime
        job_id = schedule_committed(app, "effect")
        async with Running(app) as r:
            await r.wait(lambda: all_final(app.engine, [job_id]), timeout=60,
                         what="the job to run as the runtime role")
    finally:
        owner.dispose()
        await app.adispose()
