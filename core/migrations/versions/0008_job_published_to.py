"""jobs record the route they were handed to

Revision ID: 0008
Revises: 0007
duebox_job gains ``published_to``: the broker route (its URL without a
password, core/reroute.py ``route_key``) a job's message was last handed to,
written with the ENQUEUED mark.  When a queue's route changes, a relay moves
the queue's ENQUEUED jobs whose ``published_to`` is another route back to
SCHEDULED with a new version: they are published on the new route and the
old copies are discarded by the version check (docs/brokers.md, "Switching a
queue's broker").  Rows marked before this migration have none: they are
left where they are.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = '0008'
down_revision: Union[str, Sequence[str], None] = '0007'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('duebox_job', schema=None) as batch_op:
        batch_op.add_column(sa.Column('published_to', sa.String(length=255), nullable=True))
    # The relay's sweep for jobs on an old route reads two ranges of it
    # (published_to below and above the current route) instead of every
    # ENQUEUED row.
    op.create_index('ix_duebox_job_state_route', 'duebox_job', ['state', 'published_to'])


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index('ix_duebox_job_state_route', table_name='duebox_job')
    with op.batch_alter_table('duebox_job', schema=None) as batch_op:
        batch_op.drop_column('published_to')
