"""SQLAlchemy 2.x models: File, Job, Shard, Request, Worker, ApiKey, Schedule, ScheduleRun, WebhookDelivery.

Invariants (the store keeps them; tests check them):

- A job's requests are numbered by input line (`line_number`, 1-based) and a custom_id appears at
  most once per job (UNIQUE(job_id, custom_id); NULL for a duplicate line).
- A request's id is `request_id_for(job_id, line_number)` = job_id << 32 | line_number, so the primary
  key is unique per (job, line) and its order is input order: export scans a primary-key range, and
  no (job_id, line_number) index has to be maintained while a million rows stream in.
- A shard is a run of its job's valid requests: `request_lines` lists their line numbers in the order
  a worker should feed them (sorted by a prompt-prefix key at ingest, so requests sharing a prefix sit
  together). Requests carry no shard_id and no prefix index: the plan is computed in memory at
  ingest (12 bytes a line) and written once with the shards, so a million requests stream in with
  only their primary key and UNIQUE(job_id, custom_id) to maintain. A shard's requests are then
  `id IN (request_id_for(job_id, line) ...)`: primary-key lookups. Invalid lines are in no shard.
- Job counters (total/completed/failed requests, token usage) are columns updated in the same
  transaction as the request rows they count, so a status poll is one primary-key read.
- Status columns hold the values of the StrEnums below; every state has its own timestamp.
"""

from __future__ import annotations

import sys
from array import array
from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from batchinfer.store.columns import BigId, UTCDateTime, utcnow
from batchinfer.store.statuses import (  # noqa: F401  (re-exported: importers use store.models)
    JOB_CANCELLABLE_STATUSES,
    JOB_FINISHING_STATUSES,
    JOB_LIVE_STATUSES,
    JOB_TERMINAL_STATUSES,
    REQUEST_NOT_RUN_STATUSES,
    SHARD_OPEN_STATUSES,
    JobStatus,
    RequestStatus,
    ScheduleRunStatus,
    ShardStatus,
)

LINE_BITS = 32


def request_id_for(job_id: int, line_number: int) -> int:
    """The primary key of a job's request: job_id << 32 | line_number (see the module docstring)."""
    return (job_id << LINE_BITS) | line_number


class Base(DeclarativeBase):
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        })


class File(Base):
    """An uploaded input file (purpose "batch"); its bytes live on disk at `path`."""

    __tablename__ = "files"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), default="")
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32), default="batch")
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    lines: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # at most its requests
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (Index(None, "owner", "id"),)

    @property
    def file_id(self) -> str:
        """The OpenAI-style public id."""
        return f"file-{self.id}"


