"""run provenance

`runs.provenance`: where each setting of the run's config came from, `{dotted path: source}` with
source one of "file", "--set", "api", "warm start", "default" (`app.provenance`).  Runs created
before have none (NULL): their page says the sources were not recorded.

Revision ID: 9d3f1a6b2c47
Revises: 4b9e2c7d1f60
Create Date: 2026-12-07 15:10:00
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB


revision = "9d3f1a6b2c47"
down_revision = "4b9e2c7d1f60"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("runs", sa.Column("provenance", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("provenance")
