"""Fair share across owners: the order in which claim_shard hands out shards, and the ledger it reads.

The rule (README "Scheduling"), applied by one ORDER BY inside the claim statement:

1. owners first by their weighted recent usage: tokens served to the owner over the last
   `window_seconds` (owner_served, one row per owner and minute) divided by its weight (the highest
   `weight` of its unrevoked API keys; 1 for an owner without keys, e.g. the CLI's `local`). This is
   deficit round robin with the deficit measured in tokens: the owner served least for its weight is next;
2. then by the owner's shards running now, divided by its weight (before any token is written, a second
   owner is not starved by the first one's freshly claimed shards);
3. within an owner: `priority` (lower first, vLLM's convention), then the earliest deadline
   (jobs.expires_at = created_at + completion_window), then the oldest shard.

Served tokens are recorded with each write of results (shards.write_results), in the same transaction.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnExpressionArgument, Float, Select, cast, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from batchinfer.store.db import is_sqlite, rowcount
from batchinfer.store.models import ApiKey, Job, OwnerServed, Shard, ShardStatus
from batchinfer.wire.result_row import ResultRow

FAIR_SHARE_WINDOW_S = 600.0  # how far back tokens served count: long enough to smooth, short enough to forget
MINUTE_S = 60


def minute_of(now: datetime) -> int:
    """The ledger's bucket of `now`: unix minutes."""
    return int(now.timestamp()) // MINUTE_S


def record_served(session: Session, *, owner: str, tokens: int, now: datetime) -> None:
    """In the caller's transaction: add `tokens` served to `owner` in `now`'s minute (an upsert)."""
    if tokens <= 0:
        return
    insert = sqlite_insert if is_sqlite(session) else pg_insert
    statement = insert(OwnerServed).values(owner=owner, minute=minute_of(now), tokens=tokens)
    session.execute(statement.on_conflict_do_update(
        index_elements=[OwnerServed.owner, OwnerServed.minute],
        set_={"tokens": OwnerServed.tokens + statement.excluded.tokens}))


def served_tokens(results: list[ResultRow]) -> int:
    """Tokens a batch of results served: prompt tokens not read from the cache, plus generated tokens
    (after apply_results, which has checked every row's counts)."""
    return sum(max(result["prompt_tokens"] - result["cached_tokens"], 0) + result["completion_tokens"]
               for result in results if "error" not in result)


def prune_served(session: Session, *, now: datetime, window_seconds: float = FAIR_SHARE_WINDOW_S) -> int:
    """In the caller's transaction: delete ledger minutes older than the window; returns how many."""
    oldest = minute_of(now) - int(window_seconds // MINUTE_S) - 1
    return rowcount(session.execute(delete(OwnerServed).where(OwnerServed.minute < oldest)
                           .execution_options(synchronize_session=False)))


def owner_weight(session: Session, *, owner: str) -> float:
    """The owner's weight: the highest of its unrevoked keys' weights, 1 without keys."""
    weight = session.scalar(select(func.max(ApiKey.weight)).where(ApiKey.owner == owner,
                                                                  ApiKey.revoked_at.is_(None)))
    return float(weight) if weight else 1.0


def fair_order(pick: Select, *, now: datetime, window_seconds: float = FAIR_SHARE_WINDOW_S
               ) -> tuple[Select, list[ColumnExpressionArgument[object]]]:
    """Join `pick` (a select over shards) with what the rule needs; returns it and its ORDER BY terms."""
    since = minute_of(now) - int(window_seconds // MINUTE_S)
    usage = (select(OwnerServed.owner, func.sum(OwnerServed.tokens).label("tokens"))
             .where(OwnerServed.minute >= since).group_by(OwnerServed.owner).subquery("usage"))
    weights = (select(ApiKey.owner, func.max(ApiKey.weight).label("weight"))
               .where(ApiKey.revoked_at.is_(None)).group_by(ApiKey.owner).subquery("weights"))
    running_job, running_shard = Job.__table__.alias("running_job"), Shard.__table__.alias("running_shard")
    running = (select(running_job.c.owner, func.count().label("shards"))
               .select_from(running_shard.join(running_job, running_job.c.id == running_shard.c.job_id))
               .where(running_shard.c.status == ShardStatus.RUNNING)
               .group_by(running_job.c.owner).subquery("running"))
    pick = (pick.join(Job, Job.id == Shard.job_id)
            .outerjoin(usage, usage.c.owner == Job.owner)
            .outerjoin(weights, weights.c.owner == Job.owner)
            .outerjoin(running, running.c.owner == Job.owner))
    weight = func.coalesce(weights.c.weight, 1.0)
    order: list[ColumnExpressionArgument[object]] = [cast(func.coalesce(usage.c.tokens, 0), Float) / weight,
             cast(func.coalesce(running.c.shards, 0), Float) / weight,
             Shard.priority, Job.expires_at.asc().nulls_last(), Shard.id]
    return pick, order
