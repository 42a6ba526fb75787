"""initial schema: files, jobs, shards, requests, workers, api_keys

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite: INTEGER PRIMARY KEY = rowid


def ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("name", sa.String(128), nullable=True),
        sa.Column("key_hash", sa.String(128), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        ts("created_at", nullable=False),
        ts("last_used_at"),
        ts("revoked_at"),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_table(
        "files",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        ts("created_at", nullable=False),
        ts("expires_at"),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
    )
    op.create_index("ix_files_owner_id", "files", ["owner", "id"])
    op.create_table(
        "workers",
        sa.Column("id", sa.String(256), nullable=False),
        sa.Column("hostname", sa.String(256), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("info", sa.JSON(), nullable=True),
        ts("started_at", nullable=False),
        ts("last_heartbeat_at", nullable=False),
        ts("stopped_at"),
        sa.PrimaryKeyConstraint("id", name="pk_workers"),
    )
    op.create_index("ix_workers_last_heartbeat_at", "workers", ["last_heartbeat_at"])
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("input_file_id", sa.Integer(), nullable=True),
        sa.Column("input_path", sa.Text(), nullable=True),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("shard_size", sa.Integer(), nullable=False),
        sa.Column("on_invalid", sa.String(8), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("idempotency_key", sa.String(256), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("num_errors", sa.Integer(), nullable=False),
        sa.Column("num_shards", sa.Integer(), nullable=False),
        sa.Column("total_requests", sa.Integer(), nullable=False),
        sa.Column("completed_requests", sa.Integer(), nullable=False),
        sa.Column("failed_requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        ts("created_at", nullable=False),
        ts("expires_at"),
        ts("in_progress_at"),
        ts("finalizing_at"),
        ts("completed_at"),
        ts("failed_at"),
        ts("expired_at"),
        ts("cancelling_at"),
        ts("cancelled_at"),
        sa.ForeignKeyConstraint(["input_file_id"], ["files.id"], name="fk_jobs_input_file_id_files",
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
        sa.UniqueConstraint("owner", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
    )
    op.create_index("ix_jobs_owner_id", "jobs", ["owner", "id"])
    op.create_index("ix_jobs_status_expires_at", "jobs", ["status", "expires_at"])
    op.create_table(
        "requests",
        sa.Column("id", BigId, nullable=False, autoincrement=False),  # job_id << 32 | line_number
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("line_number", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=True),
        sa.Column("status", sa.String(10), nullable=False),
        sa.Column("endpoint", sa.String(16), nullable=True),
        sa.Column("payload", sa.Text(), nullable=True),
        sa.Column("response", sa.Text(), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        ts("finished_at"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_requests_job_id_jobs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_requests"),
        sa.UniqueConstraint("job_id", "custom_id", name="uq_requests_job_id_custom_id"),
    )
    op.create_table(
        "shards",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("num_requests", sa.Integer(), nullable=False),
        sa.Column("request_lines", sa.LargeBinary(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(256), nullable=True),
        sa.Column("lease_token", sa.String(64), nullable=True),
        ts("lease_expires_at"),
        sa.Column("last_error", sa.Text(), nullable=True),
        ts("created_at", nullable=False),
        ts("started_at"),
        ts("completed_at"),
        ts("failed_at"),
        ts("cancelled_at"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_shards_job_id_jobs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_shards"),
        sa.UniqueConstraint("job_id", "ordinal", name="uq_shards_job_id_ordinal"),
    )
    op.create_index("ix_shards_job_id_status", "shards", ["job_id", "status"])
    op.create_index("ix_shards_status_lease_expires_at", "shards", ["status", "lease_expires_at"])
    op.create_index("ix_shards_status_model_priority_id", "shards", ["status", "model", "priority", "id"])


def downgrade() -> None:
    op.drop_table("shards")
    op.drop_table("requests")
    op.drop_table("jobs")
    op.drop_table("workers")
    op.drop_table("files")
    op.drop_table("api_keys")
