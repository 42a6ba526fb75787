"""bigint ids: every primary key and foreign key 64-bit on PostgreSQL (SQLite's INTEGER already is)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column) pairs; serial primary keys also own a sequence that must widen with them.
PRIMARY_KEYS = [("files", "id"), ("jobs", "id"), ("shards", "id"), ("api_keys", "id"), ("schedules", "id"),
                ("schedule_runs", "id"), ("webhook_deliveries", "id")]
FOREIGN_KEYS = [("jobs", "input_file_id"), ("requests", "job_id"), ("shards", "job_id"),
                ("schedule_runs", "schedule_id"), ("schedule_runs", "job_id"), ("webhook_deliveries", "run_id")]


def _alter(type_: type[sa.types.TypeEngine], sequence_type: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column in PRIMARY_KEYS + FOREIGN_KEYS:
        op.alter_column(table, column, type_=type_())
    for table, column in PRIMARY_KEYS:
        op.execute(f"ALTER SEQUENCE IF EXISTS {table}_{column}_seq AS {sequence_type}")


def upgrade() -> None:
    _alter(sa.BigInteger, "bigint")


def downgrade() -> None:
    _alter(sa.Integer, "integer")
