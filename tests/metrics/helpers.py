"""A real `batchinfer worker` process (no broker: it polls the database) and a Prometheus scrape of it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    """A TCP port nobody listens on right now (the worker binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int, *, timeout: float = 5.0) -> Samples:
    """GET http://127.0.0.1:port/metrics, parsed: (sample name, sorted labels) -> value."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=timeout)
    response.raise_for_status()
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over the series matching `labels` (0 when there is none)."""
    wanted = set(labels.items())
    return sum(v for (sample, series), v in samples.items() if sample == name and wanted <= set(series))


def worker_env(*, database_url: str, data_dir: Path, model: Path, **settings: str) -> dict[str, str]:
    """The environment of a CPU worker on the tiny model with small batches and frequent writes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    env.update({
        "BATCHINFER_DATABASE_URL": database_url,
        "BATCHINFER_DATA_DIR": str(data_dir),
        "BATCHINFER_DEFAULT_MODEL": str(model),
        "BATCHINFER_DEVICE": "cpu",
        "BATCHINFER_MAX_NUM_SEQS": "4",
        "BATCHINFER_KV_CACHE_MEMORY_BYTES": str(16 << 20),
        "BATCHINFER_WRITE_BATCH_SIZE": "4",
        "BATCHINFER_WRITE_INTERVAL_MS": "100",
        "OMP_NUM_THREADS": "1",
    })
    env.update({f"BATCHINFER_{key.upper()}": str(val) for key, val in settings.items()})
    return env


@contextmanager
def local_worker(env: dict[str, str], log_path: Path, *args: str,
                 metrics_port: int | None = None) -> Iterator[subprocess.Popen]:
    """Run `batchinfer worker` until the block ends (SIGTERM, then kill after 30 s)."""
    command = [sys.executable, "-m", "batchinfer.cli", "worker", "--log-level", "info", *args]
    if metrics_port is not None:
        command += ["--metrics-port", str(metrics_port)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_for_metrics(port: int, proc: subprocess.Popen, log_path: Path, *, timeout: float = 120.0) -> Samples:
    """Scrape until the worker's exporter answers (it starts once the engine is built)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"worker exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}"
        try:
            return scrape(port, timeout=2)
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"no metrics on :{port} after {timeout}s:\n{log_path.read_text()[-3000:]}")
