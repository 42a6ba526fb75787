"""workers.metrics in-process: the exporter's on/off and reuse rules, and the heartbeat's throughput."""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.metrics.helpers import free_port
from workers.metrics import WorkerMetrics, serve_metrics, stop_metrics


@pytest.mark.integration  # an HTTP server on a loopback port
def test_exporter_is_off_for_port_0_or_none_and_started_once_per_port() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(model_name="m", engine="0", registry=registry)
    assert metrics.serve(port=0, registry=registry) is None and metrics.serve(port=None) is None
    port = free_port()
    try:
        assert metrics.serve(port=port, host="127.0.0.1", registry=registry) == port
        assert serve_metrics(port, host="127.0.0.1", registry=registry) == port  # reused, not a second bind
        metrics.shard_claimed()
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'batchinfer:worker_shards_claimed_total{engine="0",model_name="m"} 1.0' in body
        assert metrics.heartbeat_info()["metrics_port"] == port
    finally:
        stop_metrics(port)


@pytest.mark.integration  # binds loopback ports
def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port}.*--metrics-port"):
            serve_metrics(port, host="127.0.0.1", registry=CollectorRegistry())


def test_heartbeat_reports_the_tokens_per_second_of_the_last_window() -> None:
    tokens = [0]
    registry = CollectorRegistry()
    metrics = WorkerMetrics(model_name="m", engine="0", generated_tokens=lambda: tokens[0], registry=registry)
    start = metrics._samples[0][0]
    tokens[0] = 500
    assert metrics.heartbeat_info(now=start + 10)["tokens_per_second"] == 50.0
    tokens[0] = 700
    assert metrics.tokens_per_second(now=start + 12) == pytest.approx(700 / 12)  # window still from start
    tokens[0] = 1700
    # The window slides: from the sample at 10 s (500 tokens) to 21 s.
    assert metrics.tokens_per_second(now=start + 21) == pytest.approx(1200 / 11)
    assert metrics.tokens_per_second(now=start + 40) == pytest.approx(0.0, abs=60)  # idle: falls
    assert metrics.tokens_per_second(now=start + 55) == 0.0
    with metrics.timed_write(3):
        pass
    with pytest.raises(RuntimeError), metrics.timed_write(2):  # a failed write is not counted as written
        raise RuntimeError("lease lost")
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("batchinfer:worker_results_written_total", labels) == 3
    assert registry.get_sample_value("batchinfer:worker_result_write_seconds_count", labels) == 1


def test_an_idle_workers_next_heartbeat_reports_zero_not_its_last_busy_rate() -> None:
    # Issue 29 item 5: a Celery worker idle after a job heartbeats every 15 s; its first idle heartbeat
    # showed the last busy seconds spread over the window (17.7 tok/s) instead of 0.
    tokens = [0]
    metrics = WorkerMetrics(model_name="m", engine="0", generated_tokens=lambda: tokens[0],
                            registry=CollectorRegistry())
    start = metrics._samples[0][0]
    for second in range(1, 6):  # busy: 100 tokens a second, sampled at each write
        tokens[0] += 100
        metrics.tokens_per_second(now=start + second)
    assert metrics.heartbeat_info(now=start + 5)["tokens_per_second"] == 100.0
    assert metrics.heartbeat_info()["generated_at"] is not None
    assert metrics.heartbeat_info(now=start + 20)["tokens_per_second"] == 0.0  # 15 s later, nothing new
