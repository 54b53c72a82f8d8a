"""per-token policy versions

In-flight weight updates (weight update mode `keep`): a completion can span several policy
versions.  `policy_versions` holds the run-length encoded version of the weights that sampled
each token, `[[first sampled-token index, version], ...]`; `kv_versions` the same for the
oldest version of the KV cache each token attended to, where it differs (a `keep` update without
KV recompute).  Rows written before have neither: `policy_version` covers all their tokens.

Revision ID: 4b9e2c7d1f60
Revises: 8c2d4e6f1a3b
Create Date: 2026-12-07 08:00:00
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB


revision = "4b9e2c7d1f60"
down_revision = "8c2d4e6f1a3b"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("completions", sa.Column("policy_versions", JSON, nullable=True))
    op.add_column("completions", sa.Column("kv_versions", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.drop_column("kv_versions")
        batch.drop_column("policy_versions")
