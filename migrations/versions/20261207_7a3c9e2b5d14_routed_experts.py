"""routed experts of MoE completions and trajectories

`completions.routed_experts`: the MoE engine's chosen expert ids of the completion's prompt and
every sampled token but the last, `app.engines.route_bytes.to_bytes` bytes (little-endian
int16, row-major `[P + S - 1, layers, top_k]`, `2 * layers * top_k` bytes per token);
`completions.route_shape` the `[layers, top_k]` that decodes them.
`trajectories.routed_experts`: the chain's routes `[T, layers, top_k]` in the same encoding
(the shape is in `trajectories.meta["route_shape"]`).  NULL for dense models and for rows
written before.

Revision ID: 7a3c9e2b5d14
Revises: e5a8c3b1d902
Create Date: 2026-12-07 20:10:00
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB


revision = "7a3c9e2b5d14"
down_revision = "e5a8c3b1d902"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("completions", sa.Column("routed_experts", sa.LargeBinary(), nullable=True))
    op.add_column("completions", sa.Column("route_shape", JSON, nullable=True))
    op.add_column("trajectories", sa.Column("routed_experts", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trajectories") as batch:
        batch.drop_column("routed_experts")
    with op.batch_alter_table("completions") as batch:
        batch.drop_column("route_shape")
        batch.drop_column("routed_experts")
