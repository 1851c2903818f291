"""replica_intents: calls admitted but not yet stored, the replicas that admit them, and
the finish sequence of an episode

Revision ID: 0014_replica_intents
Revises: 0013
Create Date: 2027-03-20 00:00:00.000000

``call_intents``: one row per call a replica admitted, written off the request path
before the call is answered and deleted once its call row is stored; ``replicas``: each
replica's lease (heartbeat, and the time up to which every call it admitted has its
intent stored). ``episodes.finish_seq`` counts the finishes that changed the result
(docs/export.md). New small tables and one nullable column: no rewrite on either database.
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_replica_intents"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "call_intents",
        sa.Column("call_id", sa.String(length=36), nullable=False),
        sa.Column("episode_id", sa.String(length=128), nullable=True),
        sa.Column("replica", sa.String(length=64), nullable=False),
        sa.Column("incarnation", sa.String(length=32), nullable=False),
        sa.Column("admitted_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("call_id", name=op.f("pk_call_intents")),
    )
    op.create_index(op.f("ix_call_intents_episode_id"), "call_intents", ["episode_id"])
    op.create_index(op.f("ix_call_intents_replica"), "call_intents", ["replica"])
    op.create_table(
        "replicas",
        sa.Column("replica", sa.String(length=64), nullable=False),
        sa.Column("incarnation", sa.String(length=32), nullable=False),
        sa.Column("journal", sa.String(length=512), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("heartbeat_at", sa.Float(), nullable=False),
        sa.Column("settled_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("replica", name=op.f("pk_replicas")),
    )
    op.add_column("episodes", sa.Column("finish_seq", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("finish_seq")
    op.drop_table("replicas")
    op.drop_index(op.f("ix_call_intents_replica"), table_name="call_intents")
    op.drop_index(op.f("ix_call_intents_episode_id"), table_name="call_intents")
    op.drop_table("call_intents")
