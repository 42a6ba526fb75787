"""docker/: Prometheus scrapes the API and every worker, Grafana's dashboard asks only for metrics we export.

The compose file is validated by Debian's docker-compose (skipped where it is not installed); the
dashboard's PromQL is checked against the names a real engine, worker and API expose.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchinfer.api.app import create_app
from batchinfer.config import Settings
from batchinfer.engine.metrics import EngineMetrics
from batchinfer.store.db import upgrade
from workers.metrics import WorkerMetrics

DOCKER = Path(__file__).resolve().parents[2] / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "batchinfer.json"
METRIC_NAME = re.compile(r"batchinfer:[a-z0-9_]+")


def _sample_names(text: str) -> set[str]:
    """Every sample name in an exposition, and the families' names (a gauge with no series yet has none)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def _exported_names(tmp_path: Path, sqlite_url: str) -> set[str]:
    registry = CollectorRegistry()
    EngineMetrics("m", registry, engine="0").record_cache_config(block_size=16, num_blocks=8,
                                                                 enable_prefix_caching=True)
    WorkerMetrics(model_name="m", engine="0", registry=registry)
    names = _sample_names(generate_latest(registry).decode())
    upgrade(sqlite_url)
    with TestClient(create_app(Settings(data_dir=tmp_path / "data", database_url=sqlite_url))) as client:
        names |= _sample_names(client.get("/metrics").text)  # jobs, job_requests, queue_depth, ...
    return names


def _exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def test_dashboard_queries_only_metrics_that_exist(tmp_path: Path, sqlite_url: str) -> None:
    exported = _exported_names(tmp_path, sqlite_url)
    asked = {(title, name) for title, expr in _exprs() for name in METRIC_NAME.findall(expr)}
    missing = sorted((title, name) for title, name in asked if name not in exported)
    assert not missing, f"dashboard panels ask for metrics nobody exports: {missing}"
    assert len({name for _, name in asked}) >= 15


def test_dashboard_has_the_panels_the_operators_need() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    for wanted in ("Generation throughput", "Requests running / waiting (engines)",
                   "Shards available / running (queue)", "KV cache usage", "Time to first token",
                   "Inter-token latency", "Jobs by status", "Workers per model"):
        assert wanted in titles
    exprs = dict(_exprs())
    assert "histogram_quantile(0.99" in exprs["Time to first token"]
    datasource = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    assert {panel["datasource"]["uid"] for panel in dashboard["panels"] if "datasource" in panel} == {uid}


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose (Debian package) not installed")
def test_compose_runs_prometheus_and_grafana_on_the_workers_metrics_port() -> None:
    env = {**os.environ, "BATCHINFER_METRICS_TOKEN": "t0ken"}  # compose refuses to start without one
    result = subprocess.run(["docker-compose", "-f", str(DOCKER / "docker-compose.yml"), "config"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    worker = services["worker"]["command"]
    port = int(worker[worker.index("--metrics-port") + 1])
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())["scrape_configs"]
    jobs = {job["job_name"]: job for job in scrape}
    assert jobs["batchinfer-workers"]["dns_sd_configs"][0] == {"names": ["worker", "worker-cpu"], "type": "A",
                                                               "port": port, "refresh_interval": "15s"}
    assert jobs["batchinfer-api"]["static_configs"][0]["targets"] == ["api:8000"]
    assert "8000:8000" in [f"{p['published']}:{p['target']}" for p in services["api"]["ports"]]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":", 1)[0]
            if source.startswith("/"):  # a bind mount of a file of this repository
                assert Path(source).exists(), source
    grafana_mounts = " ".join(services["grafana"]["volumes"])
    assert "/etc/grafana/provisioning" in grafana_mounts and "/var/lib/grafana/dashboards" in grafana_mounts
