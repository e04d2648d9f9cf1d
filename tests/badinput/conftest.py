"""Fixtures of the bad-input suite (the shared ones live in tests/conftest.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import reset_tables

import duebox


@pytest.fixture
def bare_app() -> Iterator[duebox.Duebox]:
    """An in-memory app with one task, ``t``: for checks that never reach SQL."""
    app = duebox.Duebox("sqlite://")
    app.add_task("t", lambda payload, ctx: None)
    yield app
    app.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One SQLite file migrated once.  Migrating is most of a test's time here
    (0003 rebuilds tables in Alembic's batch mode on SQLite): ~0.2 s, times
    ~130 SQLite tests."""
    path = tmp_path_factory.mktemp("badinput-template") / "duebox.db"
    reset_tables(f"sqlite:///{path}")
    # Every connection is closed, so the WAL (if any) was checkpointed into
    # the file and removed: the one file is the whole database.
    assert not any(path.parent.glob("duebox.db-*")), list(path.parent.iterdir())
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """tests/conftest.py's fixture, with the SQLite database a fresh copy of
    the migrated template: still a file of its own per test, so no test sees
    another's rows (PostgreSQL, 9 tests here, is migrated afresh as there)."""
    if request.param == "sqlite":
        path = tmp_path / "duebox.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("pg_server_url")
    reset_tables(url)
    return url
