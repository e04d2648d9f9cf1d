"""failed attempts keep their traceback

Revision ID: 0006
Revises: 0005
duebox_attempt gains ``traceback``: the formatted traceback of a failed
attempt, bounded in size (see duebox.failures) and masked like the payload
for tasks with a mask hook.  Existing attempts have none (NULL).  A nullable
column with no default: an instant, metadata-only change on PostgreSQL and
MariaDB/MySQL, a plain ADD COLUMN on SQLite.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = '0006'
down_revision: Union[str, Sequence[str], None] = '0005'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('duebox_attempt', sa.Column('traceback', sa.Text(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('duebox_attempt', schema=None) as batch_op:
        batch_op.drop_column('traceback')
