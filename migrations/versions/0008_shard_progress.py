"""shard progress: what a worker's in-flight requests of a shard have generated so far, and their budget

Reported with each shard heartbeat, so a job's tokens/s and ETA count tokens generated so far, not only
finished requests (issue 29 item 5).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (("inflight_requests", sa.Integer()), ("inflight_tokens", sa.BigInteger()),
           ("inflight_budget", sa.BigInteger()), ("inflight_finish_at", sa.Float()))


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
