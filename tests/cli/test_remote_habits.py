"""The CLI against a server (--server): it outlasts a server restart during `submit --wait`, passes the
options a local submit takes (on_invalid, priority, shard size), and retries only what is safe to repeat."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn
from click.testing import CliRunner
from fastapi import FastAPI

from batchinfer.api.app import create_app
from batchinfer.cli import main
from batchinfer.cli.remote import RemoteClient, RemoteError
from batchinfer.config import Settings, get_settings
from batchinfer.store.apikeys import create_key
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.models import Job
from tests.api.conftest import TEST_MODEL, make_settings
from tests.api.helpers import FixedOutputWorker, chat_line, jsonl, serve

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def api_settings(tmp_path: Path, sqlite_url: str) -> Settings:
    upgrade(sqlite_url)
    return make_settings(tmp_path, sqlite_url)


@pytest.fixture
def api_key(api_settings: Settings) -> str:
    with session_factory(api_settings.effective_database_url)() as session:
        return create_key(session, name="cli")[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _serve_on(app: FastAPI, port: int) -> Iterator[None]:
    """uvicorn on a fixed loopback port in a thread (so it can be stopped and started again there)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def _jobs(settings: Settings) -> list[Job]:
    with session_factory(settings.effective_database_url)() as session:
        return list(session.query(Job).order_by(Job.id))


def _submit_wait_then_stop_the_server(settings: Settings, api_key: str, tmp_path: Path, *, requests: int,
                                      retry_seconds: int, timeout: int) -> tuple[subprocess.Popen, int]:
    """`submit --wait --json` through the CLI against a server that stops once the job exists; (cli, port)."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(f"c{i}", "hi") for i in range(requests)]))
    port = _free_port()
    env = {**os.environ, "BATCHINFER_API_KEY": api_key, "BATCHINFER_SERVER_RETRY_SECONDS": str(retry_seconds),
           "BATCHINFER_DATA_DIR": str(tmp_path / "cli-data")}
    command = [sys.executable, "-m", "batchinfer.cli", "--server", f"http://127.0.0.1:{port}", "submit",
               str(path), "--model", TEST_MODEL, "--wait", "--timeout", str(timeout), "--json"]
    with _serve_on(create_app(settings), port):
        cli = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while not _jobs(settings):
            assert cli.poll() is None and time.monotonic() < deadline, cli.communicate()
            time.sleep(0.05)
        time.sleep(0.5)  # the CLI is polling now
    return cli, port


def test_submit_wait_outlasts_a_server_restart(api_settings: Settings, api_key: str, tmp_path: Path) -> None:
    cli, port = _submit_wait_then_stop_the_server(api_settings, api_key, tmp_path, requests=3,
                                                  retry_seconds=60, timeout=60)
    time.sleep(2.0)  # the server is down: the CLI's polls are refused and retried
    assert cli.poll() is None, cli.communicate()
    with _serve_on(create_app(api_settings), port), \
            FixedOutputWorker(session_factory(api_settings.effective_database_url), model=TEST_MODEL):
        stdout, stderr = cli.communicate(timeout=90)
    assert cli.returncode == 0, stderr.decode()
    submitted, final = (orjson.loads(line) for line in stdout.splitlines())
    assert submitted["id"] == final["id"] and submitted["status"] == "in_progress"
    assert final["status"] == "completed" and final["request_counts"]["completed"] == 3
    assert stderr == b""  # under --json stderr is for errors only: the retries were silent


def test_wait_timeout_holds_while_the_server_stays_down(api_settings: Settings, api_key: str,
                                                        tmp_path: Path) -> None:
    from batchinfer.cli.output import EXIT_TIMEOUT

    cli, _ = _submit_wait_then_stop_the_server(api_settings, api_key, tmp_path, requests=1, retry_seconds=120,
                                               timeout=4)
    down_at = time.monotonic()
    _, stderr = cli.communicate(timeout=60)  # no server, no worker: only --timeout can end the wait
    assert cli.returncode == EXIT_TIMEOUT, stderr.decode()
    assert time.monotonic() - down_at < 15  # --timeout 4, not server_retry_seconds 120
    assert orjson.loads(stderr.splitlines()[-1])["error"]["type"] == "timeout"


def test_remote_submit_passes_on_invalid_priority_and_shard_size(api_settings: Settings, api_key: str,
                                                                 tmp_path: Path, monkeypatch) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_bytes(jsonl([chat_line(f"c{i}", "hi") for i in range(5)]))
    bad.write_bytes(jsonl([chat_line("a", "hi"), b'{"custom_id": "b", "not": "a request"}']))
    monkeypatch.setenv("BATCHINFER_API_KEY", api_key)
    get_settings.cache_clear()
    with serve(create_app(api_settings)) as base:
        ran = CliRunner().invoke(main, ["submit", "--server", base, str(good), "-m", TEST_MODEL,
                                        "--priority", "5", "--shard-size", "2", "--json"])
        assert ran.exit_code == 0, ran.output
        failed = CliRunner().invoke(main, ["--server", base, "submit", str(bad), "--on-invalid", "fail",
                                           "--json"])
        assert failed.exit_code == 4, failed.output
        assert [e["line"] for e in orjson.loads(failed.stdout)["errors"]["data"]] == [None, 2]
    first, second = _jobs(api_settings)
    assert (first.priority, first.shard_size, first.num_shards, first.on_invalid) == (5, 2, 3, "skip")
    assert (second.on_invalid, second.status) == ("fail", "failed")


def _flaky(failures: list[Exception]) -> httpx.MockTransport:
    """A transport raising the given errors first, then answering with a file (uploads) or a batch."""
    calls: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if failures:
            raise failures.pop(0)
        if request.url.path.endswith("/files"):
            return httpx.Response(200, json={"id": "file-1", "object": "file", "bytes": 1, "created_at": 0,
                                             "filename": "in.jsonl", "purpose": "batch"})
        counts = {"total": 1, "completed": 0, "failed": 0}
        return httpx.Response(200, json={"id": "batch_1", "object": "batch", "status": "in_progress",
                                         "endpoint": None, "input_file_id": "file-1",
                                         "completion_window": "24h", "created_at": 0,
                                         "request_counts": counts})

    transport = httpx.MockTransport(handle)
    transport.calls = calls  # type: ignore[attr-defined]
    return transport


def test_client_retries_reads_and_never_replays_an_upload(tmp_path: Path) -> None:
    said: list[str] = []
    refused = [httpx.ConnectError("refused"), httpx.ReadError("reset")]
    with RemoteClient("http://server", transport=_flaky(refused), on_retry=said.append) as client:
        assert client.get("batch_1").id == "batch_1"  # a read survives refused and dropped connections
    assert len(said) == 2 and "retrying in" in said[0]

    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "x"}\n')
    transport = _flaky([httpx.ReadError("reset after sending")])
    with RemoteClient("http://server", transport=transport) as client, pytest.raises(RemoteError):
        client.upload(path)  # it may have been stored: sending it again could store it twice
    assert transport.calls == ["POST"]  # type: ignore[attr-defined]

    transport = _flaky([httpx.ConnectError("refused")])
    with RemoteClient("http://server", transport=transport) as client:
        client.upload(path)  # never reached the server: safe to send again
    assert transport.calls == ["POST", "POST"]  # type: ignore[attr-defined]

    transport = _flaky([httpx.ConnectError("refused")] * 100)
    started = time.monotonic()
    with RemoteClient("http://server", transport=transport, retry_seconds=0.5) as client, \
            pytest.raises(RemoteError, match="cannot reach"):
        client.get("batch_1")
    assert time.monotonic() - started < 5  # gives up after its budget
