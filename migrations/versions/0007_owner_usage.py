"""owner usage: stored bytes as a per-owner counter, request reservations and result file sizes (issue 28)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "owner_usage",
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("stored_bytes", sa.BigInteger(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("owner", name="pk_owner_usage"),
    )
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("lines", sa.BigInteger(), nullable=False, server_default="0"))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("reserved_requests", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("request_bytes", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("output_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("error_bytes", sa.BigInteger(), nullable=True))
    # Existing uploads start the counters (their jobs' rows were never counted before).
    op.execute("INSERT INTO owner_usage (owner, stored_bytes) "
               "SELECT owner, SUM(bytes) FROM files GROUP BY owner")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for column in ("error_bytes", "output_bytes", "request_bytes", "reserved_requests"):
            batch.drop_column(column)
    with op.batch_alter_table("files") as batch:
        batch.drop_column("lines")
    op.drop_table("owner_usage")
