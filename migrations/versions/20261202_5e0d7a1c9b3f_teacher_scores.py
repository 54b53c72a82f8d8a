"""teacher scores

On-policy distillation: a teacher's prefill logprobs of each chain's sampled tokens, cached by
(chain hash, teacher version) so an old episode can be scored again from SQL.

Revision ID: 5e0d7a1c9b3f
Revises: b07642d18c15
Create Date: 2026-12-02 01:10:00
"""
from alembic import op
import sqlalchemy as sa


revision = "5e0d7a1c9b3f"
down_revision = "b07642d18c15"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "teacher_scores",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("chain_hash", sa.String(length=64), nullable=False),
        sa.Column("teacher_version", sa.String(length=128), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("chain_hash", "teacher_version", name="uq_teacher_score"),
    )


def downgrade() -> None:
    op.drop_table("teacher_scores")
