"""store/result_cache.py on SQLite and PostgreSQL: first body kept (refresh replaces), LRU eviction within
result_cache_max_bytes, the retention purge drops unused bodies, modes checked naming the field."""

from __future__ import annotations

from datetime import datetime, timedelta

import orjson
import pytest
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.store import result_cache as cache_store
from batchinfer.store.db import write_transaction
from batchinfer.store.errors import JobError
from batchinfer.store.models import utcnow
from batchinfer.store.retention import purge
from batchinfer.wire.result_row import BodyRef

MIB = 1 << 20


def _row(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
            "prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0, "model": "m"}


def _attach(session: Session, key: str, text: str, *, computed_in: int = 1, refresh: bool = False,
            now: datetime | None = None) -> dict[str, int]:
    """Offer one body the way store/results.py does when it writes rows (no row references it here)."""
    with write_transaction(session):
        return cache_store.attach_bodies(session, refs=[BodyRef(key, orjson.dumps(_row(text)), computed_in)],
                                         job_id=computed_in, refresh=refresh, now=now)


def test_first_body_kept_refresh_replaces(session) -> None:
    assert _attach(session, "k1", "first") == {"k1": 1}
    assert _attach(session, "k1", "second", computed_in=2) == {"k1": 1}  # kept: job 2's rows keep copies
    found = cache_store.lookup(session, keys=["k1", "absent"])
    assert list(found) == ["k1"]
    assert found["k1"].row["choices"][0]["text"] == "first" and found["k1"].computed_in == 1
    assert _attach(session, "k1", "third", computed_in=3, refresh=True) == {"k1": 3}
    found = cache_store.lookup(session, keys=["k1"])
    assert found["k1"].row["choices"][0]["text"] == "third" and found["k1"].computed_in == 3
    assert orjson.loads(found["k1"].body) == found["k1"].row


def test_least_recently_used_goes_first(session) -> None:
    start = utcnow() - timedelta(hours=1)
    for i in range(4):
        _attach(session, f"k{i}", "x" * 50, now=start + timedelta(minutes=i))
    cache_store.lookup(session, keys=["k0"])  # used now: the newest
    _, size = cache_store.cache_size(session)
    assert cache_store.evict(session, max_bytes=size // 2) == 2
    assert sorted(cache_store.lookup(session, keys=[f"k{i}" for i in range(4)])) == ["k0", "k3"]
    assert cache_store.evict(session, max_bytes=0) == 2
    assert cache_store.cache_size(session) == (0, 0)


def test_retention_purge_drops_unused_bodies(session, tmp_path) -> None:
    settings = Settings(data_dir=tmp_path, finished_job_retention_seconds=3600)
    _attach(session, "old", "a", now=utcnow() - timedelta(hours=2))
    _attach(session, "new", "b")
    report = purge(session, settings=settings)
    assert report.result_bodies == 1
    assert list(cache_store.lookup(session, keys=["old", "new"])) == ["new"]


def test_mode_is_checked_naming_the_field() -> None:
    assert cache_store.check_mode("refresh") == "refresh"
    with pytest.raises(JobError, match="result_cache must be one of use, refresh, off; got 'sometimes'"):
        cache_store.check_mode("sometimes")
