"""Honest progress: a job's tokens/s and ETA from the tokens generated so far and the requests' budgets.

Counting finished requests only misleads: requests of one batch run side by side and finish together at
the end, so a job showed 0 tok/s and no ETA for most of its run, then a wild one. Instead each worker
reports, with every shard heartbeat, what its in-flight requests of that shard have generated so far and
the most they may generate (n x max_tokens each, as the engine resolved it): `InflightReport`, kept on the
shard row (store.shards.heartbeat). A job's progress then reads

- generated = the tokens of finished requests (Job.completion_tokens) + those in flight;
- throughput = generated / time since the first claim (an average: a worker's current rate is the worker
  table's);
- remaining = the in-flight requests' budget left (they outlived the finished ones: the short requests
  finish first) + the unclaimed requests' budget (at the in-flight mean budget per request) scaled by the
  share of their budget finished requests used (their expected length: a model that stops at EOS uses
  less than max_tokens; before any finished, all of it);
- ETA = remaining / throughput, but no less than the critical path: the time the longest in-flight request
  needs at its engine's pace (one token per step, whatever the batch: a job's tail of a few long requests
  runs far below the average throughput); for requests that generate nothing (embeddings), the requests'
  own pace.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchinfer.store.db import end_transaction
from batchinfer.store.models import Shard, ShardStatus, utcnow


@dataclass(frozen=True, slots=True)
class InflightReport:
    """What a worker's generation requests of one shard (or all of a job's shards) are doing right now."""

    requests: int = 0  # generation requests in the engine, running or queued there
    tokens: int = 0  # tokens they have generated so far (not yet written as results)
    budget: int = 0  # the most tokens they may generate in all: n x max_tokens each, >= tokens
    critical_s: float = 0.0  # the seconds the longest of them needs: its budget left / its engine's steps/s


@dataclass(frozen=True, slots=True)
class Estimate:
    """A job's measured progress in tokens."""

    generated_tokens: int  # finished requests' tokens + in-flight ones
    tokens_per_second: float | None  # generated / seconds since the first claim; None before a claim
    remaining_tokens: int | None  # expected tokens still to generate; None when nothing tells yet
    eta_seconds: float | None  # remaining / tokens_per_second; None until tokens were generated


def inflight_by_job(session: Session, *, job_ids: Collection[int],
                    now: datetime | None = None) -> dict[int, InflightReport]:
    """job id -> the sum of its running shards' last heartbeat reports (jobs with none are absent); the
    critical path counts from `now` (a shard stores when its longest request should end)."""
    if not job_ids:
        return {}
    now_s = (now or utcnow()).timestamp()
    rows = session.execute(
        select(Shard.job_id, func.sum(Shard.inflight_requests), func.sum(Shard.inflight_tokens),
               func.sum(Shard.inflight_budget), func.max(Shard.inflight_finish_at))
        .where(Shard.job_id.in_(sorted(job_ids)), Shard.status == ShardStatus.RUNNING)
        .group_by(Shard.job_id)).all()
    end_transaction(session)
    return {job_id: InflightReport(requests=int(requests or 0), tokens=int(tokens or 0),
                                   budget=int(budget or 0), critical_s=max(float(finish or 0) - now_s, 0.0))
            for job_id, requests, tokens, budget, finish in rows}


def estimate(*, total: int, done: int, worker_done: int, finished_tokens: int, inflight: InflightReport,
             elapsed_s: float | None, running: bool) -> Estimate:
    """The job's progress in tokens (the module docstring has the rule).

    `done`: requests finished in any way (ingest errors included); `worker_done`: those a worker finished,
    whose `finished_tokens` measure the expected length. No ETA unless `running` with work left.
    """
    generated = finished_tokens + inflight.tokens
    if elapsed_s is None:
        return Estimate(generated, None, None, None)
    rate = generated / max(elapsed_s, 1e-6)
    left = total - done
    if not running or left <= 0:
        return Estimate(generated, round(rate, 2), 0 if left <= 0 else None, None)
    if generated == 0 and worker_done > 0:  # requests that generate nothing (embeddings): their own pace
        return Estimate(0, 0.0, 0, round(elapsed_s * left / worker_done, 1))
    unclaimed = max(left - inflight.requests, 0)
    cap = inflight.budget / inflight.requests if inflight.requests else None
    mean = finished_tokens / worker_done if worker_done > 0 else None
    if cap is None and mean is None:
        return Estimate(generated, round(rate, 2), None, None)
    used = 1.0 if cap is None or mean is None else min(1.0, mean / max(cap, 1.0))
    per_request = cap * used if cap is not None else (mean or 0.0)  # not both None: returned above
    # Requests still running are those that outlived the ones finished (the short ones finish first), so
    # their budget left is expected in full; the unclaimed ones are like the finished ones.
    remaining = max(inflight.budget - inflight.tokens, 0) + unclaimed * per_request
    eta = max(remaining / rate, inflight.critical_s) if rate > 0 else None
    return Estimate(generated, round(rate, 2), round(remaining), None if eta is None else round(eta, 1))
