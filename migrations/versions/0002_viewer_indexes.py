"""indexes for the trace viewer's episodes page (filters, sorts, failed calls)

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-05 09:00:00.000000

On Postgres the indexes are built CONCURRENTLY (outside the migration's transaction), so
proxies still writing to a large database are not blocked while they build.
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

FAILED_SQL = "http_status <> 200 OR status NOT IN ('ok', 'passthrough')"  # storage.tables
_EPISODE_COLUMNS = ("created_at", "harness_name", "outcome", "reward", "task_id")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():
            for column in _EPISODE_COLUMNS:
                op.create_index(f"ix_episodes_{column}", "episodes", [column],
                                postgresql_concurrently=True, if_not_exists=True)
            op.create_index("ix_calls_failed", "calls", ["episode_id"],
                            postgresql_where=sa.text(FAILED_SQL),
                            postgresql_concurrently=True, if_not_exists=True)
        return
    for column in _EPISODE_COLUMNS:
        op.create_index(f"ix_episodes_{column}", "episodes", [column])
    op.create_index("ix_calls_failed", "calls", ["episode_id"],
                    sqlite_where=sa.text(FAILED_SQL))


def downgrade() -> None:
    op.drop_index("ix_calls_failed", table_name="calls")
    for column in _EPISODE_COLUMNS:
        op.drop_index(f"ix_episodes_{column}", table_name="episodes")
