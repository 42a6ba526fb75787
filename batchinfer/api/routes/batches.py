"""/v1/batches: create (ingest in a background thread), retrieve, list, cancel.

Creating a batch ingests its whole input file (parse, validate, insert, shard). That runs on the app's
ingest thread pool, never on the event loop: the response waits up to SUBMIT_WAIT_S for it (small files
answer `in_progress` or `failed` directly), then answers with the job as it stands (`validating`) while
the ingest goes on. The owner's quotas are reserved in the transaction that inserts the job
(store.quotas.reserve_job: its input's lines and bytes), so concurrent creates cannot all pass a limit;
its model must be known (api.known_models).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.api import metrics
from batchinfer.api.cache import PollCache
from batchinfer.api.deps import Caller, CallerDep, OwnerDep, SessionsDep, SettingsDep, ingest_pool
from batchinfer.api.errors import ERROR_RESPONSES, APIError, bad_request, not_found
from batchinfer.api.known_models import UnknownModel, check_batch_model
from batchinfer.api.limits import quota_errors
from batchinfer.api.schemas import CreateBatchRequest, RetryBatchRequest
from batchinfer.config import Settings
from batchinfer.store import files as file_store
from batchinfer.store.errors import JobError, JobNotFound, JobStateError
from batchinfer.store.jobs import cancel_job, get_job, job_id_by_idempotency_key, list_jobs
from batchinfer.store.models import JOB_TERMINAL_STATUSES, File, Job
from batchinfer.store.progress import inflight_by_job
from batchinfer.store.quotas import check_job_quotas, reserve_job
from batchinfer.store.result_files import record_result_sizes_in_background
from batchinfer.store.retry import retry_input
from batchinfer.store.serialize import batch_object, current_batch_object, parse_batch_id, parse_file_id
from batchinfer.store.timeline import first_claims
from batchinfer.store.workers import served_models
from batchinfer.wire.batch import BatchList, BatchObject, RetryInfo, RetryLeftOut
from workers.dispatch import submit_and_announce

logger = logging.getLogger("batchinfer.api")
router = APIRouter(prefix="/v1/batches", tags=["batches"])

SUBMIT_WAIT_S = 2.0  # how long POST /v1/batches waits for ingest before answering `validating`
_ROW_POLL_S = 0.01

BatchId = Annotated[str, Path(description="batch_<n>", examples=["batch_1"])]


def _job_or_404(session: Session, owner: str, batch_id: str) -> Job:
    job_id = parse_batch_id(batch_id)
    job = get_job(session, job_id=job_id, owner=owner) if job_id is not None else None
    if job is None:
        raise not_found("batch", batch_id, param="batch_id")
    return job


def _input_file(body: CreateBatchRequest, session: Session, owner: str, settings: Settings) -> File:
    """The batch's input file, once its model is known here (api.known_models); the job's own fields
    (endpoint, completion_window, metadata, ...) are checked once, by store.jobs.submit_job."""
    try:
        check_batch_model(session, model=body.model or settings.default_model, settings=settings)
    except UnknownModel as exc:
        raise bad_request(f"Invalid model: {exc}.", param="model", code=exc.code) from None
    ref = parse_file_id(body.input_file_id)
    row = file_store.get_file(session, owner=owner, file_id=ref.id) if ref and ref.kind == "input" else None
    if row is None:
        raise not_found("File", body.input_file_id, param="input_file_id")
    if row.purpose != "batch":
        raise bad_request(f"File '{body.input_file_id}' has purpose '{row.purpose}'; a batch needs a "
                          "'batch' file.", param="input_file_id")
    return row


def _submit(factory: sessionmaker[Session], submit: Callable[[Session], Job], owner: str, key: str) -> int:
    """Runs on the ingest pool: the whole submit (create job, ingest, shard, announce); returns the job id.

    A JobError (a bad field, QuotaExceeded) is raised before any job exists: the create answers it."""
    with factory() as session:
        try:
            job = submit(session)
        except JobError:
            raise
        except Exception:
            logger.exception("ingest of batch %s of %s failed", key, owner)
            job_id = job_id_by_idempotency_key(session, owner=owner, key=key)
            if job_id is None:
                raise
            return job_id  # submit_job marked it failed with an ingest_error
    metrics.INGESTED_REQUESTS.inc(job.total_requests)
    return job.id


def _reserve(session: Session, job: Job, *, settings: Settings, file: File) -> None:
    """The job's quota reservation: its input's lines (an upper bound of its requests) and bytes."""
    reserve_job(session, job=job, settings=settings, requests=max(file.lines, 1), request_bytes=file.bytes)


async def _wait_for_job(factory: sessionmaker[Session], owner: str, key: str, future: Future[int]) -> int:
    """The job id: from the finished submit, or (ingest still running) from the row it committed first."""
    wrapped = asyncio.wrap_future(future)
    try:
        return await asyncio.wait_for(asyncio.shield(wrapped), timeout=SUBMIT_WAIT_S)
    except TimeoutError:
        pass

    def lookup() -> int | None:
        with factory() as session:
            return job_id_by_idempotency_key(session, owner=owner, key=key)

    while True:
        if future.done():
            return future.result()
        job_id = await run_in_threadpool(lookup)
        if job_id is not None:
            return job_id
        await asyncio.sleep(_ROW_POLL_S)


@router.post("", response_model=BatchObject, responses=ERROR_RESPONSES, summary="Create a batch")
async def create_batch(
    body: CreateBatchRequest,
    request: Request,
    owner: OwnerDep,
    settings: SettingsDep,
    factory: SessionsDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> BatchObject:
    """Create a batch from an uploaded `batch` file; returns it `validating`, `in_progress` or `failed`.

    A bad field answers 400 naming it (`param`): the store's JobError, through the API's error handler."""

    def input_file() -> File:
        with factory() as session, quota_errors():
            check_job_quotas(session, owner=owner, settings=settings)  # 429 naming the limit
            return _input_file(body, session, owner, settings)

    file = await run_in_threadpool(input_file)
    expiry = body.output_expires_after
    key = f"api:{idempotency_key}" if idempotency_key else f"api:{uuid.uuid4().hex}"

    def submit(session: Session) -> Job:
        return submit_and_announce(
            session=session, settings=settings, model=body.model or settings.default_model, path=file.path,
            input_file_id=file.id, owner=owner, endpoint=body.endpoint, metadata=body.metadata,
            completion_window=body.completion_window, idempotency_key=key,
            on_invalid=body.on_invalid or "skip", priority=body.priority or 0, shard_size=body.shard_size,
            output_expires_after=expiry.seconds if expiry else None, max_total_tokens=body.max_total_tokens,
            result_cache=body.result_cache, reserve=partial(_reserve, settings=settings, file=file))

    future = ingest_pool(request.app).submit(owner, _submit, factory, submit, owner, key)  # owners take turns
    with quota_errors():  # 429 naming the limit the reservation found; a bad field: the JobError handler
        job_id = await _wait_for_job(factory, owner, key, future)

    def load() -> BatchObject:
        with factory() as session:
            job = get_job(session, job_id=job_id, owner=owner)
            if job is None:  # cannot happen: the job was just created for this owner
                raise APIError(500, "The batch vanished while it was being created.")
            return current_batch_object(session, job)

    return await run_in_threadpool(load)


# Routes are async and do their database work in one threadpool call (Caller.read): a sync route with
# a response_model would cost FastAPI a second thread hop (it serializes the response in the threadpool).


@router.get("", response_model=BatchList, responses=ERROR_RESPONSES, summary="List your batches")
async def list_batches(
    caller: CallerDep,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    """Your batches, newest first; `after` is the last id of the previous page."""
    after_id = parse_batch_id(after) if after else None

    def page(session: Session, owner: str) -> BatchList:
        if after and after_id is None:
            raise bad_request(f"Invalid 'after' cursor '{after}': pass the id of a batch from a previous "
                              "page.", param="after")
        jobs = list_jobs(session, owner=owner, after=after_id, limit=limit + 1)
        served = served_models(session)  # once per page: the note of jobs no live worker serves
        started = first_claims(session, job_ids=[job.id for job in jobs[:limit]])  # throughput's clock
        inflight = inflight_by_job(session, job_ids=[job.id for job in jobs[:limit]])  # tokens so far
        data = [batch_object(job, served_models=served, started_at=started.get(job.id),
                             inflight=inflight.get(job.id)) for job in jobs[:limit]]
        return BatchList(data=data, first_id=data[0].id if data else None,
                         last_id=data[-1].id if data else None, has_more=len(jobs) > limit)

    return await caller.read(page)


@router.get("/{batch_id}", response_model=BatchObject, responses=ERROR_RESPONSES, summary="Retrieve a batch")
async def retrieve_batch(batch_id: BatchId, caller: CallerDep, request: Request) -> BatchObject:
    """The batch's status, counts, usage and progress: the hot path of polling.

    Clients polling a batch share its cached object (at most STATUS_CACHE_TTL_S old) and their key's
    cached check (at most AUTH_CACHE_TTL_S old): a poll is answered on the event loop, and one
    background read per half-TTL keeps both fresh, whatever the number of clients.
    """
    cache: PollCache[tuple[str, BatchObject]] = request.app.state.status_cache
    job_id = parse_batch_id(batch_id)

    def read(session: Session, owner: str) -> BatchObject:
        job = _job_or_404(session, owner, batch_id)
        batch = current_batch_object(session, job)
        cache.put(job.id, (job.owner, batch))
        return batch

    owner = caller.cached_owner()
    cached = cache.get(job_id) if owner is not None and job_id is not None else None
    if cached is None or cached[0] != owner or job_id is None:  # (cached implies job_id)
        return await caller.read(read)
    if cache.refresh_due(job_id) | caller.auth_refresh_due():  # `|`: claim both refreshes at once
        _in_background(_refresh(caller, read, cache, job_id))
    return cached[1]


_background_tasks: set[asyncio.Task[None]] = set()


def _in_background(coroutine: Coroutine[object, object, None]) -> None:
    task = asyncio.get_running_loop().create_task(coroutine)
    _background_tasks.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(_background_tasks.discard)


async def _refresh(caller: Caller, read: Callable[[Session, str], BatchObject],
                   cache: PollCache[tuple[str, BatchObject]], job_id: int) -> None:
    """Re-authenticate and re-read a polled batch; on a failure forget both (the next poll asks the DB)."""
    try:
        await caller.read(read)
    except Exception:  # revoked key (401), deleted job (404), database trouble: no stale answer survives
        cache.drop(job_id)
        caller.forget_key()


@router.post("/{batch_id}/cancel", response_model=BatchObject, responses=ERROR_RESPONSES,
             summary="Cancel a batch")
async def cancel_batch(batch_id: BatchId, caller: CallerDep, request: Request) -> BatchObject:
    """Cancel: the batch is `cancelling` until running shards let go, then `cancelled`."""
    batch = await run_in_threadpool(_cancel, caller, batch_id)
    request.app.state.status_cache.drop(parse_batch_id(batch.id))  # read-your-writes for this client
    return batch


@router.post("/{batch_id}/retry", response_model=BatchObject, responses=ERROR_RESPONSES,
             summary="Retry a batch's failed lines")
async def retry_batch(batch_id: BatchId, body: RetryBatchRequest, caller: CallerDep,
                      settings: SettingsDep) -> BatchObject:
    """Extension: a new batch of a finished batch's failed / expired / cancelled lines (its metadata's
    `retry_of` names the parent); lines with invalid input are named in `retry.left_out` unless included."""
    return await run_in_threadpool(_retry, caller, settings, batch_id, body)


def _retry(caller: Caller, settings: Settings, batch_id: str, body: RetryBatchRequest) -> BatchObject:
    job_id = parse_batch_id(batch_id)
    if job_id is None:
        raise not_found("batch", batch_id, param="batch_id")
    with caller.session() as (session, owner):
        try:
            child = retry_input(session, job_id=job_id, owner=owner, only=body.only,
                                include_invalid=body.include_invalid)
        except JobNotFound:
            raise not_found("batch", batch_id, param="batch_id") from None
        except JobStateError as exc:
            raise bad_request(str(exc), param="batch_id", code="invalid_batch_status") from None
        size = len(child.stream.getbuffer())

        def reserve(session: Session, job: Job) -> None:  # the child's lines and bytes, as a create's
            reserve_job(session, job=job, settings=settings, requests=len(child.lines), request_bytes=size)

        with quota_errors():  # 429 naming the limit, as a create would
            check_job_quotas(session, owner=owner, settings=settings)
            job = submit_and_announce(session=session, settings=settings, stream=child.stream,
                                      reserve=reserve, **child.submit_args)
        retry = RetryInfo(of=batch_id, lines=len(child.lines),
                          left_out=[RetryLeftOut.model_validate(line) for line in child.left_out])
        return batch_object(job).model_copy(update={"retry": retry})


def _cancel(caller: Caller, batch_id: str) -> BatchObject:
    job_id = parse_batch_id(batch_id)
    if job_id is None:
        raise not_found("batch", batch_id, param="batch_id")
    with caller.session() as (session, owner):
        try:
            job = cancel_job(session, job_id=job_id, owner=owner)
        except JobNotFound:
            raise not_found("batch", batch_id, param="batch_id") from None
        except JobStateError as exc:
            raise bad_request(f"Cannot cancel a batch with status '{exc.status}'.", param="batch_id",
                              code="invalid_batch_status") from None
    if job.status in JOB_TERMINAL_STATUSES:  # it ended now: size its output / error files once
        record_result_sizes_in_background(caller.sessions, job_id=job.id)
    return batch_object(job)
