"""overlay_patches: runtime overlay patches (their source), installed through the admin API

Revision ID: 0013
Revises: 0012
Create Date: 2027-03-10 00:00:00.000000

A patch is Python source that an episode can name as its overlay; every proxy process on
the database runs the same one for it (docs/overlays.md). A new, small table: no rewrite
of an existing one on either database.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "overlay_patches",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("hooks", sa.Text(), nullable=False),
        sa.Column("after_model_sees", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_overlay_patches")),
    )


def downgrade() -> None:
    op.drop_table("overlay_patches")
