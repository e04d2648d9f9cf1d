"""duebox.cli.loading: ``--app module:attr`` finds the user's app (or its
factory) or says in one line why not; and a command is refused before it
reads anything when the database has no duebox tables, without creating a
SQLite file on the way."""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

import duebox
from duebox import ConfigurationError, DatabaseError, TablesMissingError
from duebox.cli.loading import load_app


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> Iterator[str]:
    """A module of the test's own defining an app, a factory and a non-app."""
    name = f"unit_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""
        import duebox
        app = duebox.Duebox({sqlite_url!r}, "memory://")
        app.add_task("t", lambda p, c: None)
        def make():
            return app
        class Holder:
            inner = app
        not_an_app = 42
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    loaded = sys.modules.pop(name, None)
    if loaded is not None:
        loaded.app.dispose()


def test_an_app_a_factory_or_a_nested_attribute(module: str) -> None:
    app = load_app(f"{module}:app")
    assert isinstance(app, duebox.Duebox)
    assert "t" in app.tasks
    assert load_app(f"{module}:make") is app
    assert load_app(f"{module}:Holder.inner") is app


def test_urls_given_on_the_command_line_win(module: str) -> None:
    app = load_app(f"{module}:app", broker_url="memory://other", tables=False)
    assert app.settings.broker_url == "memory://other"


@pytest.mark.parametrize(("spec", "says"), [
    ("nocolon", "--app: must be 'module:attribute'"),
    (":app", "--app: must be 'module:attribute'"),
    ("mod:", "--app: must be 'module:attribute'"),
    ("my-mod:app", "--app: must be 'module:attribute'"),
    ("mod:app()", "--app: must be 'module:attribute'"),
    ("duebox_no_such_module_x:app", "--app: cannot import module 'duebox_no_such_module_x'"),
])
def test_a_spec_that_names_no_app_says_why(spec: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_app(spec)
    assert str(refused.value).startswith(says)


def test_an_attribute_that_is_missing_or_not_an_app(module: str) -> None:
    with pytest.raises(ConfigurationError, match=f"module '{module}' has no attribute 'nope'"):
        load_app(f"{module}:nope")
    with pytest.raises(ConfigurationError, match=r"is a int, not a duebox.Duebox"):
        load_app(f"{module}:not_an_app")


def test_a_missing_sqlite_file_is_refused_and_not_created(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    missing = tmp_path / "nowhere.db"
    monkeypatch.setenv("DUEBOX_BROKER_URL", "memory://")
    with click.Context(click.Command("status"), info_name="duebox status") as ctx:
        with pytest.raises(DatabaseError, match=r"^status: no database at .*nowhere\.db"):
            load_app(None, f"sqlite:///{missing}")
        ctx.close()
    assert not missing.exists()


def test_a_database_without_the_tables_says_to_upgrade(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    monkeypatch.setenv("DUEBOX_BROKER_URL", "memory://")
    with pytest.raises(TablesMissingError, match="run `duebox db upgrade`"):
        load_app(None, f"sqlite:///{empty}")
    app = load_app(None, f"sqlite:///{empty}", tables=False)  # `duebox db` itself
    app.dispose()
