"""the overlay a call ran under: its events and what the harness received

Revision ID: 0004
Revises: 0003
Create Date: 2027-01-15 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, added in place (no table rebuild on SQLite): earlier calls had no overlay.
    op.add_column("calls", sa.Column("overlay", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_column("overlay")
