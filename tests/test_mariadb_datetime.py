"""Timestamps on MySQL/MariaDB keep microseconds (``DATETIME(6)``).

A bare ``DATETIME`` keeps whole seconds, so a job due at 12:00:00.7 was
stored as 12:00:00 and a worker could start it up to a second early
(invariant 1).  duebox.tables declares ``DATETIME(6)``; migration 0004 widens
databases created before.  These run on the real MariaDB
(``DUEBOX_TEST_MYSQL``, default root@127.0.0.1:3306), each on databases of
their own.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from conftest import MYSQL_ADMIN_URL, reset_tables
from helpers import Running, check_no_early_start, effect_rows, job_row, make_app, us

import duebox
from duebox import migrate
from duebox.clock import DatabaseClock, server_now_sql
from duebox.tables import UTCDateTime, job

T0 = datetime(2030, 1, 1, 12, tzinfo=UTC)
# Fractions a whole-second column loses, rounding either way.
FRACTIONS_US = (1, 300_000, 499_999, 500_000, 700_000, 999_999)


@pytest.fixture
def new_database(mariadb_server_url: str) -> Iterator[Callable[[], str]]:
    """Makes further empty MariaDB databases (the session's one proves the
    server is there); all are dropped at the end of the test."""
    admin = sa.create_engine(MYSQL_ADMIN_URL, isolation_level="AUTOCOMMIT")
    names: list[str] = []

    def make() -> str:
        name = f"duebox_test_{uuid.uuid4().hex[:10]}"
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE `{name}`"))
        names.append(name)
        return MYSQL_ADMIN_URL.rsplit("/", 1)[0] + "/" + name

    try:
        yield make
    finally:
        with admin.connect() as conn:
            for name in names:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


def _engine(url: str) -> sa.Engine:
    return duebox.Duebox(database_url=url).engine


def _timestamp_columns() -> list[tuple[str, str]]:
    return [(t.name, c.name) for t in duebox.metadata.sorted_tables for c in t.columns
            if isinstance(c.type, UTCDateTime)]


def _present(engine: sa.Engine) -> list[sa.Table]:
    """duebox's tables this database has (an older revision lacks later ones)."""
    names = set(sa.inspect(engine).get_table_names())
    return [t for t in duebox.metadata.sorted_tables if t.name in names]


