"""A job's token budget (`max_total_tokens`): the prompt + completion tokens its results may record.

Enforced where results are written (shards.write_results, inside its lease-fenced transaction, with the
job row locked), so the job's recorded usage never exceeds the budget, however many workers run it:

- a result whose tokens fit what is left is recorded; the first one that does not fit, and every
  result after it in the batch, becomes a `budget_exceeded` error instead (the generated text is dropped,
  not billed);
- once the budget is spent, every line still pending is errored `budget_exceeded` at once (one primary-
  key range update) and the job's shards not yet claimed are completed: finished lines are kept, and
  the job completes as soon as the shards that are running end.

At admission the budget only has to be a positive integer: a file whose caps (n x max_tokens) add up to
more is accepted, since most requests stop well before their cap (`batchinfer estimate` shows both).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String, cast, literal, select, update
from sqlalchemy.orm import Session

from batchinfer.store.db import rowcount
from batchinfer.store.errors import JobError
from batchinfer.store.models import LINE_BITS, Job, Request, RequestStatus, Shard, ShardStatus, request_id_for
from batchinfer.wire.result_row import ErrorRow, ResultRow

BUDGET_EXCEEDED = "budget_exceeded"
MAX_BUDGET = 2**62  # fits a BIGINT with room to add


def check_budget(max_total_tokens: int | None) -> int | None:
    """The budget as given at submit, or JobError naming the field and the fix."""
    if max_total_tokens is None:
        return None
    if isinstance(max_total_tokens, bool) or not isinstance(max_total_tokens, int) \
            or not 1 <= max_total_tokens <= MAX_BUDGET:
        raise JobError(f"max_total_tokens must be an integer from 1 to {MAX_BUDGET} "
                       f"(got {max_total_tokens!r}); omit it for no budget")
    return max_total_tokens


def _message(job: Job) -> str:
    return (f"the batch's token budget max_total_tokens={job.max_total_tokens} is spent; finished lines are "
            "kept; submit the remaining lines again, or with a larger --max-total-tokens")


def within_budget(session: Session, *, job: Job, results: list[ResultRow]) -> tuple[list[ResultRow], bool]:
    """The results to record, those past the budget turned into `budget_exceeded` errors, and whether the
    budget is spent. The job row is locked by the caller; its token counters are read afresh."""
    if job.max_total_tokens is None:
        return results, False
    used = session.execute(select(Job.prompt_tokens + Job.completion_tokens).where(Job.id == job.id)).scalar()
    left = job.max_total_tokens - int(used or 0)
    kept: list[ResultRow] = []
    spent = left <= 0
    for result in results:
        if "error" in result:
            kept.append(result)
            continue
        if not spent:
            # .get: apply_results checks the rows after this (a malformed one raises there, not here)
            tokens = int(result.get("prompt_tokens") or 0) + int(result.get("completion_tokens") or 0)
            if tokens <= left:
                left -= tokens
                kept.append(result)
                continue
            spent = True
        line = result["request_id"] & ((1 << LINE_BITS) - 1)
        kept.append(ErrorRow(request_id=result["request_id"],
                             error={"code": BUDGET_EXCEEDED, "message": f"line {line}: {_message(job)}"}))
    return kept, spent or left <= 0


def stop_spent_job(session: Session, *, job: Job, now: datetime) -> int:
    """Error every still-pending line of a job whose budget is spent and complete its unclaimed shards;
    returns how many lines were errored. In the caller's transaction (job row locked)."""
    message = literal("line ") + cast(Request.line_number, String) + literal(f": {_message(job)}")
    lines = Request.id.between(request_id_for(job.id, 0), request_id_for(job.id + 1, 0) - 1)  # primary key
    errored = rowcount(session.execute(
        update(Request).where(lines, Request.status == RequestStatus.PENDING)
        .values(status=RequestStatus.ERRORED, error_code=BUDGET_EXCEEDED, error_message=message,
                finished_at=now)
        .execution_options(synchronize_session=False)))
    if errored:
        session.execute(update(Job).where(Job.id == job.id)
                        .values(failed_requests=Job.failed_requests + errored)
                        .execution_options(synchronize_session=False))
    session.execute(update(Shard).where(Shard.job_id == job.id, Shard.status == ShardStatus.AVAILABLE)
                    .values(status=ShardStatus.COMPLETED, completed_at=now)
                    .execution_options(synchronize_session=False))
    return errored
