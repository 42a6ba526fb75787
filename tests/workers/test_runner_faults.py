"""ShardRunner under faults: a request that makes the engine raise, invalid parameters, shutdown."""

from __future__ import annotations

import threading
from pathlib import Path

import orjson

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job, submit_job
from batchinfer.store.models import Shard
from tests.workers.helpers import write_requests
from workers.process import make_runner, run_job

POISON = "poison " * 40


def _setup(url: str, tmp_path: Path, model: Path, extra: list[bytes]) -> tuple:
    upgrade(url)
    settings = Settings(database_url=url, data_dir=tmp_path, write_batch_size=2)
    path = tmp_path / "in.jsonl"
    ids = write_requests(path, 10, extra_lines=extra)
    sessions = session_factory(url)
    with sessions() as session:
        job = submit_job(session, settings=settings, path=path, model=str(model), owner="t", shard_size=4)
    runner = make_runner(model=str(model), settings=settings, max_num_seqs=6, device="cpu",
                         kv_cache_memory_bytes=16 << 20)
    return settings, sessions, job, runner, ids


def test_request_that_makes_the_engine_raise_is_errored_and_the_rest_succeed(
        sqlite_url: str, tmp_path: Path, tiny_llama: Path) -> None:
    poison = orjson.dumps({"custom_id": "poison", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": POISON, "max_tokens": 4}})
    settings, sessions, job, runner, ids = _setup(sqlite_url, tmp_path, tiny_llama, [poison])
    poison_len = len(runner.engine.tokenize(POISON))
    real_execute = runner.engine.model_runner.execute_model

    def execute(scheduled, logits_counts=None, **options):  # noqa: ANN001, ANN003, ANN202 - fault injection
        if any(len(seq.token_ids) >= poison_len for seq, _ in scheduled):
            raise RuntimeError("simulated kernel failure")
        return real_execute(scheduled, logits_counts, **options)

    runner.engine.model_runner.execute_model = execute
    stats = run_job(job_id=job.id, runner=runner)
    assert stats.shards_completed == 3
    with sessions() as session:
        done = get_job(session, job_id=job.id)
        outputs = [orjson.loads(x) for x in export_results(session, job_id=job.id)]
        errors = [orjson.loads(x) for x in export_results(session, job_id=job.id, kind="errors")]
    assert done.status == "completed"
    assert [o["custom_id"] for o in outputs] == ids
    assert [e["custom_id"] for e in errors] == ["poison"]
    assert errors[0]["error"]["code"] == "engine_error"
    assert "simulated kernel failure" in errors[0]["error"]["message"]
    assert runner.engine.block_manager.num_free_blocks == runner.engine.block_manager.num_total_blocks


def test_invalid_parameters_for_this_model_are_errored(
        sqlite_url: str, tmp_path: Path, tiny_llama: Path) -> None:
    too_long = orjson.dumps({"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": "the cat " * 400, "max_tokens": 4}})
    settings, sessions, job, runner, ids = _setup(sqlite_url, tmp_path, tiny_llama, [too_long])
    run_job(job_id=job.id, runner=runner)
    with sessions() as session:
        errors = [orjson.loads(x) for x in export_results(session, job_id=job.id, kind="errors")]
        assert get_job(session, job_id=job.id).request_counts == {"total": 11, "completed": 10, "failed": 1}
    assert errors[0]["custom_id"] == "too-long"
    assert "max_model_len" in errors[0]["error"]["message"] or "context" in errors[0]["error"]["message"]


def test_stop_releases_held_shards_and_keeps_finished_results(
        sqlite_url: str, tmp_path: Path, tiny_llama: Path) -> None:
    settings, sessions, job, runner, ids = _setup(sqlite_url, tmp_path, tiny_llama, [])
    stop = threading.Event()
    finished = []

    def on_progress(requests: int, tokens: int) -> None:
        finished.append(requests)
        if sum(finished) >= 2:
            stop.set()  # what SIGTERM does

    stats = run_job(job_id=job.id, runner=runner, on_progress=on_progress, stop=stop)
    assert stats.shards_released >= 1
    with sessions() as session:
        shards = session.query(Shard).filter_by(job_id=job.id).all()
        assert all(s.status in ("available", "completed") for s in shards)
        assert all(s.lease_token is None for s in shards)
        counts = get_job(session, job_id=job.id).request_counts
    assert counts["completed"] >= 2
    # Another worker (here the same runner again) finishes the rest: nothing lost, nothing twice.
    run_job(job_id=job.id, runner=runner)
    with sessions() as session:
        outputs = [orjson.loads(x) for x in export_results(session, job_id=job.id)]
        assert get_job(session, job_id=job.id).status == "completed"
    assert [o["custom_id"] for o in outputs] == ids
