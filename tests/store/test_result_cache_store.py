"""store/result_cache.py on SQLite and PostgreSQL: first body kept (refresh replaces), LRU eviction within
result_cache_max_bytes, the retention purge drops unused bodies, modes checked naming the field."""

from __future__ import annotations

from datetime import timedelta

import pytest

from batchinfer.config import Settings
from batchinfer.store import result_cache as cache_store
from batchinfer.store.errors import JobError
from batchinfer.store.models import utcnow
from batchinfer.store.retention import purge

MIB = 1 << 20


def _row(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
            "prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0, "model": "m"}


def test_first_body_kept_refresh_replaces(session) -> None:
    cache_store.store_bodies(session, rows={"k1": _row("first")}, computed_in=1, replace=False, max_bytes=MIB)
    cache_store.store_bodies(session, rows={"k1": _row("second")}, computed_in=2, replace=False,
                             max_bytes=MIB)
    found = cache_store.lookup(session, keys=["k1", "absent"])
    assert list(found) == ["k1"]
    assert found["k1"].row["choices"][0]["text"] == "first" and found["k1"].computed_in == 1
    cache_store.store_bodies(session, rows={"k1": _row("third")}, computed_in=3, replace=True, max_bytes=MIB)
    found = cache_store.lookup(session, keys=["k1"])
    assert found["k1"].row["choices"][0]["text"] == "third" and found["k1"].computed_in == 3


def test_least_recently_used_goes_first(session) -> None:
    start = utcnow() - timedelta(hours=1)
    for i in range(4):
        cache_store.store_bodies(session, rows={f"k{i}": _row("x" * 50)}, computed_in=1, replace=False,
                                 max_bytes=MIB, now=start + timedelta(minutes=i))
    cache_store.lookup(session, keys=["k0"])  # used now: the newest
    _, size = cache_store.cache_size(session)
    assert cache_store.evict(session, max_bytes=size // 2) == 2
    assert sorted(cache_store.lookup(session, keys=[f"k{i}" for i in range(4)])) == ["k0", "k3"]
    # a store beyond the bound evicts right away; a body larger than the bound is never kept
    cache_store.store_bodies(session, rows={"big": _row("y" * 5000)}, computed_in=1, replace=False,
                             max_bytes=size)
    assert "big" not in cache_store.lookup(session, keys=["big"])
    assert cache_store.cache_size(session)[1] <= size


def test_retention_purge_drops_unused_bodies(session, tmp_path) -> None:
    settings = Settings(data_dir=tmp_path, finished_job_retention_seconds=3600)
    old = utcnow() - timedelta(hours=2)
    cache_store.store_bodies(session, rows={"old": _row("a")}, computed_in=1, replace=False,
                             max_bytes=MIB, now=old)
    cache_store.store_bodies(session, rows={"new": _row("b")}, computed_in=1, replace=False, max_bytes=MIB)
    report = purge(session, settings=settings)
    assert report.result_bodies == 1
    assert list(cache_store.lookup(session, keys=["old", "new"])) == ["new"]


def test_mode_is_checked_naming_the_field() -> None:
    assert cache_store.check_mode("refresh") == "refresh"
    with pytest.raises(JobError, match="result_cache must be one of use, refresh, off; got 'sometimes'"):
        cache_store.check_mode("sometimes")
