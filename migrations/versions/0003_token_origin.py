"""where prompt ids came from, why ids are missing; the request as the engine got it

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, added in place: SQLite needs no table rebuild. Rows stored before this
    # revision had engine ids or none, which is what the backfill says.
    op.add_column("calls", sa.Column("prompt_source", sa.String(length=16), nullable=True))
    op.add_column("calls", sa.Column("upstream_request", sa.Text(), nullable=True))
    op.add_column("calls", sa.Column("ids_missing", sa.String(length=32), nullable=True))
    op.execute("UPDATE calls SET prompt_source = CASE WHEN prompt_ids IS NULL "
               "THEN 'none' ELSE 'engine' END")
    # "verified_retokenized" needs 20 characters. On SQLite this copies the choices table
    # once (it cannot alter a column in place).
    with op.batch_alter_table("choices", schema=None) as batch_op:
        batch_op.alter_column("token_source", existing_type=sa.String(length=16),
                              type_=sa.String(length=32), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("choices", schema=None) as batch_op:
        batch_op.alter_column("token_source", existing_type=sa.String(length=32),
                              type_=sa.String(length=16), existing_nullable=False)
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_column("ids_missing")
        batch_op.drop_column("upstream_request")
        batch_op.drop_column("prompt_source")
