"""Results export: a job's OpenAI batch output and error lines, streamed from the database in input order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchinfer.store.db import end_transaction
from batchinfer.store.errors import JobError
from batchinfer.store.models import (
    REQUEST_NOT_RUN_STATUSES,
    Job,
    Request,
    RequestStatus,
    ResultBody,
    request_id_for,
)
from batchinfer.store.responses import request_response
from batchinfer.store.transitions import NOT_RUN_ERRORS
from batchinfer.wire.output_line import encode_line, error_line, output_line

ExportKind = Literal["output", "errors", "all"]
EXPORT_STATUSES = {
    "output": (RequestStatus.SUCCEEDED,),
    "errors": (RequestStatus.ERRORED, *sorted(REQUEST_NOT_RUN_STATUSES)),
}
EXPORT_STATUSES["all"] = EXPORT_STATUSES["output"] + EXPORT_STATUSES["errors"]  # one file, as vLLM writes


def export_results(session: Session, *, job_id: int, kind: ExportKind = "output",
                   chunk_size: int = 10_000) -> Iterator[bytes]:
    """Yield the OpenAI batch output (kind="output") or error file (kind="errors") lines, in input order;
    kind="all" yields both in one stream (`batchinfer run --errors-in-output`, as `vllm run-batch` writes).

    Walks the primary key (= input order) in windows of `chunk_size` lines: each query reads at most
    that many rows whatever the planner's statistics say, and no transaction stays open in between. A row
    that references a result-cache body gets it in the same query (an outer join) and is rendered by
    store/responses.py, the one reader of a row's response.
    """
    if kind not in EXPORT_STATUSES:
        raise JobError(f"kind must be 'output', 'errors' or 'all', got {kind!r}")
    statuses = [s.value for s in EXPORT_STATUSES[kind]]
    columns = (Request.id, Request.line_number, Request.custom_id, Request.status, Request.response,
               Request.error_code, Request.error_message, Request.provenance, Request.endpoint,
               Request.finished_at, ResultBody.body)
    job = session.execute(select(Job.total_requests, Job.model).where(Job.id == job_id)).first()
    end_transaction(session)
    total, model = (job[0] or 0, job[1]) if job is not None else (0, "")
    base = request_id_for(job_id, 0)  # the job's rows are lines 1..total_requests
    for start in range(0, total, chunk_size):
        rows = session.execute(select(*columns).outerjoin(ResultBody, Request.result_key == ResultBody.key)
                               .where(Request.id > base + start, Request.id <= base + start + chunk_size,
                                      Request.status.in_(statuses))
                               .order_by(Request.id)).all()
        end_transaction(session)
        for (request_id, line_number, custom_id, status, response, code, message, provenance, endpoint,
             finished_at, cached_body) in rows:
            custom_id = custom_id if custom_id is not None else f"line-{line_number}"
            if status == RequestStatus.SUCCEEDED.value:
                body = request_response(request_id=request_id, endpoint=endpoint, finished_at=finished_at,
                                        response=response, cached_body=cached_body, default_model=model)
                # provenance: engine, model fingerprint, result_cache (store/result_cache.py)
                yield encode_line(output_line(request_key=request_id, custom_id=custom_id, body=body,
                                              provenance=provenance))
            else:
                if code is None:
                    code, message = NOT_RUN_ERRORS.get(RequestStatus(status), ("unknown_error", "no detail"))
                yield encode_line(error_line(request_key=request_id, custom_id=custom_id, code=code,
                                             message=message))

