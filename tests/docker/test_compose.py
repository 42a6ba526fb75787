"""The compose file is valid and wires the services the README documents."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "docker-compose.yml"


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose (Debian package) not installed")
def test_compose_config_validates() -> None:
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert {"postgres", "redis", "api", "worker", "beat"} <= set(services)
    worker = services["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    for name in ("api", "worker", "beat"):
        env = services[name]["environment"]
        assert env["BATCHINFER_BROKER_URL"].startswith("redis://redis:")
        assert env["BATCHINFER_DATABASE_URL"].startswith("postgresql+psycopg://")

