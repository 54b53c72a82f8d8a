"""stage leases and completion attempts

Episodes get a stage lease (`lease_owner`, `lease_expires_at`) and a count of re-dispatches
(`redeliveries`) for the watchdog's reaper; completions get the rollout `attempt` that made
them, and `(episode_id, request_key)` is no longer unique (a harness may repeat an identical
call on purpose; only true retries share a row).

Downgrading keeps one row per (episode_id, request_key), the newest, so the old unique
constraint can be put back: repeated calls and earlier attempts' rows are deleted.

Revision ID: b07642d18c15
Revises: 73ef0fb2bf05
Create Date: 2026-11-30 20:31:08.060640
"""
from alembic import op
import sqlalchemy as sa


revision = 'b07642d18c15'
down_revision = '73ef0fb2bf05'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('completions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('attempt', sa.Integer(), server_default='1', nullable=False))
        batch_op.drop_constraint('uq_completion_request_key', type_='unique')
        batch_op.create_index('ix_completion_request_key', ['episode_id', 'attempt', 'request_key'], unique=False)

    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('lease_owner', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('redeliveries', sa.Integer(), server_default='0', nullable=False))
        batch_op.create_index('ix_episodes_status_lease', ['status', 'lease_expires_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.drop_index('ix_episodes_status_lease')
        batch_op.drop_column('redeliveries')
        batch_op.drop_column('lease_expires_at')
        batch_op.drop_column('lease_owner')

    op.execute("DELETE FROM completions WHERE id NOT IN "
               "(SELECT keep FROM (SELECT MAX(id) AS keep FROM completions GROUP BY episode_id, request_key) AS k)")
    with op.batch_alter_table('completions', schema=None) as batch_op:
        batch_op.drop_index('ix_completion_request_key')
        batch_op.create_unique_constraint('uq_completion_request_key', ['episode_id', 'request_key'])
        batch_op.drop_column('attempt')
