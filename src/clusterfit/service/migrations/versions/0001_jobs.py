"""jobs, their history and API tokens

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, index=True),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("ranks", sa.Integer, nullable=False),
        sa.Column("outputs_dir", sa.Text, nullable=False),
        sa.Column("spec_yaml", sa.Text, nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("max_retries", sa.Integer, nullable=False),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=False, index=True),
        sa.Column("started_at", sa.DateTime(timezone=True)),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("engine_ref", sa.Text),
        sa.Column("supervisor", sa.Text),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True)),
        sa.Column("cause", sa.String(32)),
        sa.Column("cause_detail", sa.Text),
        sa.Column("step", sa.Integer),
        sa.Column("total_steps", sa.Integer),
        sa.Column("epoch", sa.Integer),
        sa.Column("images_per_s", sa.Float),
        sa.Column("loss", sa.Float),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True)),
    )
    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(16), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True)),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
    )


def downgrade() -> None:
    op.drop_table("api_tokens")
    op.drop_table("job_events")
    op.drop_table("jobs")
