"""what translation to chat left out of a call's request, by field

Revision ID: 0006
Revises: 0005
Create Date: 2027-01-20 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, added in place (no table rebuild on SQLite): earlier calls dropped nothing
    # that was recorded.
    op.add_column("calls", sa.Column("translation_dropped", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_column("translation_dropped")
