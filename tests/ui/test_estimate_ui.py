"""The estimate made at submit (issue 32): the batch object's `estimate` (what `submit --json` prints) and
the dashboard's batch page (expected seconds, expected output tokens, basis), beside the ETA that refines
it once the batch runs."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from batchinfer.api.app import create_app
from batchinfer.api.ui.views import duration
from batchinfer.config import Settings
from batchinfer.store.apikeys import create_key
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.jobs import get_job, submit_job
from batchinfer.store.shards import ShardLease, claim_shard, complete_shard, pending_requests, write_results
from batchinfer.store.workers import register_worker
from tests.workers.helpers import write_requests

HTMX = {"HX-Request": "true"}
COMPLETION = 3  # tokens each finished request generated (of its max_tokens 6 to 8)


def _finish(session: Session, lease: ShardLease, *, complete: bool = True) -> None:
    rows = [{"request_id": request.request_id, "prompt_tokens": 20, "completion_tokens": COMPLETION,
             "cached_tokens": 0, "choices": [{"text": "abc", "finish_reason": "stop"}]}
            for request in pending_requests(session, shard_id=lease.shard_id)]
    write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token, results=rows)
    if complete:
        complete_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token)


def test_the_batch_page_shows_the_estimate_made_at_submit_and_the_eta_refining_it(
        tmp_path: Path, sqlite_url: str) -> None:
    upgrade(sqlite_url)
    settings = Settings(data_dir=tmp_path / "data", database_url=sqlite_url, default_model="m", shard_size=4)
    sessions = session_factory(sqlite_url)
    with sessions() as session:
        key, _ = create_key(session, name="alice", owner="alice")
    client = TestClient(create_app(settings, auth_cache_ttl_s=0))
    client.post("/ui/login", data={"api_key": key})
    write_requests(tmp_path / "in.jsonl", 8)  # max_tokens 6, 7, 8, 6, ...: caps 54
    caps = sum(6 + i % 3 for i in range(8))

    with sessions() as session:  # no history yet: the caps, stated as an assumption; seconds unknown
        first = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model="m", owner="alice")
    assert first.estimate["max_output_tokens"] == first.estimate["expected_output_tokens"] == caps
    assert first.estimate["expected_seconds"] is None and first.estimate["prompt_tokens"] is None
    assert any(line.startswith("assumption:") for line in first.estimate["basis"])

    with sessions() as session:  # the first job finishes (history), and a worker of the model is live
        while (lease := claim_shard(session, worker_id="w", model="m", lease_seconds=600)) is not None:
            _finish(session, lease)
        assert get_job(session, job_id=first.id).status == "completed"
        register_worker(session, worker_id="w1", model="m")
        second = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model="m", owner="alice")
    estimate = second.estimate
    assert estimate["expected_output_tokens"] == 8 * COMPLETION  # the share finished requests used
    assert estimate["expected_seconds"] is not None and estimate["live_workers"] == 1

    batch = client.get(f"/v1/batches/batch_{second.id}", headers={"Authorization": f"Bearer {key}"}).json()
    assert batch["estimate"] == estimate  # the REST batch object (and `submit --json`) carries it
    status = client.get(f"/ui/batches/batch_{second.id}/status", headers=HTMX).text
    shown = duration(estimate["expected_seconds"])
    assert f'id="estimate">{shown}, {8 * COMPLETION} output tokens<' in status
    assert "estimate: output: finished requests of m used" in status  # the basis
    assert 'id="eta">\u2014<' in status  # not running yet: no ETA

    with sessions() as session:  # once it runs, the ETA refines the estimate
        _finish(session, claim_shard(session, worker_id="w1", model="m", lease_seconds=600), complete=False)
    status = client.get(f"/ui/batches/batch_{second.id}/status", headers=HTMX).text
    assert 'id="eta">\u2014<' not in status and 'id="estimate">' in status
