"""result references: an index on requests.result_key

A cacheable success's request row references its body in `result_bodies` by key instead of copying it
(issue 31); eviction and the retention purge ask whether any row still references a body, and replacing
a body (`refresh`) finds the rows that do, through this index.  A row keeps a key only when its response
is that body (response NULL).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # rows written by 0010's workers kept a copy beside the key: the key now means "the response is that
    # body", so such rows keep their copy and drop the key (they pin nothing).
    op.execute("UPDATE requests SET result_key = NULL WHERE result_key IS NOT NULL AND response IS NOT NULL")
    op.create_index("ix_requests_result_key", "requests", ["result_key"])


def downgrade() -> None:
    op.drop_index("ix_requests_result_key", table_name="requests")
