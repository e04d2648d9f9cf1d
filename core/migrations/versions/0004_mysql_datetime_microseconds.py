"""MySQL/MariaDB: every timestamp column keeps microseconds (DATETIME(6))

Revision ID: 0004
Revises: 0003
duebox 0.3.x: on MySQL/MariaDB, 0001-0003 created ``DATETIME`` columns, which
keep whole seconds: a job due at 12:00:00.7 was stored as 12:00:00 (MariaDB
truncates; MySQL rounds, either way down half the time) and could start up
to a second early.  This widens every timestamp column of duebox's tables to
``DATETIME(6)``, as duebox.tables declares them now.  PostgreSQL and SQLite
already keep microseconds: nothing happens there.

Each table is altered in one statement (one rebuild, not one per column).
Values already stored stay as they were: their lost fraction cannot be
recovered.  The downgrade narrows the columns back, dropping the fractions
again (MariaDB truncates them, MySQL rounds them).
"""
from typing import Sequence, Union

from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0004'
down_revision: Union[str, Sequence[str], None] = '0003'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

# (table, [(column, nullable)]): every timestamp column of duebox's tables at
# this revision, frozen here as migrations must be.
_COLUMNS = (
    ('duebox_job', (
        ('due_at', False), ('nominal_fire_at', True), ('expires_at', True),
        ('lease_until', True), ('published_at', True), ('created_at', False),
        ('updated_at', False), ('claimed_at', True), ('started_at', True),
        ('finished_at', True),
    )),
    ('duebox_attempt', (('started_at', False), ('finished_at', True))),
    ('duebox_processed', (('processed_at', False),)),
    ('duebox_lease', (('expires_at', True),)),
    ('duebox_rate_bucket', (('updated_at', False),)),
    ('duebox_audit', (('at', False),)),
    ('duebox_schedule', (
        ('next_fire_at', True), ('last_fire_at', True), ('created_at', False),
        ('updated_at', False),
    )),
)


def _alter(type_sql: str) -> None:
    # The context's dialect, not a bind: works offline (``alembic upgrade --sql``) too.
    if op.get_context().dialect.name not in ('mysql', 'mariadb'):
        return
    for table, columns in _COLUMNS:
        modify = ', '.join(
            f"MODIFY `{name}` {type_sql} {'NULL' if nullable else 'NOT NULL'}"
            for name, nullable in columns
        )
        op.execute(f'ALTER TABLE `{table}` {modify}')


def upgrade() -> None:
    """Upgrade schema."""
    _alter('DATETIME(6)')


def downgrade() -> None:
    """Downgrade schema."""
    _alter('DATETIME')