def _show_create(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return {t.name: conn.execute(sa.text(f"SHOW CREATE TABLE `{t.name}`")).one()[1]
                for t in _present(engine)}


def _columns(engine: sa.Engine) -> dict[tuple[str, str], tuple[str, bool]]:
    """Every duebox column's reflected type (as the server spells it) and nullability."""
    insp = sa.inspect(engine)
    return {(t.name, c["name"]): (str(c["type"].compile(engine.dialect)), c["nullable"])
            for t in _present(engine) for c in insp.get_columns(t.name)}


def _diffs(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={
            "version_table": migrate.VERSION_TABLE, "compare_type": True,
            "compare_server_default": True,
            "include_name": lambda name, type_, parent: (
                type_ != "table" or (name or "").startswith("duebox_")),
        })
        return list(compare_metadata(ctx, duebox.metadata))


def _downgrade(engine: sa.Engine, revision: str) -> None:
    cfg = migrate.alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def _due_at(engine: sa.Engine, job_id: uuid.UUID) -> datetime:
    """The job's due time, read with only that column: an older schema lacks
    the columns later migrations add to the model."""
    with engine.connect() as conn:
        due: datetime = conn.execute(
            sa.select(job.c.due_at).where(job.c.id == job_id)).scalar_one()
    return due


def _insert_old_job(engine: sa.Engine, due_at: datetime) -> uuid.UUID:
    """A job row as a 0003 schema holds it (only the columns without defaults)."""
    old = sa.table("duebox_job", sa.column("id", sa.Uuid()), *(sa.column(c) for c in (
        "task", "queue", "state", "version", "attempt", "max_attempts", "priority",
        "lease_generation", "shard")), sa.column("due_at", UTCDateTime()),
        sa.column("created_at", UTCDateTime()), sa.column("updated_at", UTCDateTime()))
    job_id = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(old.insert().values(
            id=job_id, task="t", queue="q", state="SCHEDULED", version=1, attempt=0,
            max_attempts=3, priority=0, lease_generation=0, shard=0,
            due_at=due_at, created_at=due_at, updated_at=due_at))
    return job_id


# --- the declared type ----------------------------------------------------------------


@pytest.mark.mariadb
def test_every_timestamp_column_is_datetime6(mariadb_server_url: str) -> None:
    reset_tables(mariadb_server_url)
    engine = _engine(mariadb_server_url)
    try:
        cols = _columns(engine)
        found = {key: cols[key] for key in _timestamp_columns()}
        # 20 by 0004, duebox_schedule.retired_at by 0007, duebox_result's two by 0009
        assert len(found) == 23
        assert set(found.values()) <= {("DATETIME(6)", True), ("DATETIME(6)", False)}, found
        assert _diffs(engine) == []
    finally:
        engine.dispose()


@pytest.mark.mariadb
def test_a_fractional_due_at_round_trips_exactly(mariadb_server_url: str) -> None:
    """Stored, read back and compared in SQL to the microsecond."""
    reset_tables(mariadb_server_url)
    app = duebox.Duebox(mariadb_server_url)
    app.task("t")(lambda payload, ctx: None)
    try:
        dues = {T0 + timedelta(microseconds=f) for f in FRACTIONS_US}
        ids = {}
        for due in dues:
            with app.engine.begin() as conn:
                ids[due] = app.schedule(conn, "t", at=due)
        with app.engine.connect() as conn:
            for due, job_id in ids.items():
                assert job_row(app.engine, job_id).due_at == due
                raw = conn.execute(sa.text(
                    "SELECT CAST(due_at AS CHAR) FROM duebox_job WHERE id = :id"),
                    {"id": job_id.hex}).scalar_one()
                assert raw == due.replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")
                # The claim's test, with a bound horizon: due at, not a microsecond before.
                for horizon, found in ((due - timedelta(microseconds=1), False), (due, True)):
                    hit = conn.execute(sa.select(job.c.id).where(
                        job.c.id == job_id, job.c.due_at <= horizon)).first()
                    assert (hit is not None) is found, (due, horizon)
    finally:
        app.dispose()


@pytest.mark.mariadb
def test_the_database_clock_reads_microseconds(mariadb_server_url: str) -> None:
    """DatabaseClock reads ``UTC_TIMESTAMP(6)``: at whole seconds its offset
    would be up to a second behind (late, not early, but not "tight")."""
    engine = sa.create_engine(mariadb_server_url)
    try:
        with engine.connect() as conn:
            clause = server_now_sql(conn.dialect.name)
            assert clause is not None
            readings = [conn.execute(clause).scalar_one() for _ in range(5)]
            clock = DatabaseClock()
            clock.sync(conn)
        assert any(r.microsecond for r in readings), readings
        # Same machine, same clock: a lower bound, within a round trip of 0.
        assert timedelta(seconds=-2) < clock.offset <= timedelta(0)
    finally:
        engine.dispose()


# --- migration 0004 -------------------------------------------------------------------


@pytest.mark.mariadb
def test_an_upgraded_database_matches_a_fresh_one(new_database: Callable[[], str]) -> None:
    """0001-0003 then 0004 over existing rows gives the schema 0001-0004 give
    on an empty database, which is the schema duebox.tables declares."""
    fresh, upgraded, declared = (_engine(new_database()) for _ in range(3))
    try:
        migrate.upgrade(fresh)
        migrate.upgrade(upgraded, "0003")
        # Alembic's autogenerate does not flag DATETIME against DATETIME(6)
        # (it ignores a less specific type), so the columns are compared as reflected.
        assert _columns(upgraded) != _columns(fresh)
        whole = T0 + timedelta(microseconds=700_000)
        job_id = _insert_old_job(upgraded, whole)
        assert _due_at(upgraded, job_id) == T0  # what 0003 did to it
        migrate.upgrade(upgraded)
        duebox.metadata.create_all(declared)

        assert (migrate.current_revision(upgraded) == migrate.current_revision(fresh)
                == migrate.head_revision())
        assert _show_create(upgraded) == _show_create(fresh)
        assert _columns(upgraded) == _columns(fresh) == _columns(declared)
        assert _diffs(upgraded) == []
        assert _diffs(fresh) == []
        # The row survived; from now on fractions are kept.
        assert job_row(upgraded, job_id).due_at == T0
        with upgraded.begin() as conn:
            conn.execute(job.update().where(job.c.id == job_id).values(due_at=whole))
        assert job_row(upgraded, job_id).due_at == whole
    finally:
        for e in (fresh, upgraded, declared):
            e.dispose()


@pytest.mark.mariadb
def test_0004_downgrades_to_the_0003_schema(new_database: Callable[[], str]) -> None:
    at_0003, round_trip = (_engine(new_database()) for _ in range(2))
    try:
        migrate.upgrade(at_0003, "0003")
        migrate.upgrade(round_trip)
        _insert_old_job(round_trip, T0 + timedelta(microseconds=250_000))
        _downgrade(round_trip, "0003")
        assert migrate.current_revision(round_trip) == "0003"
        assert _show_create(round_trip) == _show_create(at_0003)
        migrate.upgrade(round_trip)
        assert _diffs(round_trip) == []
    finally:
        at_0003.dispose()
        round_trip.dispose()


def test_0004_changes_nothing_on_sqlite_and_postgresql(database_url: str) -> None:
    engine = _engine(database_url)
    try:
        _downgrade(engine, "0003")
        before = _columns(engine)
        migrate.upgrade(engine, "0004")  # later revisions add columns of their own
        assert migrate.current_revision(engine) == "0004"
        assert _columns(engine) == before
    finally:
        engine.dispose()


_USER_ENV = '''
from alembic import context
connection = context.config.attributes.get("connection")
if connection is None:
    context.configure(url=context.config.get_main_option("sqlalchemy.url"),
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    context.configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()
'''


def _user_config(tmp_path: Path, url: str) -> Config:
    """An application's own Alembic environment with duebox's branch, as
    docs/migrations.md sets it up."""
    (tmp_path / "migrations" / "versions").mkdir(parents=True)
    (tmp_path / "migrations" / "env.py").write_text(_USER_ENV)
    cfg = Config()
    cfg.set_main_option("script_location", str(tmp_path / "migrations"))
    cfg.set_main_option("path_separator", "space")  # not "os": ':' is in duebox:...
    cfg.set_main_option("version_locations",
                        f"{tmp_path}/migrations/versions duebox:migrations/versions")
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


@pytest.mark.mariadb
def test_0004_from_an_applications_own_alembic_environment(
    new_database: Callable[[], str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = new_database()
    cfg = _user_config(tmp_path, url)
    engine = _engine(url)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "duebox@head")
        assert _diffs(engine) == []
        # Offline (``alembic upgrade --sql``): the script it prints does the same.
        del cfg.attributes["connection"]
        capsys.readouterr()
        command.upgrade(cfg, "0003:0004", sql=True)
        script = capsys.readouterr().out
        assert "ALTER TABLE `duebox_job` MODIFY `due_at` DATETIME(6) NOT NULL" in script
        assert script.count("DATETIME(6)") == 20
    finally:
        engine.dispose()


# --- invariant 1, end to end ----------------------------------------------------------


@pytest.mark.mariadb
async def test_jobs_due_at_fractional_seconds_never_start_early(
    mariadb_server_url: str,
) -> None:
    """sql:// on MariaDB: each job's handler starts no earlier than the
    instant it was scheduled for, taken from the test, not from the row (a
    truncated row would agree with an early start)."""
    reset_tables(mariadb_server_url)
    app = make_app(mariadb_server_url, "sql://")
    try:
        # Late in a second, where a whole-second column loses the most.
        base = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=2)
        wanted: dict[str, int] = {}
        for i in range(12):
            due = base + timedelta(seconds=i // 4,
                                   microseconds=(550_001, 700_000, 850_000, 999_999)[i % 4])
            with app.engine.begin() as conn:
                job_id = app.schedule(conn, "effect", at=due)
            wanted[str(job_id)] = us(due)
        # Workers only: on sql:// they claim due rows themselves.  (A relay's
        # recovery pass fails on MariaDB, an UPDATE ... IN (SELECT ... LIMIT).)
        async with Running(app, relays=0, workers=2) as r:
            await r.wait(lambda: len(effect_rows(app.engine)) == len(wanted),
                         timeout=30, what="every job to run")
        rows = effect_rows(app.engine)
        early = {j: wanted[j] - rows[j].started_us for j in wanted
                 if rows[j].started_us < wanted[j]}
        assert early == {}, f"started early by (us): {early}"
        assert all(rows[j].due_us == wanted[j] for j in wanted)
        check_no_early_start(app.engine)
    finally:
        app.dispose()
