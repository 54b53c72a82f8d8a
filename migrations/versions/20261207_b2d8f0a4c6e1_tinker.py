"""the Tinker service: sessions, models, sampling sessions and futures

`tinker_sessions` (one per SDK client, with its API key's name and last heartbeat),
`tinker_models` (a Tinker training model = the `runs` row of kind `tinker` it trains under),
`tinker_sampling_sessions` (base model or a sampler checkpoint of one of the key's models) and
`tinker_futures` (one row per op the SDK polls for, unique on the SDK's request id, status moved by
compare-and-set, a lease while running).  `runs.kind` gains the value `tinker` (a string column:
no schema change).

Revision ID: b2d8f0a4c6e1
Revises: 7a3c9e2b5d14
Create Date: 2026-12-07 20:30:00
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB


revision = "b2d8f0a4c6e1"
down_revision = "7a3c9e2b5d14"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def _time(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tinker_sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key_name", sa.String(64), nullable=False),
        sa.Column("sdk_version", sa.String(32), nullable=False),
        sa.Column("tags", JSON, nullable=False),
        sa.Column("user_metadata", JSON, nullable=False),
        _time("created_at"),
        _time("heartbeat_at"),
    )
    op.create_index("ix_tinker_sessions_key_name", "tinker_sessions", ["key_name"])
    op.create_table(
        "tinker_models",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False, unique=True),
        sa.Column("session_id", sa.String(64), sa.ForeignKey("tinker_sessions.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=False),
        sa.Column("key_name", sa.String(64), nullable=False),
        sa.Column("base_model", sa.String(255), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=False),
        _time("created_at"),
        sa.UniqueConstraint("session_id", "seq_id", name="uq_tinker_model_seq"),
    )
    op.create_index("ix_tinker_models_session_id", "tinker_models", ["session_id"])
    op.create_index("ix_tinker_models_key_name", "tinker_models", ["key_name"])
    op.create_table(
        "tinker_sampling_sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("session_id", sa.String(64), sa.ForeignKey("tinker_sessions.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=False),
        sa.Column("key_name", sa.String(64), nullable=False),
        sa.Column("base_model", sa.String(255), nullable=False),
        sa.Column("model_id", sa.String(64), sa.ForeignKey("tinker_models.id", ondelete="CASCADE"), nullable=True),
        sa.Column("model_path", sa.String(1024), nullable=True),
        sa.Column("clients", sa.Integer(), nullable=False),
        _time("created_at"),
        sa.UniqueConstraint("session_id", "seq_id", name="uq_tinker_sampling_seq"),
    )
    op.create_index("ix_tinker_sampling_sessions_session_id", "tinker_sampling_sessions", ["session_id"])
    op.create_index("ix_tinker_sampling_sessions_key_name", "tinker_sampling_sessions", ["key_name"])
    op.create_table(
        "tinker_futures",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("request_id", sa.String(128), nullable=False, unique=True),
        sa.Column("key_name", sa.String(64), nullable=False),
        sa.Column("model_id", sa.String(64), sa.ForeignKey("tinker_models.id", ondelete="CASCADE"), nullable=True),
        sa.Column("sampling_session_id", sa.String(64),
                  sa.ForeignKey("tinker_sampling_sessions.id", ondelete="CASCADE"), nullable=True),
        sa.Column("op", sa.String(32), nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("payload", JSON, nullable=False),
        sa.Column("result", JSON, nullable=True),
        sa.Column("error", JSON, nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        _time("lease_expires_at", nullable=True),
        _time("created_at"),
        _time("started_at", nullable=True),
        _time("finished_at", nullable=True),
    )
    op.create_index("ix_tinker_futures_key_name", "tinker_futures", ["key_name"])
    op.create_index("ix_tinker_futures_model_id", "tinker_futures", ["model_id"])
    op.create_index("ix_tinker_futures_sampling_session_id", "tinker_futures", ["sampling_session_id"])
    op.create_index("ix_tinker_futures_status", "tinker_futures", ["status"])


def downgrade() -> None:
    op.drop_table("tinker_futures")
    op.drop_table("tinker_sampling_sessions")
    op.drop_table("tinker_models")
    op.drop_table("tinker_sessions")
