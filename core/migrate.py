"""``duebox db upgrade``: create or upgrade duebox's tables with Alembic.

Alembic is imported when a function here runs, not with this module: a
worker or relay that never migrates starts 0.2 s sooner without it (and
without the Mako and Pygments it brings)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import Engine

from .db import db_errors

if TYPE_CHECKING:
    from alembic.config import Config

VERSION_TABLE = "duebox_alembic_version"


def alembic_config() -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", "duebox:migrations")
    return cfg


def upgrade(engine: Engine, revision: str = "heads") -> None:
    from alembic import command

    cfg = alembic_config()
    with db_errors("db upgrade"), engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with db_errors("db current"), engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()
