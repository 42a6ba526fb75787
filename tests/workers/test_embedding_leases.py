"""A long embeddings forward must not cost the other shards a worker holds their leases (issue 28 item 6):
with a 2 s lease, a forward that computes for three leases while the rescuer runs every 0.2 s beside it
leaves every shard with its first attempt, nothing rescued, and another tenant's chat job complete."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from sqlalchemy import select

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job, submit_job
from batchinfer.store.models import Shard
from tests.workers.helpers import write_requests
from workers.process import make_runner, rescue_once

pytestmark = pytest.mark.integration
LEASE_S = 2.0


def test_long_embeddings_forward_keeps_other_shards_leases(sqlite_url: str, tiny_llama: Path,
                                                           tmp_path: Path) -> None:
    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path, lease_seconds=LEASE_S, max_attempts=1)
    sessions = session_factory(sqlite_url)
    chat = tmp_path / "chat.jsonl"
    chat_ids = write_requests(chat, 6, max_tokens=12)
    embeddings = tmp_path / "embeddings.jsonl"
    embeddings.write_bytes(orjson.dumps({"custom_id": "emb", "method": "POST", "url": "/v1/embeddings",
                                         "body": {"input": ["a long document", "another one"]}}) + b"\n")
    with sessions() as session:
        chat_job = submit_job(session, settings=settings, path=chat, model=str(tiny_llama), owner="tenant-a")
        embedding_job = submit_job(session, settings=settings, path=embeddings, model=str(tiny_llama),
                                   owner="tenant-b")
    runner = make_runner(model=str(tiny_llama), settings=settings, max_num_seqs=4, device="cpu",
                         dtype="float32")
    model_runner = runner.engine.model_runner
    real_embed = model_runner.embed
    rescues = []

    def slow_embed(token_id_lists: list[list[int]]) -> list[list[float]]:
        """The first forward computes for three leases; the rescuer runs beside it as beat would."""
        deadline = time.monotonic() + (0 if rescues else 3 * LEASE_S)
        while time.monotonic() < deadline:
            rescues.append(rescue_once(settings))
            time.sleep(0.2)
        return real_embed(token_id_lists)

    model_runner.embed = slow_embed
    runner.work()

    assert rescues and not any(report.requeued or report.failed for report in rescues)
    assert runner._keeper.extensions > 0  # the keeper, not luck, held the leases
    with sessions() as session:
        counts = get_job(session, job_id=chat_job.id).request_counts
        assert counts == {"total": 6, "completed": 6, "failed": 0}
        assert get_job(session, job_id=embedding_job.id).request_counts["completed"] == 1
        attempts = session.scalars(select(Shard.attempt).where(
            Shard.job_id.in_([chat_job.id, embedding_job.id]))).all()
        done = [orjson.loads(line)["custom_id"] for line in export_results(session, job_id=chat_job.id)]
    assert set(attempts) == {1}
    assert sorted(done) == chat_ids
