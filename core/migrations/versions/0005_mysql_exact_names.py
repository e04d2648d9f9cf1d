"""MySQL/MariaDB: keys, names and tenants compare exactly (binary, no padding)

Revision ID: 0005
Revises: 0004
Up to 0004, MySQL/MariaDB created these columns with the server's default
collation (``utf8mb4_general_ci`` on MariaDB): case-insensitive, accent- and
trailing-space-blind.  So ``schedule(key="ABC")`` after ``key="abc"`` found
the first job and scheduled nothing (a job lost), ``"a"`` and ``"a "`` were
one key, tasks and queues differing in case were one queue to the sql://
claim, and schedules named ``Nightly`` and ``nightly`` could not both exist.
PostgreSQL and SQLite already compare these exactly: nothing happens there.

This makes them binary without padding (``utf8mb4_nopad_bin`` on MariaDB,
``utf8mb4_0900_bin`` on MySQL 8): equal means the same characters, as in
Python.  The downgrade returns them to the table's default collation; it
fails if two rows then collide (as the old collation would have refused).
"""
from typing import Sequence, Union

from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0005'
down_revision: Union[str, Sequence[str], None] = '0004'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

# (table, [(column, type, nullable)]) at this revision, frozen as migrations must be.
_COLUMNS = (
    ('duebox_job', (
        ('key', 'VARCHAR(400)', True), ('task', 'VARCHAR(200)', False),
        ('queue', 'VARCHAR(200)', False), ('tenant', 'VARCHAR(200)', True),
    )),
    ('duebox_schedule', (
        ('name', 'VARCHAR(200)', False), ('task', 'VARCHAR(200)', False),
        ('queue', 'VARCHAR(200)', False),
    )),
    ('duebox_rate_bucket', (('name', 'VARCHAR(200)', False),)),
)


def _alter(exact: bool) -> None:
    # The context's dialect, not a bind: works offline (``alembic upgrade --sql``) too.
    dialect = op.get_context().dialect
    if dialect.name not in ('mysql', 'mariadb'):
        return
    if not exact:
        collation = ''
    elif getattr(dialect, 'is_mariadb', False):
        collation = ' CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin'
    else:
        collation = ' CHARACTER SET utf8mb4 COLLATE utf8mb4_0900_bin'
    for table, columns in _COLUMNS:
        modify = ', '.join(
            f"MODIFY `{name}` {type_sql}{collation} {'NULL' if nullable else 'NOT NULL'}"
            for name, type_sql, nullable in columns
        )
        op.execute(f'ALTER TABLE `{table}` {modify}')


def upgrade() -> None:
    """Upgrade schema."""
    _alter(exact=True)


def downgrade() -> None:
    """Downgrade schema."""
    _alter(exact=False)
