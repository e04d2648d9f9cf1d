"""job results

Revision ID: 0009
Revises: 0008
A new table, ``duebox_result``: what the handler of a task with
``store_result=True`` returned, as JSON text, one row per succeeded job,
written in the transaction of the job's completion (duebox.reads.results).  Each
row expires ``result_ttl`` seconds after the job finished; relays delete
expired rows by ``ix_duebox_result_expires``.  Existing tables are not
touched.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

from sqlalchemy.dialects import mysql

# duebox.tables' UTCDateTime as of this revision: DATETIME(6) on
# MySQL/MariaDB (see 0004), a zone-aware timestamp elsewhere.
_INSTANT = sa.DateTime(timezone=True).with_variant(
    mysql.DATETIME(timezone=True, fsp=6), 'mysql', 'mariadb')

# revision identifiers, used by Alembic.
revision: str = '0009'
down_revision: Union[str, Sequence[str], None] = '0008'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        'duebox_result',
        sa.Column('job_id', sa.Uuid(), nullable=False),
        sa.Column('value', sa.Text(), nullable=False),
        sa.Column('stored_at', _INSTANT, nullable=False),
        sa.Column('expires_at', _INSTANT, nullable=False),
        sa.PrimaryKeyConstraint('job_id', name=op.f('pk_duebox_result')),
    )
    op.create_index('ix_duebox_result_expires', 'duebox_result', ['expires_at'])


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index('ix_duebox_result_expires', table_name='duebox_result')
    op.drop_table('duebox_result')
