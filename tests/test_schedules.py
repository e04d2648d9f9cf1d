"""Recurring schedules on SQLite and PostgreSQL: the API (``app.schedules``),
occurrence generation (``duebox.schedules.occurrences``) and the CLI
(``duebox schedules``), with an injected clock."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import duebox
from duebox import FakeClock, JobState, Settings, ValidationError
from duebox.cli.main import cli
from duebox.schedules import occurrences
from duebox.schedules.api import DeleteResult, ScheduleInfo, ScheduleNotFoundError
from duebox.tables import audit, job, schedule

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def make_app(url: str, clock: FakeClock | None = None, **settings: Any) -> duebox.Duebox:
    values: dict[str, Any] = {"poll_interval": 1.0, "batch_size": 100, "misfire_grace": 30.0}
    values.update(settings)
    app = duebox.Duebox(url, "sql://", clock=clock or FakeClock(T0),
                        settings=Settings(**values))

    @app.task("report", queue="reports", max_attempts=5)
    def report(payload: Any, ctx: duebox.JobContext) -> None:
        return None

    @app.task("tick")
    def tick(payload: Any, ctx: duebox.JobContext) -> None:
        return None

    return app


@pytest.fixture
def app(database_url: str) -> Iterator[duebox.Duebox]:
    a = make_app(database_url)
    yield a
    a.dispose()


def clock_of(app: duebox.Duebox) -> FakeClock:
    assert isinstance(app.clock, FakeClock)
    return app.clock


def add(app: duebox.Duebox, name: str, cron: str, **kw: Any) -> uuid.UUID:
    task = kw.pop("task", "tick")
    with Session(app.engine) as s, s.begin():
        sid = app.schedules.add(s, name, task, cron, **kw)
    assert isinstance(sid, uuid.UUID)
    return sid


def get(app: duebox.Duebox, ref: uuid.UUID | str) -> ScheduleInfo:
    with Session(app.engine) as s:
        info = app.schedules.get(s, ref)
    assert isinstance(info, ScheduleInfo)
    return info


def generate(app: duebox.Duebox, *, limit: int = 100) -> occurrences.GenerateResult:
    s = app.settings
    with app.engine.begin() as conn:
        return occurrences.generate_due(conn, now=app.clock.now(), limit=limit,
                                        lookahead=s.poll_interval + 1.0, grace=s.misfire_grace)


def occurrence_rows(app: duebox.Duebox, sid: uuid.UUID) -> list[Any]:
    with app.engine.connect() as conn:
        return list(conn.execute(
            sa.select(job).where(job.c.schedule_id == sid).order_by(job.c.nominal_fire_at)))


def nominals(app: duebox.Duebox, sid: uuid.UUID) -> list[datetime]:
    return [r.nominal_fire_at for r in occurrence_rows(app, sid)]


def at(minutes: float = 0, seconds: float = 0) -> datetime:
    return T0 + timedelta(minutes=minutes, seconds=seconds)


def set_state(app: duebox.Duebox, sid: uuid.UUID, state: str) -> None:
    with app.engine.begin() as conn:
        conn.execute(sa.update(job).where(job.c.schedule_id == sid).values(state=state))


# --- the API --------------------------------------------------------------------------


def test_add_get_list_pause_resume_delete(app: duebox.Duebox) -> None:
    sid = add(app, "nightly", "30 2 * * *", task="report", timezone="Europe/Berlin",
              payload={"kind": "daily"}, jitter=30, misfire="skip", overlap="queue",
              gap="skip", fold="both", priority=7, expire_after=timedelta(hours=1))
    info = get(app, "nightly")
    assert info == get(app, sid)
    assert (info.task, info.queue, info.cron, info.timezone, info.payload) == (
        "report", "reports", "30 2 * * *", "Europe/Berlin", {"kind": "daily"})
    assert (info.misfire, info.overlap, info.gap, info.fold) == ("skip", "queue", "skip", "both")
    assert (info.jitter, info.priority, info.max_attempts, info.expire_after) == (30, 7, 5, 3600)
    assert info.next_fire_at == datetime(2030, 1, 1, 1, 30, tzinfo=UTC)  # 02:30 CET
    assert (info.version, info.paused, info.last_fire_at) == (1, False, None)

    add(app, "a-first", "@hourly")
    with Session(app.engine) as s:
        listed = app.schedules.list(s)
    assert [i.name for i in listed] == ["a-first", "nightly"]  # type: ignore[union-attr]

    with Session(app.engine) as s, s.begin():
        assert app.schedules.pause(s, "nightly") is True
        assert app.schedules.pause(s, "nightly") is False
    assert (get(app, sid).paused, get(app, sid).version) == (True, 2)
    with Session(app.engine) as s:
        running = app.schedules.list(s, include_paused=False)
    assert [i.name for i in running] == ["a-first"]  # type: ignore[union-attr]

    clock_of(app).advance(3 * 86400)  # paused through three fire times
    with Session(app.engine) as s, s.begin():
        resumed = app.schedules.resume(s, str(sid))
    # What fell in the pause is not fired: the next fire time after now.
    assert resumed == datetime(2030, 1, 4, 1, 30, tzinfo=UTC)
    assert (get(app, sid).paused, get(app, sid).version) == (False, 3)

    with Session(app.engine) as s, s.begin():
        assert app.schedules.delete(s, "nightly") == DeleteResult(cancelled=0, kept=0)
    with Session(app.engine) as s, pytest.raises(ScheduleNotFoundError) as err:
        app.schedules.get(s, "nightly")
    assert err.value.field == "schedule"


async def test_the_api_takes_an_async_session(app: duebox.Duebox) -> None:
    async with AsyncSession(app.async_engine) as s, s.begin():
        sid = await app.schedules.add(s, "async", "tick", "*/5 * * * *")  # type: ignore[misc]
    async with AsyncSession(app.async_engine) as s:
        info = await app.schedules.get(s, sid)  # type: ignore[misc]
    assert info.next_fire_at == at(5)
    await app.adispose()


def test_add_never_commits_for_the_caller(app: duebox.Duebox) -> None:
    with Session(app.engine) as s, s.begin():
        app.schedules.add(s, "rolled-back", "tick", "* * * * *")
        s.rollback()
    with Session(app.engine) as s, pytest.raises(ScheduleNotFoundError):
        app.schedules.get(s, "rolled-back")


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("name", {"name": ""}),
        ("name", {"name": "x" * 201}),
        ("task", {"task": "nope"}),
        ("cron", {"cron": "* * * *"}),
        ("cron", {"cron": "0 0 30 2 *"}),  # never fires
        ("timezone", {"timezone": "Europe/Atlantis"}),
        ("misfire", {"misfire": "fire_twice"}),
        ("overlap", {"overlap": "sometimes"}),
        ("gap", {"gap": "jump"}),
        ("fold", {"fold": "middle"}),
        ("jitter", {"jitter": -1}),
        ("jitter", {"jitter": 1.5}),
        ("jitter", {"jitter": 86_401}),
        ("expire_after", {"expire_after": 0}),
        ("payload", {"payload": {"x": float("nan")}}),
        ("priority", {"priority": True}),
        ("queue", {"queue": ""}),
        ("paused", {"paused": "yes"}),
    ],
)
def test_bad_input_names_the_field_and_changes_nothing(
    app: duebox.Duebox, field: str, changes: dict[str, Any]
) -> None:
    args: dict[str, Any] = {"name": "s", "task": "tick", "cron": "* * * * *"}
    args.update(changes)
    with Session(app.engine) as s, s.begin(), pytest.raises(ValidationError) as err:
        app.schedules.add(s, args.pop("name"), args.pop("task"), args.pop("cron"), **args)
    assert err.value.field == field
    with app.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(schedule)).scalar() == 0


def test_duplicate_name_is_refused(app: duebox.Duebox) -> None:
    add(app, "dup", "* * * * *")
    with Session(app.engine) as s, s.begin(), pytest.raises(ValidationError) as err:
        app.schedules.add(s, "dup", "tick", "0 * * * *")
    assert err.value.field == "name"
    assert get(app, "dup").cron == "* * * * *"


# --- occurrence generation ------------------------------------------------------------


def test_occurrences_carry_the_template_and_a_derived_id(app: duebox.Duebox) -> None:
    sid = add(app, "r", "*/10 * * * *", task="report", payload={"n": 1}, jitter=120,
              priority=3, expire_after=600, misfire="fire_all")
    clock_of(app).advance(30 * 60)  # 00:30: 00:10, 00:20 and 00:30 are due
    result = generate(app)
    assert (result.occurrences, result.advanced) == (3, 1)
    rows = occurrence_rows(app, sid)
    assert [r.nominal_fire_at for r in rows] == [at(10), at(20), at(30)]
    for r in rows:
        assert r.id == uuid.uuid5(occurrences.OCCURRENCE_NAMESPACE,
                                  f"{sid}/{r.nominal_fire_at.isoformat()}")
        assert r.nominal_fire_at <= r.due_at <= r.nominal_fire_at + timedelta(seconds=120)
        assert r.due_at == r.nominal_fire_at + occurrences.jitter_for(sid, r.nominal_fire_at,
                                                                      120)
        assert r.expires_at == r.due_at + timedelta(seconds=600)
        assert (r.task, r.queue, r.payload, r.priority, r.max_attempts, r.state) == (
            "report", "reports", {"n": 1}, 3, 5, JobState.SCHEDULED)
    assert len({r.due_at - r.nominal_fire_at for r in rows}) > 1  # jitter varies
    info = get(app, sid)
    assert (info.next_fire_at, info.last_fire_at, info.version) == (at(40), at(30), 1)


def test_generating_again_inserts_nothing_twice(app: duebox.Duebox) -> None:
    sid = add(app, "m", "* * * * *", misfire="fire_all")
    clock_of(app).advance(10 * 60)
    # A relay generated 00:01..00:10, then died before it could advance the
    # cursor (simulated by putting the cursor back): the same ids come out.
    assert generate(app).occurrences == 10
    with app.engine.begin() as conn:
        conn.execute(sa.update(schedule).values(next_fire_at=at(1)))
    again = generate(app)
    assert (again.occurrences, again.advanced) == (0, 1)
    assert nominals(app, sid) == [at(m) for m in range(1, 11)]
    assert get(app, sid).next_fire_at == at(11)


def test_a_failed_transaction_generates_nothing_and_loses_nothing(app: duebox.Duebox) -> None:
    sid = add(app, "m", "* * * * *", misfire="fire_all")
    clock_of(app).advance(5 * 60)
    s = app.settings
    with pytest.raises(RuntimeError), app.engine.begin() as conn:  # noqa: PT012
        occurrences.generate_due(conn, now=app.clock.now(), limit=10, lookahead=2,
                                 grace=s.misfire_grace)
        raise RuntimeError("relay killed before commit")
    assert nominals(app, sid) == []
    assert get(app, sid).next_fire_at == at(1)
    assert generate(app).occurrences == 5


def test_lookahead_creates_occurrences_just_before_they_are_due(app: duebox.Duebox) -> None:
    sid = add(app, "m", "* * * * *")
    clock_of(app).advance(58)  # 2 s (poll interval + 1 s) before 00:01
    assert generate(app).occurrences == 1
    row = occurrence_rows(app, sid)[0]
    assert (row.nominal_fire_at, row.due_at) == (at(1), at(1))  # not due before its time
    clock_of(app).advance(1)
    assert generate(app).occurrences == 0


def test_paused_schedules_generate_nothing(app: duebox.Duebox) -> None:
    sid = add(app, "m", "* * * * *", paused=True)
    clock_of(app).advance(600)
    assert generate(app).claimed == 0
    assert nominals(app, sid) == []


@pytest.mark.parametrize(
    ("misfire", "expected"),
    [
        ("fire_all", [at(m) for m in range(1, 61)]),
        ("fire_once", [at(59), at(60)]),  # 00:59 is the latest missed; 00:60 is on time
        ("skip", [at(60)]),
    ],
)
def test_misfire_policies_after_an_hour_down(app: duebox.Duebox, misfire: str,
                                             expected: list[datetime]) -> None:
    sid = add(app, "m", "* * * * *", misfire=misfire)
    clock_of(app).advance(3600 + 20)  # grace 30 s: 00:59:00 and earlier were missed
    while generate(app).more:
        pass
    assert nominals(app, sid) == expected
    assert get(app, sid).next_fire_at == at(61)


def test_overlap_skip_drops_fire_times_while_the_previous_is_active(
    app: duebox.Duebox
) -> None:
    sid = add(app, "m", "* * * * *", overlap="skip")
    clock = clock_of(app)
    clock.advance(60)
    generate(app)
    assert nominals(app, sid) == [at(1)]
    for _ in range(3):  # 00:02..00:04 while 00:01 is still RUNNING
        set_state(app, sid, JobState.RUNNING)
        clock.advance(60)
        generate(app)
    assert nominals(app, sid) == [at(1)]
    set_state(app, sid, JobState.SUCCEEDED)
    clock.advance(60)
    generate(app)
    assert nominals(app, sid) == [at(1), at(5)]


def test_overlap_queue_waits_then_applies_the_misfire_policy(app: duebox.Duebox) -> None:
    sid = add(app, "m", "* * * * *", overlap="queue", misfire="fire_once")
    clock = clock_of(app)
    clock.advance(60)
    generate(app)
    set_state(app, sid, JobState.RUNNING)
    clock.advance(5 * 60)  # 00:06: the run of 00:01 took five minutes
    assert generate(app).claimed == 0  # left out while the previous runs
    assert get(app, sid).next_fire_at == at(2)  # the cursor waited
    set_state(app, sid, JobState.SUCCEEDED)
    generate(app)
    # 00:02..00:05 are older than the grace: one run for the latest (fire_once).
    assert nominals(app, sid) == [at(1), at(5)]
    assert get(app, sid).next_fire_at == at(6)
    generate(app)  # 00:06 is on time, but 00:05 is still active: it queues
    assert nominals(app, sid) == [at(1), at(5)]
    set_state(app, sid, JobState.SUCCEEDED)
    generate(app)
    assert nominals(app, sid) == [at(1), at(5), at(6)]


def test_overlap_allow_ignores_the_previous_run(app: duebox.Duebox) -> None:
    sid = add(app, "m", "* * * * *")
    clock = clock_of(app)
    for _ in range(3):
        clock.advance(60)
        generate(app)
        set_state(app, sid, JobState.RUNNING)
    assert nominals(app, sid) == [at(1), at(2), at(3)]


def test_fall_back_hourly_through_the_relay_does_the_documented_thing(
    database_url: str
) -> None:
    """New York, 2030-11-03: 01:00 local happens at 05:00Z and 06:00Z."""
    start = datetime(2030, 11, 3, 3, 30, tzinfo=UTC)
    app = make_app(database_url, FakeClock(start))
    first = add(app, "default", "0 * * * *", timezone="America/New_York")
    both = add(app, "both", "0 * * * *", timezone="America/New_York", fold="both")
    last = add(app, "last", "0 * * * *", timezone="America/New_York", fold="last")
    for _ in range(5 * 60):  # a pass a minute for five hours
        clock_of(app).advance(60)
        generate(app)
    hours = [datetime(2030, 11, 3, h, tzinfo=UTC) for h in (4, 5, 6, 7, 8)]
    assert nominals(app, first) == [hours[i] for i in (0, 1, 3, 4)]
    assert nominals(app, both) == hours
    assert nominals(app, last) == [hours[i] for i in (0, 2, 3, 4)]
    app.dispose()


def test_delete_keeps_pending_occurrences_unless_told_to_cancel_them(
    app: duebox.Duebox,
) -> None:
    """Deleting a schedule is pausing it for good: what it already generated
    still runs unless the caller asks, and then each cancellation is audited."""
    kept_sid = add(app, "kept", "* * * * *", misfire="fire_all")
    sid = add(app, "m", "* * * * *", misfire="fire_all")
    clock_of(app).advance(180)
    generate(app)
    with app.engine.begin() as conn:
        conn.execute(sa.update(job).where(job.c.nominal_fire_at == at(1))
                     .values(state=JobState.SUCCEEDED))
    with Session(app.engine) as s, s.begin():
        assert app.schedules.delete(s, kept_sid) == DeleteResult(cancelled=0, kept=2)
    assert {r.state for r in occurrence_rows(app, kept_sid)} == {"SUCCEEDED", "SCHEDULED"}
    with Session(app.engine) as s, s.begin():
        assert app.schedules.delete(s, sid, cancel_pending=True, operator="alice",
                                    reason="retired") == DeleteResult(cancelled=2, kept=0)
    states = {r.nominal_fire_at: (r.state, r.version) for r in occurrence_rows(app, sid)}
    assert states == {at(1): ("SUCCEEDED", 1), at(2): ("CANCELLED", 2),
                      at(3): ("CANCELLED", 2)}
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(audit).order_by(audit.c.action)).all()
    cancelled = {r.id for r in occurrence_rows(app, sid) if r.state == "CANCELLED"}
    assert sorted((r.action, r.job_id in cancelled) for r in rows) == [
        ("cancel", True), ("cancel", True), ("schedule_delete", False)]
    assert all((r.operator, r.reason) == ("alice", "retired") for r in rows)
    [deleted] = [r for r in rows if r.action == "schedule_delete"]
    assert deleted.details["schedule"] == "m"
    assert (deleted.details["cancelled"], deleted.details["kept"]) == (2, 0)


def test_a_broken_stored_rule_is_reported_and_does_not_stop_the_others(
    app: duebox.Duebox, caplog: pytest.LogCaptureFixture
) -> None:
    broken = add(app, "broken", "* * * * *")
    fine = add(app, "fine", "* * * * *")
    with app.engine.begin() as conn:
        conn.execute(sa.update(schedule).where(schedule.c.id == broken)
                     .values(timezone="Gone/Away"))
    clock_of(app).advance(120)
    result = generate(app)
    assert (result.errors, result.errored) == (1, [broken])
    assert nominals(app, fine) == [at(1), at(2)]
    assert "cannot plan occurrences" in caplog.text
    assert get(app, broken).next_fire_at == at(1)  # still due: retried, never silent


# --- the CLI ----------------------------------------------------------------------------


@pytest.fixture
def runner(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    from tests.apps import cli_app

    monkeypatch.setenv("DUEBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("DUEBOX_APP", "tests.apps.cli_app:app")
    cli_app.app.configure(database_url=database_url)
    yield CliRunner()
    cli_app.app.dispose()


def invoke(runner: CliRunner, *args: str) -> str:
    result = runner.invoke(cli, ["schedules", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_cli_add_list_show_next_pause_resume_delete(runner: CliRunner) -> None:
    out = invoke(runner, "add", "nightly", "cli.noop", "30 2 * * *", "--tz", "America/New_York",
                 "--payload", '{"a": 1}', "--misfire", "skip", "--fold", "both")
    assert "schedule nightly" in out
    sid = out.split("schedule nightly ")[1].split()[0]
    uuid.UUID(sid)

    listed = invoke(runner, "list")
    for needle in ("nightly", "30 2 * * *", "America/New_York"):
        assert needle in listed

    shown = invoke(runner, "show", "nightly")
    for needle in (sid, "misfire skip", "fold both"):
        assert needle in shown

    nxt = invoke(runner, "next", sid, "-n", "12")
    assert len([ln for ln in nxt.splitlines() if ln.startswith("  ")]) == 12
    # Local time and UTC side by side; New York springs forward on 2027-03-14,
    # when 02:30 does not exist and is shifted to 03:00.
    lines = invoke(runner, "next", sid, "--after", "2027-03-13", "-n", "3").splitlines()[2:]
    assert lines[0].split() == ["2027-03-13", "02:30:00", "EST", "(-05:00)",
                                "2027-03-13T07:30:00Z"]
    assert lines[1].split()[:5] == ["2027-03-14", "03:00:00", "EDT", "(-04:00)",
                                    "2027-03-14T07:00:00Z"]
    assert "02:30:00 does not exist that day" in lines[1]
    assert lines[2].split()[:5] == ["2027-03-15", "02:30:00", "EDT", "(-04:00)",
                                    "2027-03-15T06:30:00Z"]

    who = ["--operator", "alice", "--reason", "maintenance"]
    assert "paused" in invoke(runner, "pause", "nightly", *who)
    assert "yes" in invoke(runner, "show", "nightly").split("paused")[1].splitlines()[0]
    assert "next fire" in invoke(runner, "resume", "nightly", *who)
    assert "deleted; no pending occurrences" in invoke(runner, "delete", "nightly", *who)
    assert "no schedules" in invoke(runner, "list")


def test_cli_errors_name_the_field(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["schedules", "add", "x", "cli.noop", "99 * * * *"])
    assert result.exit_code == 1
    assert "ValidationError: cron:" in result.output
    result = runner.invoke(cli, ["schedules", "add", "x", "cli.noop", "* * * * *",
                                 "--tz", "Nowhere/Land"])
    assert "ValidationError: timezone:" in result.output
    result = runner.invoke(cli, ["schedules", "show", "missing"])
    assert result.exit_code == 1
    assert "schedule: must be the id or name of an existing schedule" in result.output
    result = runner.invoke(cli, ["schedules", "add", "x", "cli.noop", "* * * * *",
                                 "--payload", "{not json"])
    assert result.exit_code != 0
    assert "--payload" in result.output
