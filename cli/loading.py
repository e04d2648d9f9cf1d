"""Finding the user's :class:`~duebox.Duebox` from ``--app module:attr``."""

from __future__ import annotations

import importlib
import os
import sys

import click

from duebox import Duebox
from duebox.db import check_tables
from duebox.errors import ConfigurationError


def load_app(spec: str | None, database_url: str | None = None,
             broker_url: str | None = None, *, tables: bool = True) -> Duebox:
    """``module:attr`` (attr may be a Duebox or a zero-argument factory); without
    a spec, an app built from the ``DUEBOX_*`` environment.  With ``tables``
    (every command but ``db``), a database without duebox's tables is refused
    before anything else is read, and a missing SQLite file is not created."""
    app = _import(spec) if spec else Duebox.from_env()
    app.configure(database_url=database_url, broker_url=broker_url)
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.call_on_close(app.dispose)
    if tables:
        check_tables(app.engine, ctx.command_path.removeprefix("duebox ") if ctx else "duebox")
    return app


def _import(spec: str) -> Duebox:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or not all(
        part.isidentifier() for part in [*module_name.split("."), *attr.split(".")]
    ):
        raise ConfigurationError(
            f"--app: must be 'module:attribute', e.g. 'myproject.jobs:app' (got {spec!r})"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"--app: cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigurationError(
                f"--app: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not isinstance(obj, Duebox) and callable(obj):
        obj = obj()
    if not isinstance(obj, Duebox):
        raise ConfigurationError(
            f"--app: {spec!r} is a {type(obj).__name__}, not a duebox.Duebox"
        )
    return obj
