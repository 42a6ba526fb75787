"""A real `batchinfer worker --metrics-port` serves its engine's and its own metrics over HTTP.

Scraped while a job runs: every vLLM-named engine metric and every worker metric is there, labelled
with the model's NAME (never its path) and the engine index; counters move while the job runs and end at
the job's own figures. Under tensor parallelism exactly one process (rank 0) listens.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psutil
import pytest

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.jobs import get_job, submit_job
from batchinfer.store.workers import list_workers
from tests.metrics.helpers import (
    Samples,
    free_port,
    local_worker,
    scrape,
    value,
    wait_for_metrics,
    worker_env,
)
from tests.workers.helpers import write_requests
from workers.metrics import stop_metrics
from workers.process import make_runner

P = "batchinfer:"
ENGINE_SAMPLES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info",
    "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
    "num_preemptions_total", "request_success_total", "time_to_first_token_seconds_count",
    "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
    "request_queue_time_seconds_count", "request_prompt_tokens_count", "request_generation_tokens_count",
    "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
]
WORKER_SAMPLES = [
    "worker_shards_claimed_total", "worker_shards_completed_total", "worker_shards_released_total",
    "worker_lease_losses_total", "worker_results_written_total", "worker_result_write_seconds_count",
]
NUM_REQUESTS, SHARD_SIZE = 96, 8


def _labelled(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(series) for (sample, series) in samples if sample == name]


def test_worker_serves_engine_and_worker_metrics_while_a_job_runs(tmp_path: Path, sqlite_url: str,
                                                                   tiny_llama: Path) -> None:
    upgrade(sqlite_url)
    port = free_port()
    env = worker_env(database_url=sqlite_url, data_dir=tmp_path / "data", model=tiny_llama,
                     max_num_seqs="2")
    log = tmp_path / "worker.log"
    with local_worker(env, log, metrics_port=port) as proc:
        before = wait_for_metrics(port, proc, log)
        for name in ENGINE_SAMPLES + WORKER_SAMPLES:
            series = _labelled(before, P + name)
            assert series, f"{P}{name} missing from the worker's /metrics"
            for labels in series:  # the model's name, never the tiny model's temporary directory
                assert labels["model_name"] == "llama" and labels["engine"] == "0", (name, labels)
        assert value(before, P + "generation_tokens_total") == 0
        info = _labelled(before, P + "cache_config_info")
        assert len(info) == 1 and info[0]["enable_prefix_caching"] == "True"
        assert int(info[0]["num_gpu_blocks"]) > 0 and int(info[0]["block_size"]) > 0

        settings = Settings(database_url=sqlite_url, data_dir=tmp_path / "data")
        sessions = session_factory(sqlite_url)
        write_requests(tmp_path / "in.jsonl", NUM_REQUESTS, max_tokens=48)
        with sessions() as session:
            job = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model=str(tiny_llama),
                             owner="t", shard_size=SHARD_SIZE)
        during: list[Samples] = []  # scrapes taken while the job was still in progress
        deadline = time.monotonic() + 180
        while True:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            samples = scrape(port)
            with sessions() as session:
                status = get_job(session, job_id=job.id).status
            if status != "in_progress":
                break
            during.append(samples)
            time.sleep(0.1)
        assert status == "completed", log.read_text()[-3000:]
        after = scrape(port)
        with sessions() as session:
            done = get_job(session, job_id=job.id)
            (worker,) = list_workers(session)

    moving = [value(s, P + "generation_tokens_total") for s in during]
    final_tokens = value(after, P + "generation_tokens_total")
    assert moving == sorted(moving), "a counter went down"
    assert [t for t in moving if 0 < t < final_tokens], f"no scrape caught the job mid-run: {moving[-5:]}"
    assert len(set(moving)) >= 3, "the generated-token counter should move between scrapes while the job runs"
    assert any(value(s, P + "num_requests_running") > 0 for s in during)

    assert final_tokens == done.completion_tokens
    assert value(after, P + "prompt_tokens_total") > 0
    assert value(after, P + "request_success_total") == NUM_REQUESTS
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                      "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert value(after, f"{P}{histogram}_count") == NUM_REQUESTS, histogram
    assert value(after, P + "request_generation_tokens_sum") == done.completion_tokens
    assert value(after, P + "num_requests_running") == 0 and value(after, P + "kv_cache_usage_perc") == 0
    shards = NUM_REQUESTS // SHARD_SIZE
    assert value(after, P + "worker_shards_claimed_total") == shards
    assert value(after, P + "worker_shards_completed_total") == shards
    assert value(after, P + "worker_shards_released_total") == 0
    assert value(after, P + "worker_lease_losses_total") == 0
    assert value(after, P + "worker_results_written_total") == NUM_REQUESTS
    assert value(after, P + "worker_result_write_seconds_count") >= NUM_REQUESTS / 4  # batches of <= 4
    assert worker.info is not None and worker.info["metrics_port"] == port  # what the dashboard links to


def test_metrics_port_off_by_default(tmp_path: Path, sqlite_url: str, tiny_llama: Path) -> None:
    upgrade(sqlite_url)
    port = free_port()
    env = worker_env(database_url=sqlite_url, data_dir=tmp_path / "data", model=tiny_llama)
    log = tmp_path / "worker.log"
    with local_worker(env, log, metrics_port=0) as proc:  # 0: off, like an unset worker_metrics_port
        sessions = session_factory(sqlite_url)
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            with sessions() as session:
                if list_workers(session):
                    break
            time.sleep(0.2)
        with pytest.raises(httpx.ConnectError):
            scrape(port, timeout=1)
        listening = [c for c in psutil.Process(proc.pid).net_connections() if c.status == psutil.CONN_LISTEN]
        assert listening == []


def test_one_exporter_per_engine_under_tensor_parallelism(tmp_path: Path, sqlite_url: str,
                                                          tiny_llama: Path) -> None:
    upgrade(sqlite_url)
    port = free_port()
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path / "data", worker_metrics_host="127.0.0.1")
    runner = make_runner(model=str(tiny_llama), settings=settings, metrics_port=port, device="cpu",
                         tensor_parallel_size=2, max_num_seqs=2, kv_cache_memory_bytes=8 << 20)
    try:
        me = psutil.Process()
        ranks = me.children(recursive=True)
        assert ranks, "tensor parallelism should have spawned rank 1"
        mine = [c for c in me.net_connections() if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert len(mine) == 1  # rank 0, the engine, serves
        for rank in ranks:  # spawned, not forked: no rank holds the exporter's socket
            assert not [c for c in rank.net_connections() if c.laddr and c.laddr.port == port]
        samples = scrape(port)
        labels = runner.metrics.labels
        config = [s for s in _labelled(samples, P + "cache_config_info")
                  if s["model_name"] == labels["model_name"] and s["engine"] == labels["engine"]]
        assert len(config) == 1  # one engine, one series: the ranks record nothing of their own
    finally:
        stop_metrics(port)
        runner.engine.close()
