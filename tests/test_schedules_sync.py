"""Schedules as code, part 2 (issue #22 item 7): ``@app.task(schedule=...)``
declarations and the relay's sync at start (:mod:`duebox.schedules.sync`):
created, updated, left alone when unchanged, paused or deleted when they
leave the code, hand-made schedules never touched; several relays syncing at
once on the real PostgreSQL and MariaDB."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from test_schedules import T0

import duebox
from duebox import ConfigurationError, FakeClock, Settings
from duebox.relay import Relay
from duebox.schedules.periodic import Periodic
from duebox.schedules.sync import SyncReport, sync_declared
from duebox.tables import audit, schedule


def code_app(url: str, declare: Callable[[duebox.Duebox], None], clock: FakeClock | None = None,
             **settings: Any) -> duebox.Duebox:
    app = duebox.Duebox(url, "sql://", clock=clock or FakeClock(T0),
                        settings=Settings(poll_interval=1.0, **settings))
    declare(app)
    return app


def v1(app: duebox.Duebox) -> None:
    @app.task("report", queue="reports", schedule="0 9 * * *", timezone="Europe/Berlin")
    def report(payload: Any, ctx: duebox.JobContext) -> None:
        return None

    @app.task("prices", schedule=[Periodic("*/15 * * * *", name="prices-eu",
                                           payload={"region": "eu"}),
                                  Periodic("*/15 * * * *", name="prices-us",
                                           payload={"region": "us"},
                                           timezone="America/New_York")])
    def prices(payload: Any, ctx: duebox.JobContext) -> None:
        return None


def v2(app: duebox.Duebox) -> None:
    """The next release: report moves to 08:00, prices-us is gone."""
    @app.task("report", queue="reports", schedule="0 8 * * *", timezone="Europe/Berlin")
    def report(payload: Any, ctx: duebox.JobContext) -> None:
        return None

    @app.task("prices", schedule=Periodic("*/15 * * * *", name="prices-eu",
                                          payload={"region": "eu"}))
    def prices(payload: Any, ctx: duebox.JobContext) -> None:
        return None


@pytest.fixture
def url(database_url: str) -> str:
    return database_url


def rows(url: str) -> dict[str, Any]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return {r.name: r for r in conn.execute(sa.select(schedule)).all()}
    finally:
        engine.dispose()


def audits(url: str) -> list[Any]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.select(audit).order_by(audit.c.at)).all())
    finally:
        engine.dispose()


def sync(app: duebox.Duebox) -> SyncReport:
    try:
        return sync_declared(app, "relay test")
    finally:
        app.dispose()


def test_declarations_are_checked_at_import() -> None:
    app = duebox.Duebox("sqlite://", "sql://")
    with pytest.raises(ConfigurationError,
                       match="task 'bad', schedule 'bad': cron: minute field '60'"):
        app.task("bad", schedule="60 * * * *")
    with pytest.raises(ConfigurationError, match="timezone: "):
        app.task("bad", schedule="0 9 * * *", timezone="Mars/Olympus")
    with pytest.raises(ConfigurationError, match="timezone= applies to schedule="):
        app.task("bad", timezone="UTC")
    with pytest.raises(ConfigurationError, match="distinct names"):
        app.task("bad", schedule=[Periodic("0 9 * * *"), Periodic("0 10 * * *")])
    app.task("a", schedule="0 9 * * *")(lambda p, c: None)
    with pytest.raises(ConfigurationError, match="declared by task 'a' and by task 'b'"):
        app.task("b", schedule=Periodic("0 9 * * *", name="a"))
    assert list(app.declared_schedules) == ["a"]


def test_sync_creates_updates_and_pauses_what_left_the_code(url: str) -> None:
    first = sync(code_app(url, v1))
    assert first.created == ["prices-eu", "prices-us", "report"]
    found = rows(url)
    assert {r.origin for r in found.values()} == {"code"}
    assert (found["report"].queue, found["report"].timezone) == ("reports", "Europe/Berlin")
    assert found["prices-us"].payload == {"region": "us"}

    # A relay restarting on the same code writes nothing.
    again = sync(code_app(url, v1))
    assert (again.changes, again.unchanged) == (0, ["prices-eu", "prices-us", "report"])
    assert rows(url) == found

    # The next release.
    later = sync(code_app(url, v2))
    assert (later.updated, later.paused, later.unchanged) == (
        ["report"], ["prices-us"], ["prices-eu"])
    now = rows(url)
    assert (now["report"].cron, now["report"].version) == ("0 8 * * *", 2)
    assert now["prices-us"].paused
    assert now["prices-us"].retired_at is not None
    assert now["prices-eu"].version == 1
    assert [(a.action, a.operator, a.details["schedule"]) for a in audits(url)][3:] == [
        ("schedule_update", "relay test", "report"), ("schedule_pause", "relay test",
                                                      "prices-us")]
    # Paused already: a further sync of v2 leaves it alone.
    assert sync(code_app(url, v2)).changes == 0

    # Declared again: the sync resumes what it paused.
    back = sync(code_app(url, v1))
    assert (back.updated, back.paused) == (["prices-us", "report"], [])
    revived = rows(url)["prices-us"]
    assert (revived.paused, revived.retired_at, revived.version) == (False, None, 3)


def test_an_operators_pause_and_hand_made_schedules_are_left_alone(
        url: str, caplog: pytest.LogCaptureFixture) -> None:
    sync(code_app(url, v1))
    app = code_app(url, v1)
    with Session(app.engine) as s, s.begin():
        app.schedules.pause(s, "prices-us", operator="alice", reason="incident")
        # Made by hand: a name the code will declare, and one it never did.
        app.schedules.delete(s, "report")
        app.schedules.add(s, "report", "report", "0 7 * * *")
        app.schedules.add(s, "by-hand", "prices", "0 12 * * *")
    app.dispose()

    # prices-us leaves the code while an operator has it paused ...
    report = sync(code_app(url, v2))
    assert report.hand_made == ["report"]
    assert report.paused == []
    assert "'report' is declared in code but was made by hand" in caplog.text
    found = rows(url)
    assert (found["report"].cron, found["report"].origin) == ("0 7 * * *", "api")
    assert found["prices-us"].retired_at is None
    # ... and comes back: still paused, as the operator left it.
    sync(code_app(url, v1))
    assert rows(url)["prices-us"].paused
    assert rows(url)["by-hand"] == found["by-hand"]


def test_the_delete_policy_and_a_relay_without_tasks(url: str) -> None:
    sync(code_app(url, v1))
    assert sync(code_app(url, lambda app: None)).skipped  # no --app: nothing declared
    assert len(rows(url)) == 3
    report = sync(code_app(url, v2, removed_schedules="delete"))
    assert report.deleted == ["prices-us"]
    assert set(rows(url)) == {"prices-eu", "report"}
    with pytest.raises(ConfigurationError, match="removed_schedules: must be one of pause, "
                                                 "delete"):
        Settings(removed_schedules="forget")


def test_a_declaration_the_database_refuses_stops_the_sync_before_any_write(url: str) -> None:
    def big(app: duebox.Duebox) -> None:
        v1(app)
        app.task("huge", schedule=Periodic("0 9 * * *", payload="x" * 2_000_000))(
            lambda p, c: None)

    with pytest.raises(ConfigurationError, match="task 'huge', schedule 'huge': payload"):
        sync(code_app(url, big))
    assert rows(url) == {}


@pytest.mark.asyncio
async def test_the_relay_syncs_when_it_starts(url: str) -> None:
    app = code_app(url, v1)
    try:
        await Relay(app).run_pass()
        assert set(rows(url)) == {"prices-eu", "prices-us", "report"}
    finally:
        app.dispose()


@pytest.mark.parametrize("release", [v1, v2], ids=["first-deploy", "next-release"])
def test_relays_starting_together_sync_once(server_url: str, release: Any) -> None:
    """Eight relays start at the same moment (a barrier), each with its own
    engine: each schedule is created (or updated, or paused) exactly once,
    and no sync fails."""
    if release is v2:
        sync(code_app(server_url, v1))
    n = 8
    barrier = threading.Barrier(n)
    reports: list[SyncReport] = []
    errors: list[BaseException] = []
    clock = FakeClock(T0)

    def start() -> None:
        app = code_app(server_url, release, clock=clock)
        try:
            with app.engine.connect():
                pass  # connected before the barrier: the syncs overlap
            barrier.wait()
            reports.append(sync_declared(app, f"relay {threading.get_ident()}"))
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            app.dispose()

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(reports) == n
    found = rows(server_url)
    if release is v1:
        assert sorted(x for r in reports for x in r.created) == sorted(found)
        assert {r.version for r in found.values()} == {1}
        assert len(audits(server_url)) == 3
    else:
        assert sorted(x for r in reports for x in r.updated) == ["report"]
        assert sorted(x for r in reports for x in r.paused) == ["prices-us"]
        assert (found["report"].version, found["prices-us"].version) == (2, 2)
        assert len(audits(server_url)) == 3 + 2  # the first deploy's adds, then these
