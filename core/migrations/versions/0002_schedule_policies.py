"""recurring schedules: DST policies, occurrence defaults, last fire

Revision ID: 0002
Revises: 0001
duebox 0.2.0: duebox_schedule gains gap_policy, fold_policy, priority,
max_attempts, expire_after_seconds and last_fire_at.

Existing rows get the documented defaults (gap 'shift', fold 'first',
priority 0, max_attempts 3) through a temporary server default, which is
dropped again so the table matches duebox.tables exactly.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = '0002'
down_revision: Union[str, Sequence[str], None] = '0001'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

_DEFAULTED = (
    ('gap_policy', sa.String(length=8), 'shift'),
    ('fold_policy', sa.String(length=8), 'first'),
    ('priority', sa.Integer(), '0'),
    ('max_attempts', sa.Integer(), '3'),
)


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('duebox_schedule', schema=None) as batch_op:
        for name, type_, default in _DEFAULTED:
            batch_op.add_column(sa.Column(name, type_, nullable=False,
                                          server_default=sa.text(f"'{default}'")))
        batch_op.add_column(sa.Column('expire_after_seconds', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('last_fire_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('duebox_schedule', schema=None) as batch_op:
        for name, type_, _ in _DEFAULTED:
            batch_op.alter_column(name, existing_type=type_, existing_nullable=False,
                                  server_default=None)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('duebox_schedule', schema=None) as batch_op:
        batch_op.drop_column('last_fire_at')
        batch_op.drop_column('expire_after_seconds')
        for name, _, _ in reversed(_DEFAULTED):
            batch_op.drop_column(name)
