"""Alembic environment for duebox's own tables.

duebox keeps its revision in ``duebox_alembic_version`` so it never touches an
application's ``alembic_version``.  To manage duebox's tables from your own
Alembic environment instead, see docs/migrations.md.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from duebox.tables import metadata

VERSION_TABLE = "duebox_alembic_version"


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
        include_name=lambda name, type_, parent: type_ != "table" or (name or "").startswith(
            "duebox_"
        ),
    )
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("duebox migrations run through duebox.migrate (duebox db upgrade)")
_run(connection)
