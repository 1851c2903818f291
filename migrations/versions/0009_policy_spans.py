"""policy-version spans of each choice's tokens (a weight sync during a call), and the
MoE experts each completion token was routed to

Revision ID: 0009
Revises: 0008
Create Date: 2027-02-10 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column: no table rewrite on either database. Existing rows keep null,
    # which reads as one span of their call's stamped policy_version
    # (storage.policy_spans.spans_of), which is what they were.
    with op.batch_alter_table("choices") as batch:
        batch.add_column(sa.Column("policy_spans", sa.Text(), nullable=True))
        # The MoE routing of each completion token, as a block reference (--routed-experts).
        batch.add_column(sa.Column("routed_experts_refs", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("choices") as batch:
        batch.drop_column("routed_experts_refs")
        batch.drop_column("policy_spans")
