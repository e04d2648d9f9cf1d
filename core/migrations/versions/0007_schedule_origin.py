"""schedules record their origin (schedules as code)

Revision ID: 0007
Revises: 0006
duebox_schedule gains ``origin`` ('api': made by hand with app.schedules or
the CLI; 'code': declared next to its task and kept in step by the relay's
sync) and ``retired_at`` (when the sync paused a 'code' schedule that left
the code).  Existing schedules were all made by hand: 'api'.  The default is
only there to fill existing rows and is dropped afterwards, as in 0002.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import mysql

# revision identifiers, used by Alembic.
revision: str = '0007'
down_revision: Union[str, Sequence[str], None] = '0006'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

# DATETIME(6) on MySQL/MariaDB, as every duebox timestamp since 0004.
_INSTANT = sa.DateTime(timezone=True).with_variant(
    mysql.DATETIME(timezone=True, fsp=6), 'mysql', 'mariadb')


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('duebox_schedule', schema=None) as batch_op:
        batch_op.add_column(sa.Column('origin', sa.String(length=8), nullable=False,
                                      server_default=sa.text("'api'")))
        batch_op.add_column(sa.Column('retired_at', _INSTANT, nullable=True))
    with op.batch_alter_table('duebox_schedule', schema=None) as batch_op:
        batch_op.alter_column('origin', existing_type=sa.String(length=8),
                              existing_nullable=False, server_default=None)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('duebox_schedule', schema=None) as batch_op:
        batch_op.drop_column('retired_at')
        batch_op.drop_column('origin')
