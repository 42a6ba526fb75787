"""A job's generated result files (`file-out-<job>`, `file-err-<job>`, purpose "batch_output"): which of
them exist, one page of them for `GET /v1/files`, and deleting one.

They are not stored as files: their lines are the job's result rows (store.export). So deleting one
deletes the rows it is made of (succeeded requests for the output file, errored and not-run requests for
the error file) and frees that space; the batch keeps its ids and request_counts, as OpenAI's does, and
the deleted file answers 404 from then on. A file exists while the job has ended and at least one of its
rows is left.

Their sizes are measured once, when the job has ended (`record_result_sizes`: by the worker that finished
it, the cancel that ended it, else by the first reader), and stored on the job (`output_bytes`,
`error_bytes`): listing files reads them and never exports. Those bytes are charged to the owner's
stored bytes (store.quotas) in the same transaction, and given back when a file is deleted; the job's
copied requests (`request_bytes`) once no row of it is left.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import delete, exists, select, update
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.store.db import end_transaction, rowcount, write_transaction
from batchinfer.store.export import EXPORT_STATUSES, export_results
from batchinfer.store.jobs import get_job
from batchinfer.store.models import JOB_TERMINAL_STATUSES, Job, Request, request_id_for
from batchinfer.store.quotas import charge_storage

logger = logging.getLogger("batchinfer.store")
ResultKind = Literal["output", "error"]
RESULT_KINDS: tuple[ResultKind, ...] = ("output", "error")  # the order of a job's files in a listing
_JOBS_PER_QUERY = 500  # a listing reads jobs in keyset windows of this many


def _statuses(kind: ResultKind) -> list[str]:
    return [status.value for status in EXPORT_STATUSES["output" if kind == "output" else "errors"]]


def _rows_of(job_id: int, kind: ResultKind):  # noqa: ANN202 - a SQLAlchemy condition
    """The result rows of `kind` of one job: its primary-key range (store.models.request_id_for)."""
    return (Request.id > request_id_for(job_id, 0), Request.id < request_id_for(job_id + 1, 0),
            Request.status.in_(_statuses(kind)))


def _counted(job: Job, kind: ResultKind) -> bool:
    """Whether the job ended with requests of `kind` (rows may have been deleted since)."""
    if job.status not in JOB_TERMINAL_STATUSES:
        return False
    return (job.completed_requests if kind == "output" else job.error_lines) > 0


def result_file_exists(session: Session, *, job: Job, kind: ResultKind) -> bool:
    """Whether the job's output or error file can be read: the job ended with such rows and they are left."""
    return _counted(job, kind) and bool(session.scalar(select(exists().where(*_rows_of(job.id, kind)))))


@dataclass(frozen=True, slots=True)
class ResultFile:
    """One generated result file of a listing."""

    job: Job
    kind: ResultKind


def list_result_files(session: Session, *, owner: str, limit: int,
                      after: tuple[int, ResultKind] | None = None,
                      order: str = "desc") -> tuple[list[ResultFile], bool]:
    """One page of the owner's result files by (job id, kind); `after` is the last of the previous page.
    Returns (files, has_more)."""
    ascending = order == "asc"
    kinds = RESULT_KINDS if ascending else RESULT_KINDS[::-1]
    base = select(Job).where(Job.owner == owner, Job.status.in_(sorted(JOB_TERMINAL_STATUSES)),
                             (Job.completed_requests > 0) | (Job.failed_requests > 0)
                             | (Job.total_requests > Job.completed_requests))  # Job.error_lines > 0
    base = base.order_by(Job.id.asc() if ascending else Job.id.desc()).limit(_JOBS_PER_QUERY)
    found: list[ResultFile] = []
    boundary, inclusive = (after[0], True) if after is not None else (None, False)
    while True:
        query = base
        if boundary is not None:
            query = query.where((Job.id >= boundary if inclusive else Job.id > boundary) if ascending
                                else (Job.id <= boundary if inclusive else Job.id < boundary))
        jobs = list(session.scalars(query))
        for job in jobs:
            for kind in kinds:
                if after is not None and job.id == after[0] and kinds.index(kind) <= kinds.index(after[1]):
                    continue  # the previous page ended with or after this file
                if result_file_exists(session, job=job, kind=kind):
                    if len(found) == limit:
                        return found, True
                    found.append(ResultFile(job=job, kind=kind))
        if len(jobs) < _JOBS_PER_QUERY:
            return found, False
        boundary, inclusive = jobs[-1].id, False


