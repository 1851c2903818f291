"""each token stored once: content-addressed blocks, calls reference them

Revision ID: 0007
Revises: 0006
Create Date: 2027-02-01 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A new table and nullable columns added in place: no table rebuild on SQLite, no
    # rewrite on Postgres. Rows stored before keep their inline prompt_ids and bodies and
    # are read as they are (storage.inflate); only calls written from now on reference
    # blocks, so nothing existing is converted and nothing can be lost.
    op.create_table(
        "blocks",
        sa.Column("hash", sa.LargeBinary(length=16), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("hash", name=op.f("pk_blocks")),
    )
    for column in ("prompt_refs", "request_refs", "upstream_request_refs", "response_refs"):
        op.add_column("calls", sa.Column(column, sa.LargeBinary(), nullable=True))
    for column in ("text_refs", "completion_ids_refs", "completion_logprobs_refs"):
        op.add_column("choices", sa.Column(column, sa.LargeBinary(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        # Blocks are compressed already: kept in the table's own pages up to a page, not
        # cut into TOAST chunks (whose part-filled pages cost ~18% more on the agentic
        # replay, bench/storage_bytes.py); pglz gives up on them after their first KiB.
        op.execute("ALTER TABLE blocks ALTER COLUMN data SET STORAGE MAIN")


def downgrade() -> None:
    # Calls written since the upgrade hold only references: a downgrade would lose them.
    raise RuntimeError("revision 0007 cannot be downgraded: calls stored since reference "
                       "blocks that revision 0005 has no table for")
