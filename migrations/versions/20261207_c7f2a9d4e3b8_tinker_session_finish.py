"""Tinker sessions record how their client finished them

`tinker_sessions.finished_at`, `finish_reason` ("success" | "errored" | "interrupted") and
`finish_detail`: set once by `POST /api/v1/sessions/<id>/finish`, which the tinker SDK sends when a
ServiceClient closes.  A finished session no longer counts against its key's `max_sessions`, and
its models' runs end as soon as none of their ops is in flight.  Sessions created before have none
(NULL): they end by heartbeat silence as before.

Revision ID: c7f2a9d4e3b8
Revises: b2d8f0a4c6e1
Create Date: 2026-12-07 23:50:00
"""
from alembic import op
import sqlalchemy as sa


revision = "c7f2a9d4e3b8"
down_revision = "b2d8f0a4c6e1"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tinker_sessions", sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("tinker_sessions", sa.Column("finish_reason", sa.String(16), nullable=True))
    op.add_column("tinker_sessions", sa.Column("finish_detail", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tinker_sessions") as batch:
        batch.drop_column("finish_detail")
        batch.drop_column("finish_reason")
        batch.drop_column("finished_at")
