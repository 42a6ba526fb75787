"""Recording what workers ran: result rows and the job's counters, in the caller's transaction.

shards.write_results calls apply_results inside its lease-fenced transaction; the job's counters move
in the same transaction as the request rows they count (see models.py). A cacheable success (a result
carrying its `result_body`, a wire/result_row.BodyRef) is stored by reference: its body goes to
`result_bodies` once per key in this transaction and the row keeps only the key (store/responses.py
renders it); any other success keeps its own rendered response.
"""

from __future__ import annotations

from datetime import datetime
from typing import TypedDict, cast

import orjson
from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.orm import Session

from batchinfer.store.db import is_sqlite
from batchinfer.store.models import Job, Request, RequestStatus, Shard, utcnow
from batchinfer.store.responses import render_response
from batchinfer.store.result_cache import attach_bodies
from batchinfer.wire.result_row import BodyRef, ResultRow


class _Succeeded(TypedDict):
    """The bound parameters of one succeeded row's UPDATE."""

    rid: int
    response: str | None
    p: int
    c: int
    k: int
    key: str | None
    prov: str | None
    src: str | None


class _Errored(TypedDict):
    """The bound parameters of one errored row's UPDATE."""

    rid: int
    code: str
    message: str


def apply_results(session: Session, *, job: Job, results: list[ResultRow], shard: Shard | None = None,
                  now: datetime | None = None) -> int:
    """In the caller's transaction: record results of still-pending requests and bump the job's counters.

    With `shard`, only that shard's requests are accepted.

    A result is a wire/result_row.py ResultRow: a SuccessRow ({"request_id", "choices" or "embeddings",
    "prompt_tokens", "completion_tokens", "cached_tokens", "model"?, "provenance"?, "result_body"?}) or an
    ErrorRow ({"request_id", "error": {"code", "message"}}); each is checked at run time too. Results for
    requests that are no longer pending (already written, canceled) are ignored. Returns how many counted.
    """
    now = now or utcnow()
    by_id: dict[int, ResultRow] = {}
    for result in results:
        _check_result(result)
        by_id.setdefault(result["request_id"], result)
    if not by_id:
        return 0
    # Only the primary key narrows this query (so no planner picks a job-wide index); job and shard
    # membership are checked on the few rows it returns.
    allowed = set(shard.request_ids) if shard is not None else None
    query = select(Request.id, Request.endpoint, Request.job_id).where(
        Request.id.in_(list(by_id)), Request.status == RequestStatus.PENDING)
    if not is_sqlite(session):
        query = query.with_for_update()  # cancel/rescue cannot flip these rows before we commit
    pending = [(row.id, row.endpoint) for row in session.execute(query)
               if row.job_id == job.id and (allowed is None or row.id in allowed)]
    created = int(now.timestamp())  # = finished_at's second: what responses.py renders a reference with
    offered = (by_id[request_id].get("result_body") for request_id, _ in pending)
    refs = [ref for ref in offered if isinstance(ref, BodyRef)]
    held = attach_bodies(session, refs=refs, job_id=job.id, refresh=job.result_cache == "refresh",
                         now=now) if refs else {}
    succeeded: list[_Succeeded] = []
    errored: list[_Errored] = []
    for request_id, endpoint in pending:
        result = by_id[request_id]
        if "error" in result:
            errored.append({"rid": request_id, "code": str(result["error"]["code"])[:64],
                            "message": str(result["error"]["message"])})
            continue
        ref = result.get("result_body")
        key = ref.key if isinstance(ref, BodyRef) and held.get(ref.key) == ref.computed_in else None
        response = None if key is not None else orjson.dumps(render_response(
            endpoint=endpoint, default_model=job.model, request_id=request_id, created=created,
            result=result)).decode()
        provenance = result.get("provenance")  # workers/result_cache.py; None from older writers
        succeeded.append({"rid": request_id, "response": response,
                          "p": result["prompt_tokens"], "c": result["completion_tokens"],
                          "k": result["cached_tokens"], "key": key,
                          "prov": orjson.dumps(provenance).decode() if provenance is not None else None,
                          "src": provenance.get("result_cache") if provenance is not None else None})
    table = cast(Table, Request.__table__)  # SQLAlchemy types __table__ as FromClause; declarative: a Table
    is_mine = (table.c.id == bindparam("rid")) & (table.c.status == RequestStatus.PENDING.value)
    if succeeded:
        session.execute(table.update().where(is_mine).values(
            status=RequestStatus.SUCCEEDED.value, response=bindparam("response"),
            prompt_tokens=bindparam("p"), completion_tokens=bindparam("c"), cached_tokens=bindparam("k"),
            result_key=bindparam("key"), provenance=bindparam("prov"), finished_at=now), succeeded)
    if errored:
        session.execute(table.update().where(is_mine).values(
            status=RequestStatus.ERRORED.value, error_code=bindparam("code"),
            error_message=bindparam("message"), finished_at=now), errored)
    if succeeded or errored:
        session.execute(update(Job).where(Job.id == job.id).values(
            completed_requests=Job.completed_requests + len(succeeded),
            failed_requests=Job.failed_requests + len(errored),
            prompt_tokens=Job.prompt_tokens + sum(r["p"] for r in succeeded),
            completion_tokens=Job.completion_tokens + sum(r["c"] for r in succeeded),
            cached_tokens=Job.cached_tokens + sum(r["k"] for r in succeeded),
            result_cache_hits=Job.result_cache_hits + sum(r["src"] == "hit" for r in succeeded),
            result_cache_dedups=Job.result_cache_dedups + sum(r["src"] == "dedup" for r in succeeded)))
    return len(succeeded) + len(errored)


def _check_result(result: ResultRow) -> None:
    rid = result.get("request_id")
    if not isinstance(rid, int):
        raise ValueError(f"result needs an integer request_id, got {rid!r}")
    if "error" in result:
        error = result["error"]
        if not (isinstance(error, dict) and "code" in error and "message" in error):
            raise ValueError(f"request {rid}: error must be {{code, message}}, got {error!r}")
        return
    embeddings = result.get("embeddings")
    if embeddings is not None and not (isinstance(embeddings, list) and embeddings):
        raise ValueError(f"request {rid}: embeddings must be a non-empty list")
    choices = result.get("choices") if embeddings is None else [{"text": "", "finish_reason": None}]
    if not (isinstance(choices, list) and choices
            and all(isinstance(c, dict) and isinstance(c.get("text"), str) and "finish_reason" in c
                    for c in choices)):
        raise ValueError(f"request {rid}: choices must be a non-empty list of {{text, finish_reason}}")
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        if not isinstance(result.get(name), int) or result[name] < 0:
            raise ValueError(f"request {rid}: {name} must be a non-negative integer, "
                             f"got {result.get(name)!r}")
