"""`batchinfer api` logs each request on stderr (issue 29 item 11), switchable, and keeps stdout pure JSON
under --json."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.metrics.helpers import free_port


def _serve_and_call(tmp_path: Path, *args: str, env_extra: dict[str, str] | None = None) -> tuple[str, str]:
    """Start the API, call /healthz and /v1/batches (401) once it answers, stop it; (stdout, stderr)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    env.update({"BATCHINFER_DATA_DIR": str(tmp_path / "data"), **(env_extra or {})})
    out, err = tmp_path / "api.out", tmp_path / "api.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", "api", "--port", str(port), "--json",
                                 *args], env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/batches", timeout=5).status_code == 401
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    return out.read_text(), err.read_text()


def test_each_request_is_logged_on_stderr_and_stdout_stays_json(tmp_path: Path) -> None:
    stdout, stderr = _serve_and_call(tmp_path)
    assert [orjson.loads(line)["event"] for line in stdout.splitlines()] == ["api_started"]
    assert '"GET /v1/batches HTTP/1.1" 401' in stderr and '"GET /healthz HTTP/1.1" 200' in stderr


@pytest.mark.parametrize("how", ["flag", "setting"])
def test_the_access_log_can_be_turned_off(tmp_path: Path, how: str) -> None:
    args = ("--no-access-log",) if how == "flag" else ()
    env = {"BATCHINFER_API_ACCESS_LOG": "false"} if how == "setting" else None
    stdout, stderr = _serve_and_call(tmp_path, *args, env_extra=env)
    assert "GET /v1/batches" not in stderr and "GET /v1/batches" not in stdout
