"""The compose file is valid and wires the services the README documents."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "docker-compose.yml"


PROMETHEUS = COMPOSE.parent / "prometheus.yml"
needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None,
                                   reason="docker-compose (Debian package) not installed")


def _config(*args: str, token: str | None = "t0ken") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "BATCHINFER_METRICS_TOKEN"}
    if token is not None:
        env["BATCHINFER_METRICS_TOKEN"] = token
    return subprocess.run(["docker-compose", "-f", str(COMPOSE), *args, "config"], capture_output=True,
                          text=True, timeout=60, env=env)


@needs_compose
def test_compose_config_validates() -> None:
    result = _config()
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert {"postgres", "redis", "api", "worker", "beat"} <= set(services)
    assert services["worker-cpu"]["profiles"] == ["cpu"]  # started only under --profile cpu
    worker = services["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    for name in ("api", "worker", "beat"):
        env = services[name]["environment"]
        assert env["BATCHINFER_BROKER_URL"].startswith("redis://redis:")
        assert env["BATCHINFER_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert services["api"]["environment"]["BATCHINFER_METRICS_TOKEN"] == "t0ken"


@needs_compose
def test_compose_restarts_services_and_has_a_cpu_worker_profile() -> None:
    result = _config("--profile", "cpu")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("postgres", "redis", "api", "beat", "prometheus", "grafana"):
        assert services[name]["restart"] == "unless-stopped", name
    for name in ("worker", "worker-cpu"):  # exit 3 (a rank failed) comes back; a deliberate stop does not
        assert services[name]["restart"] == "on-failure", name
    assert services["migrate"]["restart"] == "no"
    cpu = services["worker-cpu"]
    assert "deploy" not in cpu and cpu["command"][cpu["command"].index("--device") + 1] == "cpu"
    assert cpu["environment"] == services["worker"]["environment"]


@needs_compose
def test_compose_refuses_to_start_the_api_with_an_open_metrics_endpoint() -> None:
    result = _config(token=None)
    assert result.returncode != 0 and "set BATCHINFER_METRICS_TOKEN" in result.stderr


def test_prometheus_sends_the_metrics_token_the_compose_file_writes() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    scrape = {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    token_file = scrape["batchinfer-api"]["authorization"]["credentials_file"]
    startup = " ".join(compose["services"]["prometheus"]["command"])
    assert f"> {token_file}" in startup and "$$BATCHINFER_METRICS_TOKEN" in startup
    assert scrape["batchinfer-workers"]["dns_sd_configs"][0]["names"] == ["worker", "worker-cpu"]

