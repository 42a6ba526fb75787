"""result cache: content-addressed result bodies shared across jobs, a job's result_cache mode, provenance

`result_bodies` holds one body per key (a hash of everything that decides a deterministic request's
output); a request row keeps the key of its body and its provenance JSON (issue 31).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "result_bodies",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("computed_in", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_result_bodies"),
    )
    op.create_index("ix_result_bodies_last_used_at", "result_bodies", ["last_used_at"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("result_cache", sa.String(8), nullable=False, server_default="use"))
        batch.add_column(sa.Column("result_cache_hits", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("result_cache_dedups", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("provenance", sa.Text(), nullable=True))
        batch.add_column(sa.Column("result_key", sa.String(64), nullable=True))
    with op.batch_alter_table("schedules") as batch:
        batch.add_column(sa.Column("result_cache", sa.String(8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("schedules") as batch:
        batch.drop_column("result_cache")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("result_key")
        batch.drop_column("provenance")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("result_cache_dedups")
        batch.drop_column("result_cache_hits")
        batch.drop_column("result_cache")
    op.drop_index("ix_result_bodies_last_used_at", table_name="result_bodies")
    op.drop_table("result_bodies")
