"""annotations: people's labels, comments and corrected rewards on episodes, calls and
token spans; an index of episodes by parent

Revision ID: 0015_annotations
Revises: 0014_replica_intents
Create Date: 2027-04-02 00:00:00.000000

``annotations``: one row per label, comment or corrected reward a person made in the
viewer or through the admin API, with who and when (storage.annotations). A corrected
reward lives here, beside the episode's own ``reward``, which it never changes.
``ix_episodes_parent_id``: an episode's page lists the sub-agent episodes registered
with it as their parent. A new table and an index: no rewrite on either database.
"""

import sqlalchemy as sa
from alembic import op

revision = "0015_annotations"
down_revision = "0014_replica_intents"  # main's head (its id is the long one)
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "annotations",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), sa.Identity(),
                  nullable=False),
        sa.Column("episode_id", sa.String(length=128), nullable=False),
        sa.Column("call_id", sa.String(length=36), nullable=True),
        sa.Column("choice_index", sa.Integer(), nullable=True),
        sa.Column("token_start", sa.Integer(), nullable=True),
        sa.Column("token_end", sa.Integer(), nullable=True),
        sa.Column("label", sa.String(length=64), nullable=True),
        sa.Column("comment", sa.Text(), nullable=True),
        sa.Column("corrected_reward", sa.Float(), nullable=True),
        sa.Column("author", sa.String(length=128), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_annotations")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_annotations_episode_id"), "annotations", ["episode_id"])
    op.create_index(op.f("ix_annotations_call_id"), "annotations", ["call_id"])
    op.create_index(op.f("ix_episodes_parent_id"), "episodes", ["parent_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_episodes_parent_id"), table_name="episodes")
    op.drop_index(op.f("ix_annotations_call_id"), table_name="annotations")
    op.drop_index(op.f("ix_annotations_episode_id"), table_name="annotations")
    op.drop_table("annotations")