def record_result_sizes(session: Session, *, job_id: int) -> Job | None:
    """Measure an ended job's output and error files once and store their sizes (charged to its owner).

    Returns the job (sizes set), or None when it does not exist or has not ended (its rows still move).
    Exports the job's result rows without holding a transaction; a concurrent measure stores nothing twice.
    """
    job = session.get(Job, job_id, populate_existing=True)
    end_transaction(session)
    if job is None or job.status not in JOB_TERMINAL_STATUSES:
        return None
    if job.output_bytes is not None and job.error_bytes is not None:
        return job
    sizes = {kind: sum(map(len, export_results(session, job_id=job_id, kind=_export_kind(kind))))
             if _counted(job, kind) else 0 for kind in RESULT_KINDS}
    with write_transaction(session):
        stored = rowcount(session.execute(update(Job).where(Job.id == job_id, Job.output_bytes.is_(None))
                                 .values(output_bytes=sizes["output"], error_bytes=sizes["error"])
                                 .execution_options(synchronize_session=False)))
        if stored:
            charge_storage(session, owner=job.owner, delta=sizes["output"] + sizes["error"])
    session.refresh(job)
    end_transaction(session)
    return job


def record_result_sizes_in_background(sessions: sessionmaker[Session], *, job_id: int) -> threading.Thread:
    """record_result_sizes on a daemon thread with its own session (a worker's loop must keep stepping and
    heartbeating while a large job's files are measured); a failure is logged, the first reader retries."""

    def measure() -> None:
        try:
            with sessions() as session:
                record_result_sizes(session, job_id=job_id)
        except Exception:
            logger.warning("measuring the result files of job %s failed; the first listing measures them",
                           job_id, exc_info=True)

    thread = threading.Thread(target=measure, name=f"batchinfer-result-sizes-{job_id}", daemon=True)
    thread.start()
    return thread


def result_file_size(session: Session, *, job: Job, kind: ResultKind) -> int:
    """Bytes of an ended job's output or error file, as stored (measured now if it never was)."""
    size = job.output_bytes if kind == "output" else job.error_bytes
    if size is None:
        measured = record_result_sizes(session, job_id=job.id)
        size = (measured.output_bytes if kind == "output" else measured.error_bytes) if measured else 0
    return size or 0


def _export_kind(kind: ResultKind) -> Literal["output", "errors"]:
    return "output" if kind == "output" else "errors"


def delete_result_file(session: Session, *, owner: str, job_id: int, kind: ResultKind) -> bool:
    """Delete a job's output or error file (its result rows); False when the owner has no such file."""
    job = get_job(session, job_id=job_id, owner=owner)  # a terminal job's rows change no more
    if job is None or not result_file_exists(session, job=job, kind=kind):
        return False
    size = result_file_size(session, job=job, kind=kind)
    column = Job.output_bytes if kind == "output" else Job.error_bytes
    with write_transaction(session):
        session.execute(delete(Request).where(*_rows_of(job_id, kind)).execution_options(
            synchronize_session=False))
        if rowcount(session.execute(update(Job).where(Job.id == job_id, column == size).values({column: 0})
                           .execution_options(synchronize_session=False))):
            charge_storage(session, owner=owner, delta=-size)  # its bytes are the owner's again
        _release_request_bytes_once_no_row_is_left(session, owner=owner, job_id=job_id)
    return True


def _release_request_bytes_once_no_row_is_left(session: Session, *, owner: str, job_id: int) -> None:
    """In the deleting transaction: the job's copied requests (request_bytes, charged at create) are the
    owner's again once both its files are deleted and none of its rows is left (not at the purge only)."""
    left = session.scalar(select(Request.id).where(Request.id > request_id_for(job_id, 0),
                                                   Request.id < request_id_for(job_id + 1, 0)).limit(1))
    held = None if left is not None else session.scalar(select(Job.request_bytes).where(Job.id == job_id))
    if held and rowcount(session.execute(update(Job).where(Job.id == job_id, Job.request_bytes == held)
                                .values(request_bytes=0).execution_options(synchronize_session=False))):
        charge_storage(session, owner=owner, delta=-held)
