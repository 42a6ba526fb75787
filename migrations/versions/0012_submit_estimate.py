"""submit estimate: what a job was expected to cost when it was submitted

`jobs.estimate` keeps the estimate made at submit from ingest's counts (requests, the sum of their caps)
and this deployment's history (issue 32): the batch object's `estimate` and the dashboard's batch page
show it beside the running ETA. NULL for jobs submitted before, or that never started.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("estimate", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("estimate")
