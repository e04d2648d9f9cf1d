"""``duebox db upgrade``: create or upgrade duebox's tables with Alembic."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from .db import db_errors

VERSION_TABLE = "duebox_alembic_version"


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", "duebox:migrations")
    return cfg


def upgrade(engine: Engine, revision: str = "heads") -> None:
    cfg = alembic_config()
    with db_errors("db upgrade"), engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def current_revision(engine: Engine) -> str | None:
    with db_errors("db current"), engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()
