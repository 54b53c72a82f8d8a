"""teacher top-k

On-policy distillation by forward KL to the teacher's top-k tokens: each teacher score may
keep the teacher's k likeliest tokens and their logprobs at every sampled position.

Revision ID: 8c2d4e6f1a3b
Revises: 5e0d7a1c9b3f
Create Date: 2026-12-05 03:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = "8c2d4e6f1a3b"
down_revision = "5e0d7a1c9b3f"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("teacher_scores", sa.Column("top_k", sa.Integer(), server_default="0", nullable=False))
    op.add_column("teacher_scores", sa.Column("top_ids", sa.LargeBinary(), nullable=True))
    op.add_column("teacher_scores", sa.Column("top_logprobs", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("teacher_scores") as batch:
        batch.drop_column("top_logprobs")
        batch.drop_column("top_ids")
        batch.drop_column("top_k")
