"""lineages: calls.lineage, calls.parent_lineage (the harness's names, from headers) and
calls.conversation (the hashes of a request's start); episodes.parent_id (registration
field ``parent``). Nullable columns only: existing rows keep their data and read as one
lineage per episode, as they exported before. The integrity verdict needs no column: it
is computed from the calls (storage.integrity).

Revision ID: 0010
Revises: 0008
Create Date: 2027-02-01 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable columns without defaults: no table rewrite on either database.
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("lineage", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("parent_lineage", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("conversation", sa.String(length=40), nullable=True))
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("parent_id", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("parent_id")
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("conversation")
        batch.drop_column("parent_lineage")
        batch.drop_column("lineage")
