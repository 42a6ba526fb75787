"""The result cache across jobs: content-addressed result bodies in the job database (issue 31).

A body is stored once per key (`ResultBody`, the sha256 of everything that decides a deterministic
request's output: workers/result_cache.py builds it) and served to every later request with that key, of
any job of the same scope (the owner's by default, `prefix_cache_scope`). What the store keeps true:

- a body is inserted once per key (`refresh` replaces it); a lookup touches `last_used_at`, so eviction
  beyond `result_cache_max_bytes` drops the least recently used; bodies unused for
  `finished_job_retention_seconds` go with the retention purge;
- a job's request rows keep their own response (the output file never depends on the cache): evicting or
  purging a body only means the next request with its key computes it again.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, get_args

import orjson
from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from batchinfer.store.db import end_transaction, is_sqlite, rowcount, write_transaction
from batchinfer.store.errors import JobError
from batchinfer.store.models import Job, ResultBody, utcnow

ResultCacheMode = Literal["use", "refresh", "off"]
RESULT_CACHE_MODES: tuple[str, ...] = get_args(ResultCacheMode)
# Where an output line's body came from (its provenance.result_cache).
ResultSource = Literal["miss", "hit", "dedup"]
LOOKUP_BATCH = 500  # keys per IN (...) (SQLite caps bound parameters per statement)


@dataclass(frozen=True)
class CachedBody:
    """A body found in the cache: the result row it stores and the job that computed it."""

    key: str
    row: dict[str, Any]
    computed_in: int


def check_mode(value: object, *, field: str = "result_cache") -> str:
    """The mode `value` names; JobError naming the field and the choices otherwise."""
    if value not in RESULT_CACHE_MODES:
        raise JobError(f"{field} must be one of {', '.join(RESULT_CACHE_MODES)}; got {value!r}")
    return str(value)


def job_mode(session: Session, *, job_id: int) -> str:
    """The job's result_cache mode (`use` for a job that is gone: nothing of it runs anyway)."""
    mode = session.scalar(select(Job.result_cache).where(Job.id == job_id))
    end_transaction(session)
    return mode or "use"


def lookup(session: Session, *, keys: Collection[str], now: datetime | None = None) -> dict[str, CachedBody]:
    """The cached bodies of `keys` (those present), marked used now (least recently used goes first)."""
    wanted = sorted(set(keys))
    found: dict[str, CachedBody] = {}
    for start in range(0, len(wanted), LOOKUP_BATCH):
        part = wanted[start:start + LOOKUP_BATCH]
        query = (select(ResultBody.key, ResultBody.body, ResultBody.computed_in)
                 .where(ResultBody.key.in_(part)))
        for key, body, computed_in in session.execute(query):
            found[key] = CachedBody(key, orjson.loads(body), computed_in)
    end_transaction(session)
    if found:
        touched = sorted(found)
        with write_transaction(session):
            for start in range(0, len(touched), LOOKUP_BATCH):
                part = touched[start:start + LOOKUP_BATCH]
                session.execute(update(ResultBody).where(ResultBody.key.in_(part))
                                .values(last_used_at=now or utcnow()))
    return found


def store_bodies(session: Session, *, rows: dict[str, dict[str, Any]], computed_in: int, replace: bool,
                 max_bytes: int, evict_now: bool = True, now: datetime | None = None) -> int:
    """Insert the result rows of `rows` (key -> row) computed by job `computed_in`; a key already present
    keeps its first body unless `replace` (a `refresh` job). Then (`evict_now`) evict beyond `max_bytes`.
    Returns the bytes of the bodies offered (kept or already there)."""
    if not rows or max_bytes <= 0:
        return 0
    now = now or utcnow()
    values: list[dict[str, Any]] = []  # the insert's rows, by column
    for key, row in sorted(rows.items()):
        body = orjson.dumps(row)
        if len(body) <= max_bytes:  # a body larger than the whole cache is never kept
            values.append({"key": key, "body": body, "size": len(body), "computed_in": computed_in,
                           "created_at": now, "last_used_at": now})
    if not values:
        return 0
    insert = sqlite_insert if is_sqlite(session) else postgresql_insert
    statement = insert(ResultBody)
    if replace:
        excluded = statement.excluded
        statement = statement.on_conflict_do_update(index_elements=["key"], set_={
            "body": excluded.body, "size": excluded.size, "computed_in": excluded.computed_in,
            "created_at": excluded.created_at, "last_used_at": excluded.last_used_at})
    else:
        statement = statement.on_conflict_do_nothing(index_elements=["key"])
    with write_transaction(session):
        session.execute(statement, values)
    if evict_now:
        evict(session, max_bytes=max_bytes)
    return sum(value["size"] for value in values)


def evict(session: Session, *, max_bytes: int) -> int:
    """Delete least recently used bodies until those left hold at most `max_bytes`; returns how many went."""
    total = int(session.scalar(select(func.coalesce(func.sum(ResultBody.size), 0))) or 0)
    end_transaction(session)
    if total <= max_bytes:
        return 0
    gone: list[str] = []
    for key, size in session.execute(select(ResultBody.key, ResultBody.size)
                                     .order_by(ResultBody.last_used_at, ResultBody.key)):
        if total <= max_bytes:
            break
        gone.append(key)
        total -= size
    end_transaction(session)
    with write_transaction(session):
        for start in range(0, len(gone), LOOKUP_BATCH):
            session.execute(delete(ResultBody).where(ResultBody.key.in_(gone[start:start + LOOKUP_BATCH])))
    return len(gone)


def purge_unused(session: Session, *, older_than_s: float | None, now: datetime | None = None) -> int:
    """The retention purge's part: bodies unused for `older_than_s` seconds go (None: kept)."""
    if older_than_s is None:
        return 0
    cutoff = (now or utcnow()) - timedelta(seconds=older_than_s)
    with write_transaction(session):
        return rowcount(session.execute(delete(ResultBody).where(ResultBody.last_used_at <= cutoff))) or 0


def cache_size(session: Session) -> tuple[int, int]:
    """(bodies, bytes) the cache holds now (the bytes gauge of /metrics)."""
    count, size = session.execute(select(func.count(), func.coalesce(func.sum(ResultBody.size), 0))
                                  .select_from(ResultBody)).one()
    end_transaction(session)
    return int(count), int(size)
