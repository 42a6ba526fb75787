"""The dashboard shows a batch's result-cache hits and dedup copies (issue 31), counted where results are
written: a row's provenance says where its body came from."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from batchinfer.api.app import create_app
from batchinfer.config import Settings
from batchinfer.store.apikeys import create_key
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.jobs import get_job, submit_job
from batchinfer.store.shards import claim_shard, pending_requests, write_results
from tests.workers.helpers import write_requests

HTMX = {"HX-Request": "true"}


def test_the_batch_page_shows_result_cache_hits(tmp_path: Path, sqlite_url: str) -> None:
    upgrade(sqlite_url)
    settings = Settings(data_dir=tmp_path / "data", database_url=sqlite_url, default_model="m", shard_size=4)
    sessions = session_factory(sqlite_url)
    with sessions() as session:
        key, _ = create_key(session, name="alice", owner="alice")
    client = TestClient(create_app(settings, auth_cache_ttl_s=0))
    client.post("/ui/login", data={"api_key": key})
    write_requests(tmp_path / "in.jsonl", 4)
    with sessions() as session:
        job = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model="m", owner="alice")
        lease = claim_shard(session, worker_id="w", model="m", lease_seconds=600)
        assert lease is not None
        rows = []
        for request, source in zip(pending_requests(session, shard_id=lease.shard_id),
                                   ("miss", "hit", "hit", "dedup"), strict=True):
            rows.append({"request_id": request.request_id, "prompt_tokens": 3, "completion_tokens": 1,
                         "cached_tokens": 0, "choices": [{"text": "x", "finish_reason": "stop"}],
                         "result_key": "k" * 64, "provenance": {"result_cache": source}})
        write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token, results=rows)
        job = get_job(session, job_id=job.id)
        assert (job.result_cache_hits, job.result_cache_dedups) == (2, 1)
    status = client.get(f"/ui/batches/batch_{job.id}/status", headers=HTMX).text
    assert 'id="result-cache">2 hits, 1 dedup<' in status
