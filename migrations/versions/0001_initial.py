"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30 02:38:53.211710
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "calls",
        sa.Column("call_id", sa.String(length=36), nullable=False),
        sa.Column("episode_id", sa.String(length=128), nullable=True),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("instance", sa.String(length=64), nullable=False),
        sa.Column("endpoint", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=True),
        sa.Column("policy_version", sa.String(length=128), nullable=True),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("upstream", sa.String(length=512), nullable=True),
        sa.Column("request", sa.Text(), nullable=True),
        sa.Column("response", sa.Text(), nullable=True),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("t_start", sa.Float(), nullable=False),
        sa.Column("t_first_byte", sa.Float(), nullable=True),
        sa.Column("t_end", sa.Float(), nullable=True),
        sa.Column("upstream_latency", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("prompt_ids", sa.LargeBinary(), nullable=True),
        sa.Column("stored_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("call_id", name=op.f("pk_calls")),
    )
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_calls_episode_id_t_start"), ["episode_id", "t_start"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_calls_stored_at"), ["stored_at"], unique=False)

    op.create_table(
        "choices",
        sa.Column("call_id", sa.String(length=36), nullable=False),
        sa.Column("choice_index", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("completion_ids", sa.LargeBinary(), nullable=True),
        sa.Column("completion_logprobs", sa.LargeBinary(), nullable=True),
        sa.Column("top_logprobs", sa.Text(), nullable=True),
        sa.Column("token_source", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("call_id", "choice_index", name=op.f("pk_choices")),
    )
    op.create_table(
        "episodes",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("group_id", sa.String(length=128), nullable=True),
        sa.Column("task_id", sa.String(length=256), nullable=True),
        sa.Column("harness_name", sa.String(length=256), nullable=True),
        sa.Column("harness_config", sa.Text(), nullable=True),
        sa.Column("metadata", sa.Text(), nullable=True),
        sa.Column("api_key_hash", sa.String(length=64), nullable=True),
        sa.Column("registered", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("rewards", sa.Text(), nullable=True),
        sa.Column("outcome", sa.String(length=256), nullable=True),
        sa.Column("info", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_episodes")),
        sa.UniqueConstraint("api_key_hash", name=op.f("uq_episodes_api_key_hash")),
    )
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_episodes_finished_at"), ["finished_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_episodes_group_id"), ["group_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_episodes_group_id"))
        batch_op.drop_index(batch_op.f("ix_episodes_finished_at"))

    op.drop_table("episodes")
    op.drop_table("choices")
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_calls_stored_at"))
        batch_op.drop_index(batch_op.f("ix_calls_episode_id_t_start"))

    op.drop_table("calls")
