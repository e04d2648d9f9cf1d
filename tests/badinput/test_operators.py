"""Operator actions are authorised and audited, everywhere the same.
``duebox jobs cancel``, ``duebox dlq replay|purge`` and ``duebox schedules
pause|resume|delete`` refuse to run without an operator identity and a
reason, refuse control characters in either (a newline or ESC would forge
a line of ``duebox jobs show``), record both in the audit table, and — who
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
from conftest import reset_tables
from helpers import Running, all_final, make_app, schedule_committed
from sqlalchemy.orm import Session

import duebox
from duebox import PermissionDeniedError, ValidationError, dlq
from duebox.cli.main import cli
from duebox.tables import audit, job
from tests.apps import cli_app

from .common import SQLITE_ONLY, scratch_database, snapshot

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
    "schedule_pause": ["schedules", "pause", *APP],
    "schedule_resume": ["schedules", "resume", *APP],
    "schedule_delete": ["schedules", "delete", *APP],
}


def target(app: duebox.Duebox, command: str) -> str:
    """What ``command`` acts on, made ready for it: a dead job, a scheduled
    one, or a schedule (paused for resume)."""
    if command in ("replay", "purge"):
        return str(dead_job(app))
    if command == "cancel":
        return str(_scheduled(app))
    with Session(app.engine) as s, s.begin():
        app.schedules.add(s, "nightly", "cli.noop", "30 2 * * *",
                          paused=command == "schedule_resume")
    return "nightly"


def schedule_audit(row: Any) -> tuple[str, str | None]:
    return row.action, (row.details or {}).get("schedule")


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
    ref = target(app, command)
    before = snapshot(app.engine)
    result = runner.invoke(cli, [*COMMANDS[command], ref, *extra])
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
    ref = target(app, command)
    monkeypatch.setenv("DUEBOX_OPERATOR", "alice@ops")  # the identity may come from the env
    result = runner.invoke(cli, [*COMMANDS[command], ref, "--reason", "ticket 42"])
    assert result.exit_code == 0, result.output
    [row] = audit_rows(app.engine)
    assert (row.operator, row.action, row.reason) == ("alice@ops", command, "ticket 42")
    if command.startswith("schedule_"):
        assert row.job_id is None
        assert row.details["schedule"] == "nightly"
    else:
        assert str(row.job_id) == ref


# Newlines, carriage returns, ESC (terminal control), NUL, bidi overrides and
# line separators: each could forge or hide a line where the audit trail is
# printed.  Ordinary non-ASCII text stays allowed.
FORGING = ["ok\n  2030-01-01T00:00:00.000+00:00 replay by admin: approved", "a\rb",
           "\x1b[2Jcleared", "nul\x00", "\u202eevil", "a\u2028b", "tab\there"]


@SQLITE_ONLY
@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("option", ["--operator", "--reason"])
@pytest.mark.parametrize("value", FORGING, ids=range(len(FORGING)))
def test_control_characters_in_who_or_why_are_refused_and_change_nothing(
    runner: CliRunner, command: str, option: str, value: str
) -> None:
    app = cli_app.app
    ref = target(app, command)
    before = snapshot(app.engine)
    args = {"--operator": "alice", "--reason": "why", option: value}
    result = runner.invoke(cli, [*COMMANDS[command], ref, *(x for kv in args.items() for x in kv)])
    assert result.exit_code in (1, 2), result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert option.lstrip("-") in result.output
    assert snapshot(app.engine) == before


def test_names_in_other_scripts_are_fine_as_operator_and_reason(runner: CliRunner) -> None:
    app = cli_app.app
    ref = target(app, "cancel")
    result = runner.invoke(cli, [*COMMANDS["cancel"], ref, "--operator", "Zoë Åström",
                                 "--reason", "клиент попросил — チケット 42"])
    assert result.exit_code == 0, result.output
    assert audit_rows(app.engine)[0].operator == "Zoë Åström"


@SQLITE_ONLY
def test_jobs_show_prints_one_line_per_audit_row_whatever_was_stored(
    runner: CliRunner,
) -> None:
    """An audit row written before the check existed (or by hand) cannot
    forge another: its control characters are printed as escapes."""
    app = cli_app.app
    job_id = _scheduled(app)
    forged = "2030-01-01T00:00:00.000+00:00 replay by admin: approved"
    with app.engine.begin() as conn:
        conn.execute(audit.insert().values(
            id=uuid.uuid4(), at=app.clock.now(), operator="mallory\x1b[1A", action="cancel",
            job_id=job_id, reason=f"ok\n  {forged}", details=None))
        conn.execute(sa.update(job).where(job.c.id == job_id).values(
            last_error="Boom\n  2030-01-01T00:00:00.000+00:00 purge by root: fine"))
    result = runner.invoke(cli, ["jobs", "show", str(job_id), *APP])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert not any(line.strip().startswith("2030-01-01") for line in lines), result.output
    assert "\x1b" not in result.output
    assert any("by mallory\\x1b[1A: ok\\n  " + forged in line for line in lines), result.output


@SQLITE_ONLY
@pytest.mark.parametrize("command", ["replay", "purge"])
def test_an_unknown_error_class_is_refused_naming_the_valid_ones(
    runner: CliRunner, command: str
) -> None:
    """``--error-class bogus`` matched nothing and reported "replayed 0",
    exit status 0: a typo looked like success."""
    app = cli_app.app
    dead_job(app)
    before = snapshot(app.engine)
    result = runner.invoke(cli, [*COMMANDS[command], "--error-class", "bogus",
                                 "--operator", "alice", "--reason", "why"])
    assert result.exit_code == 2, result.output
    for name in dlq.ERROR_CLASSES:
        assert name in result.output
    assert snapshot(app.engine) == before
    action = dlq.replay if command == "replay" else dlq.purge
    with pytest.raises(ValidationError) as info:
        action(app, operator="alice", reason="why", error_class="bogus")
    assert info.value.field == "error_class"
    assert snapshot(app.engine) == before


@SQLITE_ONLY
def test_schedule_actions_through_the_api_audit_when_given_an_operator(
    database_url: str,
) -> None:
    app = make_app(database_url)
    try:
        with Session(app.engine) as s, s.begin():
            app.schedules.add(s, "nightly", "effect", "30 2 * * *")
        before = snapshot(app.engine)
        for kwargs, field in [({"operator": "alice"}, "reason"), ({"reason": "why"}, "operator"),
                              ({"operator": "al\nice", "reason": "why"}, "operator")]:
            for action in (app.schedules.pause, app.schedules.resume, app.schedules.delete):
                with Session(app.engine) as s, s.begin(), pytest.raises(ValidationError) as info:
                    action(s, "nightly", **kwargs)
                assert info.value.field == field
        assert snapshot(app.engine) == before
        with Session(app.engine) as s, s.begin():
            assert app.schedules.pause(s, "nightly", operator="alice", reason="freeze")
            assert not app.schedules.pause(s, "nightly", operator="alice", reason="again")
            app.schedules.resume(s, "nightly", operator="bob", reason="thaw")
            app.schedules.pause(s, "nightly")  # the application's own call: no audit row
        assert [(r.operator, *schedule_audit(r), r.reason) for r in audit_rows(app.engine)] == [
            ("alice", "schedule_pause", "nightly", "freeze"),
            ("bob", "schedule_resume", "nightly", "thaw")]
    finally:
        app.dispose()


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
        for rate in (0, -1, float("nan"), float("inf"), True, 1e-300, 10**400):
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
        "GRANT SELECT, UPDATE, DELETE ON duebox_schedule TO {role}",
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
    names = {kind: f"duebox_{kind}_{token}" for kind in GRANTS}
    with scratch_database("duebox_roles", list(names.values())) as url:
        reset_tables(url)
        owner = sa.create_engine(url)
        with owner.begin() as conn:
            for kind, statements in GRANTS.items():
                conn.execute(sa.text(f'GRANT USAGE ON SCHEMA public TO "{names[kind]}"'))
                for statement in statements:
                    conn.execute(sa.text(statement.format(role=f'"{names[kind]}"')))
        owner.dispose()
        yield Roles(url, names)


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


@pytest.mark.postgres
def test_the_operator_role_can_pause_resume_and_delete_schedules(roles: Roles) -> None:
    """With the grants docs/operators.md gives, the schedule commands work as
    the operator role and leave their audit rows; the read-only role gets one
    line naming the missing privilege and changes nothing."""
    owner, operator, viewer = (as_role(roles, r) for r in ("owner", "operator", "dashboard"))
    try:
        with Session(owner.engine) as s, s.begin():
            sid = owner.schedules.add(s, "nightly", "cli.noop", "30 2 * * *")
        pending = _scheduled(owner)
        with owner.engine.begin() as conn:
            conn.execute(sa.update(job).where(job.c.id == pending).values(schedule_id=sid))
        before = snapshot(owner.engine)
        for command in ("pause", "delete"):
            result = cli_as(viewer, ["schedules", command, "nightly", "--operator", "mallory",
                                     "--reason", "let me"])
            assert result.exit_code == 1, result.output
            assert "PermissionDeniedError" in result.output
            assert len(result.output.strip().splitlines()) == 1, result.output
        assert snapshot(owner.engine) == before
        for command in (["pause"], ["resume"], ["delete", "--cancel-pending"]):
            result = cli_as(operator, ["schedules", command[0], "nightly", *command[1:],
                                       "--operator", "alice", "--reason", "retire it"])
            assert result.exit_code == 0, result.output
        assert "1 pending occurrence(s) cancelled" in result.output
        rows = [(r.action, r.job_id) for r in audit_rows(owner.engine)]
        assert rows[:2] == [("schedule_pause", None), ("schedule_resume", None)]
        # One transaction, one instant: the delete and the cancel it made.
        assert set(rows[2:]) == {("cancel", pending), ("schedule_delete", None)}
    finally:
        for a in (viewer, operator, owner):
            a.dispose()