class Job(Base):
    """A batch: one input file run on one model. Counters and usage are kept current incrementally."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), default="")
    model: Mapped[str] = mapped_column(String(256))
    endpoint: Mapped[str | None] = mapped_column(String(32))  # required url of every line, if set
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.VALIDATING)
    input_file_id: Mapped[int | None] = mapped_column(ForeignKey("files.id", ondelete="SET NULL"))
    input_path: Mapped[str | None] = mapped_column(Text)
    completion_window: Mapped[str] = mapped_column(String(16), default="24h")
    priority: Mapped[int] = mapped_column(Integer, default=0)  # vLLM convention: lower runs first
    shard_size: Mapped[int] = mapped_column(Integer)
    on_invalid: Mapped[str] = mapped_column(String(8), default="skip")
    meta: Mapped[dict | None] = mapped_column("metadata", JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(256))
    output_expires_after: Mapped[int | None] = mapped_column(Integer)  # s kept after it ends (retention)
    # Budget: prompt + completion tokens the job may use in all (None: no budget); lines past it end with
    # `budget_exceeded` (store/fair_share.py).
    max_total_tokens: Mapped[int | None] = mapped_column(BigInteger)
    # The estimate made at submit from ingest's counts (store.estimate.Estimate's fields); None: none made.
    estimate: Mapped[dict | None] = mapped_column(JSON)
    # While `validating`: who ingests (host:pid:token) and until when its lease runs (store/ingest_lease.py).
    ingest_owner: Mapped[str | None] = mapped_column(String(256))
    ingest_lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    errors: Mapped[list | None] = mapped_column(JSON)  # [{code, message, line, param}], first ones only
    num_errors: Mapped[int] = mapped_column(Integer, default=0)  # all line errors, also those not listed
    num_shards: Mapped[int] = mapped_column(Integer, default=0)

    total_requests: Mapped[int] = mapped_column(Integer, default=0)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Quotas (store/quotas.py): requests held for the owner while `validating` (its input's lines), bytes its
    # request rows copy (its input's size), and its generated files' bytes, stored once when it ends.
    reserved_requests: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    request_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    output_bytes: Mapped[int | None] = mapped_column(BigInteger)  # None: not measured yet
    error_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # Result cache (store/result_cache.py): use | refresh | off, chosen at submit (the setting's default).
    result_cache: Mapped[str] = mapped_column(String(8), default="use", server_default="use")
    # Its successes served from earlier jobs' results (hits) and copied from identical lines of its own.
    result_cache_hits: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    result_cache_dedups: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # created_at + completion_window
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key"),
        Index(None, "owner", "id"),  # list_jobs: newest first per owner, keyset on id
        Index(None, "status", "expires_at"),  # expire_jobs
    )

    @property
    def batch_id(self) -> str:
        """The OpenAI-style public id."""
        return f"batch_{self.id}"

    @property
    def error_lines(self) -> int:
        """Lines of the error file: failed requests, and those a cancel or expiry stopped before they ran."""
        return max(self.failed_requests, self.total_requests - self.completed_requests)

    @property
    def request_counts(self) -> dict[str, int]:
        """OpenAI `request_counts`."""
        return {"total": self.total_requests, "completed": self.completed_requests,
                "failed": self.failed_requests}

    @property
    def usage(self) -> dict[str, int | dict[str, int]]:
        """Token totals in the OpenAI usage shape."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Shard(Base):
    """A unit of work claimed by one worker under a lease; see the module docstring for its range."""

    __tablename__ = "shards"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    ordinal: Mapped[int] = mapped_column(Integer)  # 0.. within the job, in prefix order
    model: Mapped[str] = mapped_column(String(256))  # copied from the job: claim reads one table
    priority: Mapped[int] = mapped_column(Integer, default=0)  # copied from the job
    status: Mapped[str] = mapped_column(String(16), default=ShardStatus.AVAILABLE)
    num_requests: Mapped[int] = mapped_column(Integer)
    request_lines: Mapped[bytes] = mapped_column(LargeBinary)  # uint32 LE (see decode_lines), in run order

    attempt: Mapped[int] = mapped_column(Integer, default=0)  # claims so far (a release gives one back)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    lease_owner: Mapped[str | None] = mapped_column(String(256))
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_error: Mapped[str | None] = mapped_column(Text)
    # The lease holder's last heartbeat report (0 when no lease): its generation requests still in the
    # engine, the tokens they generated so far (not yet written: written ones are in Job.completion_tokens)
    # and the most they may generate in all (n x max_tokens each). Honest progress: store.progress.
    inflight_requests: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    inflight_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    inflight_budget: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # ... and when (unix s) the longest of them should end at its engine's pace (budget left / steps per s).
    inflight_finish_at: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")

    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # first claim
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (
        UniqueConstraint("job_id", "ordinal"),
        Index(None, "status", "model", "priority", "id"),  # claim: next available shard of a model
        Index(None, "job_id", "status"),  # shards of a job by status (finalize, cancel)
        Index(None, "status", "lease_expires_at"),  # rescue_expired
    )

    @property
    def request_ids(self) -> list[int]:
        """The primary keys of this shard's requests, in run order."""
        base = request_id_for(self.job_id, 0)
        return [base | line for line in decode_lines(self.request_lines)]


def decode_lines(data: bytes) -> list[int]:
    """Shard.request_lines (uint32 little-endian, as ingest.make_shards writes them) -> line numbers."""
    packed = array("I")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


class Request(Base):
    """One input line and, once run, its result (its response body, or the key of its cached body)."""

    __tablename__ = "requests"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=False)  # request_id_for(...)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    line_number: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str | None] = mapped_column(String(512))  # NULL only for a duplicate line
    status: Mapped[str] = mapped_column(String(10), default=RequestStatus.PENDING)
    endpoint: Mapped[str | None] = mapped_column(String(16))  # "chat" | "completions"; NULL if unreadable
    payload: Mapped[str | None] = mapped_column(Text)  # {"messages"|"prompt", "params"} JSON; NULL if invalid
    # chat.completion / text_completion JSON; NULL for a success that references its cached body instead
    response: Mapped[str | None] = mapped_column(Text)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # A success's provenance JSON (engine, model fingerprint, result_cache miss|hit|dedup, computed_in) and
    # the result-cache key of its body (ResultBody.key) when the row references it instead of holding a
    # copy (response NULL; store/responses.py renders it); NULL: the row holds its own response.
    provenance: Mapped[str | None] = mapped_column(Text)
    result_key: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        UniqueConstraint("job_id", "custom_id"),  # also the duplicate detector of ingest
        Index(None, "result_key"),  # the rows with a given cached body (migration 0011)
    )


