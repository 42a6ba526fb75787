"""Shard leases: claim, heartbeat, write results, complete / fail / release, rescue.

Every function leaves the session with no open transaction. A worker owns a shard only through its
lease token. Every write names the token and runs in one transaction that first re-reads the shard
under a lock (transitions.lock_shard), so a worker whose lease was rescued and handed to another (a
zombie) writes nothing: the token no longer matches and LeaseLost is raised. The worker registry is
in workers.py.

Attempts: `attempt` counts claims. A release gives the attempt back; an expired lease (rescue) or
a fail_shard spends it; the shard fails with `worker_lost` / the worker's error once `max_attempts`
claims are spent, and its pending requests are errored so the job still finishes.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Row, String, cast, func, literal, select, update
from sqlalchemy.orm import Session

from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.store import budgets, fair_share
from batchinfer.store.db import end_transaction, is_sqlite, rowcount, single_flight, write_transaction
from batchinfer.store.errors import LeaseLost
from batchinfer.store.ingest_lease import fail_lost_ingests
from batchinfer.store.models import Job, JobStatus, Request, RequestStatus, Shard, ShardStatus, utcnow
from batchinfer.store.progress import InflightReport
from batchinfer.store.results import apply_results
from batchinfer.store.transitions import finalize_if_done, lock_job, lock_shard
from batchinfer.wire.request import ChatMessage, RequestOptions, StoredRequest, decode_stored
from batchinfer.wire.result_row import ResultRow

RESCUE_LOCK_KEY = 0x6261746368  # pg advisory lock id: "batch"


@dataclass(frozen=True)
class ShardLease:
    """What claim_shard hands a worker."""

    shard_id: int
    job_id: int
    lease_token: str
    lease_expires_at: datetime
    attempt: int
    num_requests: int
    owner: str = ""  # the job's owner: the worker salts the prefix cache with it (tenant isolation)
    model: str = ""  # the shard's model: the job's, or a line's body.model (a served LoRA adapter's name)


@dataclass(frozen=True)
class PendingRequest:
    """A request still to run: messages (chat) or prompt (completions) and its sampling params."""

    request_id: int
    custom_id: str
    line_number: int
    endpoint: str  # an Endpoint's value (batchinfer/wire/request.py)
    messages: list[ChatMessage] | None
    prompt: str | list[int] | None
    params: SamplingParams  # from_dict of what ingest stored: validated there, not again
    options: RequestOptions | None = None  # echo, chat template arguments, embeddings input

    @classmethod
    def from_stored(cls, request_id: int, custom_id: str, line_number: int, endpoint: str,
                    stored: StoredRequest) -> PendingRequest:
        """The request of a stored payload (wire/request.py's StoredRequest, as ingest wrote it)."""
        return cls(request_id, custom_id, line_number, endpoint, stored.messages, stored.prompt,
                   stored.sampling_params(), stored.options)


@dataclass
class RescueReport:
    """What rescue_expired did: shards back to available (announce them again), failed, cancelled; jobs
    failed because their submit died mid-ingest."""

    requeued: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    lost_ingests: list[int] = field(default_factory=list)  # job ids
    skipped: bool = False  # another rescuer held the lock


def claim_shard(session: Session, *, worker_id: str, lease_seconds: float, model: str | None = None,
                shard_id: int | None = None, now: datetime | None = None,
                fair_window_seconds: float = fair_share.FAIR_SHARE_WINDOW_S) -> ShardLease | None:
    """Lease the fairest available shard of `model` (store.fair_share: the owner served least for its
    weight, then priority, earliest deadline, oldest), or exactly `shard_id` when no model is given.

    With both (a Celery delivery of `shard_id` to a worker of `model`), the id only wakes the worker: it
    claims the fairest shard of the model, so the order in which shards were announced does not decide
    who runs next; the delivered shard stays available for the next claim (and every shard announced has
    its own message). One UPDATE ... WHERE id = (SELECT ... FOR UPDATE OF shards SKIP LOCKED LIMIT 1)
    RETURNING statement; None when nothing is available (a duplicate delivery of an id finds it taken).
    """
    if model is None and shard_id is None:
        raise ValueError("claim_shard needs model= or shard_id=")
    now = now or utcnow()
    expires = now + timedelta(seconds=lease_seconds)
    token = secrets.token_hex(16)
    pick = select(Shard.id).where(Shard.status == ShardStatus.AVAILABLE)
    if model is not None:
        pick, order = fair_share.fair_order(pick.where(Shard.model == model), now=now,
                                            window_seconds=fair_window_seconds)
    else:
        pick, order = pick.where(Shard.id == shard_id), [Shard.id]
    pick = pick.order_by(*order).limit(1).with_for_update(skip_locked=True, of=Shard)
    claim = (update(Shard)
             .where(Shard.id == pick.scalar_subquery(), Shard.status == ShardStatus.AVAILABLE)
             .values(status=ShardStatus.RUNNING, attempt=Shard.attempt + 1, lease_owner=worker_id,
                     lease_token=token, lease_expires_at=expires,
                     started_at=func.coalesce(Shard.started_at, now))
             .returning(Shard.id, Shard.job_id, Shard.attempt, Shard.num_requests, Shard.model)
             .execution_options(synchronize_session=False))
    with write_transaction(session):
        row = session.execute(claim).first()
        owner = None if row is None else session.scalar(select(Job.owner).where(Job.id == row.job_id))
    if row is None:
        return None
    return ShardLease(shard_id=row.id, job_id=row.job_id, lease_token=token, lease_expires_at=expires,
                      attempt=row.attempt, num_requests=row.num_requests, owner=owner or "",
                      model=row.model)


def heartbeat(session: Session, *, shard_id: int, lease_token: str, lease_seconds: float,
              now: datetime | None = None, inflight: InflightReport | None = None) -> bool:
    """Extend the lease, and record what the shard's in-flight requests generated so far (`inflight`, for
    store.progress). False means stop working on the shard: the lease is lost, or the job is no longer
    in progress (cancelled, expired); abort its in-flight requests and call release_shard."""
    now = now or utcnow()
    values: dict[str, object] = {"lease_expires_at": now + timedelta(seconds=lease_seconds)}
    if inflight is not None:
        finish_at = now.timestamp() + inflight.critical_s if inflight.critical_s else 0.0  # ages as it should
        values.update(inflight_requests=inflight.requests, inflight_tokens=inflight.tokens,
                      inflight_budget=inflight.budget, inflight_finish_at=finish_at)
    active_jobs = select(Job.id).where(Job.status == JobStatus.IN_PROGRESS)
    with write_transaction(session):
        result = session.execute(
            update(Shard).where(Shard.id == shard_id, Shard.lease_token == lease_token,
                                Shard.status == ShardStatus.RUNNING, Shard.job_id.in_(active_jobs))
            .values(**values).execution_options(synchronize_session=False))
    return rowcount(result) == 1


def pending_requests(session: Session, *, shard_id: int) -> list[PendingRequest]:
    """The shard's requests still pending, in prefix order (shared prompt prefixes next to each other)."""
    shard = session.get(Shard, shard_id)
    if shard is None:
        raise LookupError(f"shard {shard_id} not found")
    order = {request_id: position for position, request_id in enumerate(shard.request_ids)}
    rows: list[Row[int, str | None, int, str | None, str | None]] = []
    for ids in _batches(list(order)):
        rows += session.execute(
            select(Request.id, Request.custom_id, Request.line_number, Request.endpoint, Request.payload)
            .where(Request.id.in_(ids), Request.status == RequestStatus.PENDING)).all()
    end_transaction(session)
    rows.sort(key=lambda row: order[row.id])
    out = []
    for request_id, custom_id, line_number, endpoint, payload in rows:
        # a pending request's columns are all set (ingest leaves them NULL only on lines it errors)
        assert custom_id is not None and endpoint is not None and payload is not None
        out.append(PendingRequest.from_stored(request_id, custom_id, line_number, endpoint,
                                              decode_stored(payload)))
    return out


def _batches(ids: list[int], size: int = 5000) -> list[list[int]]:
    """Split an id list for IN (...) clauses (SQLite caps bound parameters per statement)."""
    return [ids[start:start + size] for start in range(0, len(ids), size)]


def write_results(session: Session, *, shard_id: int, lease_token: str, results: list[ResultRow],
                  now: datetime | None = None) -> int:
    """Record finished requests of the shard (fenced by the lease; results.apply_results has the dicts).

    Idempotent: only requests still pending change. Returns how many were recorded; raises LeaseLost.
    """
    now = now or utcnow()
    with write_transaction(session):
        shard = lock_shard(session, shard_id, lease_token=lease_token)
        job = lock_job(session, shard.job_id)
        _move_out_of_flight(shard, results)
        results, spent = budgets.within_budget(session, job=job, results=results)
        recorded = apply_results(session, job=job, results=results, shard=shard, now=now)
        if recorded:  # the fair-share ledger (duplicates of written lines may count twice: harmless)
            served = fair_share.served_tokens(results)
            fair_share.record_served(session, owner=job.owner, tokens=served, now=now)
        if spent:
            budgets.stop_spent_job(session, job=job, now=now)
        return recorded


def _move_out_of_flight(shard: Shard, results: list[ResultRow]) -> None:
    """Written generations leave the in-flight report (their tokens now count in the job's), until the
    worker's next heartbeat reports afresh: so no token is counted twice meanwhile."""
    written = [result for result in results if "choices" in result]
    if not written or not shard.inflight_requests:
        return
    share = shard.inflight_budget // shard.inflight_requests
    shard.inflight_requests = max(shard.inflight_requests - len(written), 0)
    tokens = sum(result.get("completion_tokens", 0) for result in written)
    shard.inflight_tokens = max(shard.inflight_tokens - tokens, 0)
    shard.inflight_budget = max(shard.inflight_budget - share * len(written), shard.inflight_tokens)


def _error_pending(session: Session, shard: Shard, job: Job, code: str, message: str, now: datetime) -> int:
    """Error the shard's still-pending requests (counted as failed); each message names its line."""
    count = 0
    line_message = literal("line ") + cast(Request.line_number, String) + literal(f": {message}")
    for ids in _batches(shard.request_ids):
        count += rowcount(session.execute(
            update(Request).where(Request.id.in_(ids), Request.status == RequestStatus.PENDING)
            .values(status=RequestStatus.ERRORED, error_code=code, error_message=line_message,
                    finished_at=now)
            .execution_options(synchronize_session=False)))
    if count:
        job.failed_requests += count
    return count


def complete_shard(session: Session, *, shard_id: int, lease_token: str, now: datetime | None = None) -> str:
    """Mark the shard done (fenced) and finish the job if it was the last; returns the job's status.

    Requests the worker never wrote are errored with `missing_result`, so every line gets an answer.
    """
    now = now or utcnow()
    with write_transaction(session):
        shard = lock_shard(session, shard_id, lease_token=lease_token)
        job = lock_job(session, shard.job_id)
        _error_pending(session, shard, job, "missing_result",
                       "the worker finished its shard without a result for this request", now)
        if job.status == JobStatus.IN_PROGRESS:
            shard.status, shard.completed_at = ShardStatus.COMPLETED, now
        else:
            shard.status, shard.cancelled_at = ShardStatus.CANCELLED, now
        shard.lease_token = None
        shard.inflight_requests = shard.inflight_tokens = shard.inflight_budget = 0
        shard.inflight_finish_at = 0.0
        finalize_if_done(session, job=job, now=now)
        return job.status


def fail_shard(session: Session, *, shard_id: int, lease_token: str, error: str, retry: bool = True,
               now: datetime | None = None) -> str:
    """The worker could not run the shard (fenced). With attempts left and `retry` it becomes available
    again; otherwise it fails and its pending requests are errored with `error`. Returns the shard status."""
    now = now or utcnow()
    with write_transaction(session):
        shard = lock_shard(session, shard_id, lease_token=lease_token)
        job = lock_job(session, shard.job_id)
        _retire(session, shard, job, code="shard_failed", message=error, retry=retry, now=now)
        finalize_if_done(session, job=job, now=now)
        return shard.status


def release_shard(session: Session, *, shard_id: int, lease_token: str, now: datetime | None = None) -> bool:
    """Give the shard back without spending the attempt (e.g. shutdown, or heartbeat said stop).

    Its finished results stay; a shard of a job no longer in progress is cancelled. False if the lease
    was already lost (nothing to do)."""
    now = now or utcnow()
    try:
        with write_transaction(session):
            shard = lock_shard(session, shard_id, lease_token=lease_token)
            job = lock_job(session, shard.job_id)
            shard.attempt -= 1
            _retire(session, shard, job, code="", message="", retry=True, now=now)
            finalize_if_done(session, job=job, now=now)
    except LeaseLost:
        return False
    return True


def _retire(session: Session, shard: Shard, job: Job, *, code: str, message: str, retry: bool,
            now: datetime) -> None:
    """End a lease: shard -> available (attempts left), failed (pending errored) or cancelled (job over)."""
    shard.lease_token, shard.lease_expires_at = None, None
    shard.inflight_requests = shard.inflight_tokens = shard.inflight_budget = 0  # aborted: generated again
    shard.inflight_finish_at = 0.0
    if job.status != JobStatus.IN_PROGRESS:
        shard.status, shard.cancelled_at = ShardStatus.CANCELLED, now
    elif retry and shard.attempt < shard.max_attempts:
        shard.status = ShardStatus.AVAILABLE
        shard.last_error = message or shard.last_error
    else:
        shard.status, shard.failed_at, shard.last_error = ShardStatus.FAILED, now, message
        _error_pending(session, shard, job, code, f"{message} (after {shard.attempt} attempt(s))", now)


def rescue_expired(session: Session, *, now: datetime | None = None) -> RescueReport:
    """Return shards whose lease expired to `available`, or fail them (`worker_lost`) after max_attempts;
    fail `validating` jobs whose ingest lease expired (ingest_lease.fail_lost_ingests).

    Single-flight (db.single_flight: a second rescuer returns skipped=True) and idempotent.
    """
    now = now or utcnow()
    report = RescueReport()
    with write_transaction(session):
        if not single_flight(session, RESCUE_LOCK_KEY):
            report.skipped = True
            return report
        query = (select(Shard).where(Shard.status == ShardStatus.RUNNING, Shard.lease_expires_at < now)
                 .order_by(Shard.id).execution_options(populate_existing=True))
        if not is_sqlite(session):
            query = query.with_for_update(skip_locked=True)  # a shard mid-write is not expired
        jobs: dict[int, Job] = {}
        for shard in session.scalars(query).all():
            job = jobs.get(shard.job_id)
            if job is None:
                job = jobs[shard.job_id] = lock_job(session, shard.job_id)
            lost = f"worker {shard.lease_owner} stopped heartbeating (lease expired)"
            _retire(session, shard, job, code="worker_lost", message=lost, retry=True, now=now)
            {ShardStatus.AVAILABLE: report.requeued, ShardStatus.FAILED: report.failed,
             ShardStatus.CANCELLED: report.cancelled}[ShardStatus(shard.status)].append(shard.id)
        session.flush()
        for job in jobs.values():
            finalize_if_done(session, job=job, now=now)
        report.lost_ingests = fail_lost_ingests(session, now=now)
        fair_share.prune_served(session, now=now)  # the fair-share ledger forgets minutes past its window
    return report


def list_shards(session: Session, *, job_id: int, status: str | None = None) -> list[Shard]:
    """The job's shards in order (optionally of one status): dispatch announces the available ones."""
    query = select(Shard).where(Shard.job_id == job_id).order_by(Shard.ordinal)
    if status is not None:
        query = query.where(Shard.status == status)
    found = list(session.scalars(query))
    end_transaction(session)
    return found


def available_shards_per_model(session: Session, *, limit_per_model: int) -> list[Shard]:
    """The first `limit_per_model` available shards of each model (priority, then id): whom to wake."""
    ranked = (select(Shard.id, func.row_number().over(partition_by=Shard.model,
                                                      order_by=(Shard.priority, Shard.id)).label("rank"))
              .where(Shard.status == ShardStatus.AVAILABLE).subquery())
    ids = session.scalars(select(ranked.c.id).where(ranked.c.rank <= limit_per_model)).all()
    return list(session.scalars(select(Shard).where(Shard.id.in_(ids)).order_by(Shard.id))) if ids else []


def shard_counts(session: Session, *, job_id: int) -> dict[str, int]:
    """Number of the job's shards in each status."""
    rows = session.execute(select(Shard.status, func.count()).where(Shard.job_id == job_id)
                           .group_by(Shard.status))
    counts = {status: count for status, count in rows}
    end_transaction(session)
    return counts
