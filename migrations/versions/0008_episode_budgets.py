"""episode budgets shared by every proxy process on one database (reserve, then settle);
episodes.registered_at, by which processes follow new registrations

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-20 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A new, small table: no rewrite of existing ones on either database.
    op.create_table(
        "episode_budgets",
        sa.Column("episode_id", sa.String(length=128), nullable=False),
        sa.Column("max_calls", sa.Integer(), nullable=True),
        sa.Column("max_tokens", sa.BigInteger(), nullable=True),
        sa.Column("max_seconds", sa.Float(), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("calls", sa.Integer(), nullable=False),
        sa.Column("tokens_used", sa.BigInteger(), nullable=False),
        sa.Column("tokens_reserved", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("episode_id", name=op.f("pk_episode_budgets")),
    )
    # A nullable column and its index: no table rewrite on either database.
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("registered_at", sa.Float(), nullable=True))
        batch.create_index(batch.f("ix_episodes_registered_at"), ["registered_at"])


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_index(batch.f("ix_episodes_registered_at"))
        batch.drop_column("registered_at")
    op.drop_table("episode_budgets")
