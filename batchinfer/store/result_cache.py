"""The result cache across jobs: content-addressed result bodies in the job database (issue 31).

A body is stored once per key (`ResultBody`, the sha256 of everything that decides a deterministic
request's output: workers/result_cache.py builds it) and served to every later request with that key, of
any job of the same scope (the owner's by default, `prefix_cache_scope`). What the store keeps true:

- a cacheable success's request row keeps no copy of its body: it holds the body's key (`result_key`,
  response NULL) and store/responses.py renders its response from the body with the row's own id,
  created time and provenance. `attach_bodies` stores a body in the same transaction that writes the rows
  referencing it, so a row never references a body that is not there;
- a body referenced by a request row is pinned: eviction beyond `result_cache_max_bytes` (least recently
  used first) and the retention purge (unused for `finished_job_retention_seconds`) skip it; it counts
  toward the bound (`cache_size`), and once the rows referencing it are purged it is evictable again;
- a `refresh` job replacing a body an earlier job's rows reference first moves the old body, with those
  rows, to its archive key (`archive_key`), so an earlier job's output never changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal, get_args

import orjson
from sqlalchemy import ColumnElement, delete, exists, func, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from batchinfer.store.db import end_transaction, is_sqlite, rowcount, write_transaction
from batchinfer.store.errors import JobError
from batchinfer.store.models import Job, Request, ResultBody, utcnow
from batchinfer.wire.result_row import BodyRef, RowBody

ResultCacheMode = Literal["use", "refresh", "off"]
RESULT_CACHE_MODES: tuple[str, ...] = get_args(ResultCacheMode)
LOOKUP_BATCH = 500  # keys per IN (...) (SQLite caps bound parameters per statement)


@dataclass(frozen=True)
class CachedBody:
    """A body found in the cache: the result row it stores (parsed, and as stored), its computing job."""

    key: str
    row: RowBody  # as the worker stored it (wire/result_row.py), parsed
    computed_in: int
    body: bytes = b""


def is_referenced() -> ColumnElement[bool]:
    """True for a body some request row references (pinned: neither evicted nor purged)."""
    return exists().where(Request.result_key == ResultBody.key)


def archive_key(key: str, computed_in: int) -> str:
    """Where a replaced body that rows still reference lives on: never a request's key (another preimage)."""
    return hashlib.sha256(f"{key}/computed_in:{computed_in}".encode()).hexdigest()


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
            found[key] = CachedBody(key, orjson.loads(body), computed_in, bytes(body))
    end_transaction(session)
    if found:
        touched = sorted(found)
        with write_transaction(session):
            for start in range(0, len(touched), LOOKUP_BATCH):
                part = touched[start:start + LOOKUP_BATCH]
                session.execute(update(ResultBody).where(_unlocked(ResultBody.key.in_(part)))
                                .values(last_used_at=now or utcnow())
                                .execution_options(synchronize_session=False))
    return found


def attach_bodies(session: Session, *, refs: Sequence[BodyRef], job_id: int, refresh: bool,
                  now: datetime | None = None) -> dict[str, int]:
    """In the caller's write transaction: store each offered body under its key unless one is there
    (a `refresh` job's own bodies replace an earlier job's: `_replace`), mark it used, and return for
    every key the job whose body it holds now. A row may reference its key only when that is the job
    that computed the row's body; the rows referencing a body are written in this same transaction, so
    it is never evicted in between (eviction only deletes a body not touched since it looked).

    Rows are locked in key order, one order for every writer, so two writers never deadlock; eviction,
    the purge and lookups skip a locked row instead of waiting for it."""
    by_key: dict[str, BodyRef] = {}
    for ref in refs:
        by_key.setdefault(ref.key, ref)
    if not by_key:
        return {}
    now = now or utcnow()
    insert = sqlite_insert if is_sqlite(session) else postgresql_insert
    statement = insert(ResultBody)
    # DO UPDATE (not NOTHING): the touch locks the row (PostgreSQL), and moves last_used_at past what
    # a concurrent eviction saw, so its guarded DELETE skips a body about to be referenced.
    statement = statement.on_conflict_do_update(index_elements=["key"],
                                                set_={"last_used_at": statement.excluded.last_used_at})
    keys = sorted(by_key)
    values = [{"key": key, "body": by_key[key].body, "size": len(by_key[key].body), "created_at": now,
               "computed_in": by_key[key].computed_in, "last_used_at": now} for key in keys]
    if refresh:  # one key at a time, still in key order: its old body (if any) leaves first
        for key, value in zip(keys, values, strict=True):
            if by_key[key].computed_in == job_id:
                _replace(session, key, job_id=job_id)
            session.execute(statement, [value])
    else:
        session.execute(statement, values)  # one INSERT, its rows in key order
    held: dict[str, int] = {}
    for start in range(0, len(keys), LOOKUP_BATCH):
        part = keys[start:start + LOOKUP_BATCH]
        held.update(session.execute(select(ResultBody.key, ResultBody.computed_in)
                                    .where(ResultBody.key.in_(part))).tuples().all())
    return held


