"""the ingest lease of a validating job (who ingests, until when), so the rescuer can fail a dead submit

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A job still `validating` when this migration runs has no lease: its submit was killed under an earlier
# version (services are stopped to migrate), so its lease ends now and the first rescue fails it.
PRE_LEASE_OWNER = "a submit from before migration 0003"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("ingest_owner", sa.String(256), nullable=True))
        batch.add_column(sa.Column("ingest_lease_expires_at", sa.DateTime(timezone=True), nullable=True))
    jobs = sa.table("jobs", sa.column("status", sa.String), sa.column("ingest_owner", sa.String),
                    sa.column("ingest_lease_expires_at", sa.DateTime(timezone=True)))
    op.execute(jobs.update().where(jobs.c.status == "validating")
               .values(ingest_owner=PRE_LEASE_OWNER, ingest_lease_expires_at=sa.func.current_timestamp()))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("ingest_lease_expires_at")
        batch.drop_column("ingest_owner")
