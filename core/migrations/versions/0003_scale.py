"""operating at scale: job shard slots, the fair-claim index, shared rate buckets

Revision ID: 0003
Revises: 0002
duebox 0.3.0: duebox_job gains ``shard`` (the id's slot of 1024, see
duebox.tables.shard_of) and the (state, queue, tenant, priority, due_at) index behind
the fair claim; duebox_rate_bucket holds the token buckets relays share.

Existing rows are backfilled in Python in bounded pages (the slot is a hash
of the UUID, computed the same way on every dialect), through a temporary
server default that is dropped again so the table matches duebox.tables.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = '0003'
down_revision: Union[str, Sequence[str], None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

_PAGE = 1000
_SLOTS = 1024  # duebox.tables.SHARD_SLOTS, frozen here as migrations must be


def _backfill() -> None:
    conn = op.get_bind()
    job = sa.table('duebox_job', sa.column('id', sa.Uuid()), sa.column('shard', sa.SmallInteger()))
    last = None
    while True:
        page = sa.select(job.c.id).order_by(job.c.id).limit(_PAGE)
        if last is not None:
            page = page.where(job.c.id > last)
        ids = list(conn.execute(page).scalars())
        if not ids:
            return
        conn.execute(
            sa.update(job).where(job.c.id == sa.bindparam('b_id'))
            .values(shard=sa.bindparam('b_shard')),
            [{'b_id': i, 'b_shard': i.int % _SLOTS} for i in ids],
        )
        last = ids[-1]


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('duebox_job', schema=None) as batch_op:
        batch_op.add_column(sa.Column('shard', sa.SmallInteger(), nullable=False,
                                      server_default=sa.text('0')))
    _backfill()
    with op.batch_alter_table('duebox_job', schema=None) as batch_op:
        batch_op.alter_column('shard', existing_type=sa.SmallInteger(), existing_nullable=False,
                              server_default=None)
        batch_op.create_index('ix_duebox_job_class_due', ['state', 'queue', 'tenant', 'priority', 'due_at'],
                              unique=False)
    op.create_table(
        'duebox_rate_bucket',
        sa.Column('name', sa.String(length=200), nullable=False),
        sa.Column('tokens', sa.Float(), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_duebox_rate_bucket')),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table('duebox_rate_bucket')
    with op.batch_alter_table('duebox_job', schema=None) as batch_op:
        batch_op.drop_index('ix_duebox_job_class_due')
        batch_op.drop_column('shard')