def _replace(session: Session, key: str, *, job_id: int) -> None:
    """A refresh job's body replaces an earlier job's: an old body no row references goes; one that rows
    reference moves, with them, to its archive key, so their output stays what it was."""
    query = select(ResultBody.computed_in).where(ResultBody.key == key, ResultBody.computed_in != job_id)
    computed_in = session.scalar(query.with_for_update())  # no row starts referencing it while it moves
    if computed_in is None:
        return
    referenced = session.scalar(select(exists().where(Request.result_key == key)))
    archive = archive_key(key, computed_in)
    if referenced and not session.scalar(select(exists().where(ResultBody.key == archive))):
        session.execute(update(ResultBody).where(ResultBody.key == key).values(key=archive))
    else:  # unreferenced, or archived before (the same job's body under the same key)
        session.execute(delete(ResultBody).where(ResultBody.key == key))
    if referenced:
        session.execute(update(Request).where(Request.result_key == key).values(result_key=archive))


def _unlocked(*conditions: ColumnElement[bool]) -> ColumnElement[bool]:
    """Bodies matching `conditions` that no writer holds now (PostgreSQL: SKIP LOCKED; SQLite writers
    take turns): eviction, the purge and the LRU touch never wait on, nor deadlock with, attach_bodies."""
    held_by_none = select(ResultBody.key).where(*conditions).with_for_update(skip_locked=True)
    return ResultBody.key.in_(held_by_none.scalar_subquery())


def evict(session: Session, *, max_bytes: int) -> int:
    """Delete least recently used bodies no row references until all bodies hold at most `max_bytes`
    (referenced ones are pinned: the total may stay above it); returns how many went."""
    total = int(session.scalar(select(func.coalesce(func.sum(ResultBody.size), 0))) or 0)
    end_transaction(session)
    if total <= max_bytes:
        return 0
    gone: list[tuple[str, datetime]] = []
    candidates = (select(ResultBody.key, ResultBody.size, ResultBody.last_used_at).where(~is_referenced())
                  .order_by(ResultBody.last_used_at, ResultBody.key))
    for key, size, last_used in session.execute(candidates):
        if total <= max_bytes:
            break
        gone.append((key, last_used))
        total -= size
    end_transaction(session)
    deleted = 0
    with write_transaction(session):
        for start in range(0, len(gone), LOOKUP_BATCH):
            part = gone[start:start + LOOKUP_BATCH]
            # guarded: a body touched (attach_bodies) or referenced since it was looked at stays
            deleted += rowcount(session.execute(delete(ResultBody).where(_unlocked(
                ResultBody.key.in_([key for key, _ in part]),
                ResultBody.last_used_at <= max(last_used for _, last_used in part), ~is_referenced()))
                .execution_options(synchronize_session=False)))
    return deleted


def purge_unused(session: Session, *, older_than_s: float | None, now: datetime | None = None) -> int:
    """The retention purge's part: bodies unused for `older_than_s` seconds that no row references go
    (None: kept)."""
    if older_than_s is None:
        return 0
    cutoff = (now or utcnow()) - timedelta(seconds=older_than_s)
    with write_transaction(session):
        return rowcount(session.execute(delete(ResultBody).where(_unlocked(ResultBody.last_used_at <= cutoff,
                                                                           ~is_referenced()))
                                        .execution_options(synchronize_session=False)))


def cache_size(session: Session, *, pinned: bool = False) -> tuple[int, int]:
    """(bodies, bytes) the cache holds now, referenced ones included (the bytes gauge of /metrics);
    `pinned`: only those a request row references (never evicted)."""
    query = select(func.count(), func.coalesce(func.sum(ResultBody.size), 0)).select_from(ResultBody)
    if pinned:
        query = query.where(is_referenced())
    count, size = session.execute(query).one()
    end_transaction(session)
    return int(count), int(size)