class ResultBody(Base):
    """A result-cache body (store/result_cache.py): one row per key, shared by every job whose request has it.

    `key` is the sha256 of everything that decides the output (workers/result_cache.py); `body` the result
    row as the worker produced it (choices, token counts, prompt logprobs, model), orjson bytes. A body
    that request rows reference (`Request.result_key`) is pinned: never evicted nor purged.
    """

    __tablename__ = "result_bodies"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    body: Mapped[bytes] = mapped_column(LargeBinary)
    size: Mapped[int] = mapped_column(BigInteger)  # len(body): result_cache_max_bytes counts these
    computed_in: Mapped[int] = mapped_column(BigInteger)  # the job id that computed it (no FK: outlives it)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (Index(None, "last_used_at"),)  # LRU eviction and the retention purge


class Worker(Base):
    """A worker process (one engine) and its liveness; the shards it holds are those it leases."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(256), default="")
    model: Mapped[str] = mapped_column(String(256))
    pid: Mapped[int | None] = mapped_column(Integer)
    info: Mapped[dict | None] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (Index(None, "last_heartbeat_at"),)


class ApiKey(Base):
    """An API key, stored as a hash (sha256 hex); `prefix` is the first characters, for display."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    name: Mapped[str | None] = mapped_column(String(128))
    key_hash: Mapped[str] = mapped_column(String(128), unique=True)
    prefix: Mapped[str] = mapped_column(String(16), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # An admin key's dashboard shows every owner's batches (the CLI's `local` ones included).
    admin: Mapped[bool] = mapped_column(default=False, server_default=false())
    # Fair share: an owner's share of the fleet follows its keys' highest weight (store/fair_share.py).
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")


class OwnerUsage(Base):
    """One owner's stored bytes as a counter (store/quotas.py), and the row its quota checks lock."""

    __tablename__ = "owner_usage"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    # Uploads + request rows of its jobs + their generated files: moved with each of them, never summed.
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class OwnerServed(Base):
    """Tokens served to one owner in one minute (prompt, less cached, + completion): the fair-share ledger."""

    __tablename__ = "owner_served"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # unix seconds // 60
    tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")

    __table_args__ = (Index(None, "minute"),)  # pruning old minutes


class Schedule(Base):
    """A nightly pipeline: a cron slot in a timezone turns an input path template into one job."""

    __tablename__ = "schedules"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    owner: Mapped[str] = mapped_column(String(128), default="")
    cron: Mapped[str] = mapped_column(String(128))
    timezone: Mapped[str] = mapped_column(String(64), default="UTC")
    input_template: Mapped[str] = mapped_column(Text)
    output_template: Mapped[str | None] = mapped_column(Text)
    errors_template: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(256))
    params: Mapped[dict | None] = mapped_column(JSON)  # default sampling fields for lines that omit them
    webhook_url: Mapped[str | None] = mapped_column(Text)
    webhook_secret: Mapped[str | None] = mapped_column(String(256))
    catchup: Mapped[str] = mapped_column(String(8), default="latest")  # latest | all | none
    result_cache: Mapped[str | None] = mapped_column(String(8))  # its jobs' mode; None: the setting's
    enabled: Mapped[bool] = mapped_column(default=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_slot_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # slots up to here are handled


class ScheduleRun(Base):
    """One slot of one schedule; UNIQUE(schedule_id, slot_at) makes each slot run exactly once."""

    __tablename__ = "schedule_runs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    schedule_id: Mapped[int] = mapped_column(ForeignKey("schedules.id", ondelete="CASCADE"))
    slot_at: Mapped[datetime] = mapped_column(UTCDateTime)
    manual: Mapped[bool] = mapped_column(default=False)
    status: Mapped[str] = mapped_column(String(16), default=ScheduleRunStatus.PENDING)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    input_path: Mapped[str | None] = mapped_column(Text)
    output_path: Mapped[str | None] = mapped_column(Text)
    errors_path: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (UniqueConstraint("schedule_id", "slot_at"), Index(None, "status"))


class WebhookDelivery(Base):
    """The webhook outbox: one row per call to make, retried with backoff until delivered or given up."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("schedule_runs.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(Text)
    payload: Mapped[str] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    gave_up_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (Index(None, "delivered_at", "next_attempt_at"),)
