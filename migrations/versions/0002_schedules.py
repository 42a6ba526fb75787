"""schedules, schedule runs and the webhook outbox

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("cron", sa.String(128), nullable=False),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("input_template", sa.Text(), nullable=False),
        sa.Column("output_template", sa.Text(), nullable=True),
        sa.Column("errors_template", sa.Text(), nullable=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("params", sa.JSON(), nullable=True),
        sa.Column("webhook_url", sa.Text(), nullable=True),
        sa.Column("webhook_secret", sa.String(256), nullable=True),
        sa.Column("catchup", sa.String(8), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        ts("created_at", nullable=False),
        ts("last_slot_at"),
        sa.PrimaryKeyConstraint("id", name="pk_schedules"),
        sa.UniqueConstraint("name", name="uq_schedules_name"),
    )
    op.create_table(
        "schedule_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("schedule_id", sa.Integer(), nullable=False),
        ts("slot_at", nullable=False),
        sa.Column("manual", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("input_path", sa.Text(), nullable=True),
        sa.Column("output_path", sa.Text(), nullable=True),
        sa.Column("errors_path", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        ts("created_at", nullable=False),
        ts("finished_at"),
        sa.ForeignKeyConstraint(["schedule_id"], ["schedules.id"], name="fk_schedule_runs_schedule_id_schedules",
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_schedule_runs_job_id_jobs", ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name="pk_schedule_runs"),
        sa.UniqueConstraint("schedule_id", "slot_at", name="uq_schedule_runs_schedule_id_slot_at"),
    )
    op.create_index("ix_schedule_runs_status", "schedule_runs", ["status"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        ts("next_attempt_at", nullable=False),
        ts("last_attempt_at"),
        ts("delivered_at"),
        ts("gave_up_at"),
        sa.Column("last_error", sa.Text(), nullable=True),
        ts("created_at", nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["schedule_runs.id"], name="fk_webhook_deliveries_run_id_schedule_runs",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_deliveries"),
    )
    op.create_index("ix_webhook_deliveries_delivered_at_next_attempt_at", "webhook_deliveries",
                    ["delivered_at", "next_attempt_at"])


def downgrade() -> None:
    op.drop_table("webhook_deliveries")
    op.drop_table("schedule_runs")
    op.drop_table("schedules")
