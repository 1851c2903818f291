"""controls shared by every proxy process on one database: pause, policy version

Revision ID: 0005
Revises: 0004
Create Date: 2027-01-10 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A new, small table: no rewrite of existing ones on either database.
    op.create_table(
        "controls",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("value", sa.Text(), nullable=True),
        sa.Column("serial", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_controls")),
    )


def downgrade() -> None:
    op.drop_table("controls")
