"""run name, tags and notes

`runs.name`, `runs.tags` (a JSON list of lowercase tags, sorted) and `runs.notes`: what a person
calls a run, set at submit or later (`PATCH /api/runs/<id>`, `turnstile label`).  Runs created
before have none (NULL), which reads as no name, no tags, no notes.

Revision ID: e5a8c3b1d902
Revises: 9d3f1a6b2c47
Create Date: 2026-12-07 15:20:00
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB


revision = "e5a8c3b1d902"
down_revision = "9d3f1a6b2c47"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("runs", sa.Column("name", sa.String(200), nullable=True))
    op.add_column("runs", sa.Column("tags", JSON, nullable=True))
    op.add_column("runs", sa.Column("notes", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("notes")
        batch.drop_column("tags")
        batch.drop_column("name")
