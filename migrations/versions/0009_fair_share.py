"""fair share and budgets: a weight per API key, tokens served per owner and minute, a job's token budget

The claim orders owners by the tokens served to them over a sliding window divided by their weight
(issue 32); `owner_served` keeps those tokens as one row per owner and minute, so the sum over the
window reads a few rows per owner. `jobs.max_total_tokens` is a job's budget (NULL: none).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "owner_served",
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("owner", "minute", name="pk_owner_served"),
    )
    op.create_index("ix_owner_served_minute", "owner_served", ["minute"])
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("weight", sa.Float(), nullable=False, server_default="1"))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("max_total_tokens", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("max_total_tokens")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("weight")
    op.drop_index("ix_owner_served_minute", table_name="owner_served")
    op.drop_table("owner_served")
