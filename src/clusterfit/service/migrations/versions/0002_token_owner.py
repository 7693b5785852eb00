"""tokens have an owner: the jobs they submit are theirs, and a submit token cancels only those

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as table:
        table.add_column(sa.Column("owner", sa.String(64), nullable=False, server_default=""))
    # Jobs submitted so far carry their token's name as owner: those tokens keep owning them.
    op.execute("UPDATE api_tokens SET owner = name")


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as table:
        table.drop_column("owner")
