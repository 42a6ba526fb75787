"""`batchinfer api` as an operator stops it (issue 28 item 14): SIGTERM ends within the graceful-shutdown
timeout even while a client is slowly uploading, and staged uploads a killed API left behind are removed
when the next one starts (those of live processes stay)."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.acceptance.servers import free_port, wait_for

SHUTDOWN_TIMEOUT_S = 2.0
pytestmark = pytest.mark.acceptance


class Api:
    """A real `batchinfer api --auth-disabled` process on a free port, its data dir under `tmp`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.port = tmp, free_port()
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("BATCHINFER_")}
        self.env.update({"BATCHINFER_DATA_DIR": str(tmp / "data"),
                         "BATCHINFER_API_SHUTDOWN_TIMEOUT_SECONDS": str(SHUTDOWN_TIMEOUT_S)})
        self.proc: subprocess.Popen | None = None

    @property
    def staged_dir(self) -> Path:
        return self.tmp / "data" / "files"

    def start(self) -> subprocess.Popen:
        log = (self.tmp / "api.log").open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", "api", "--auth-disabled",
                                      "--port", str(self.port), "--log-level", "warning"],
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
                                     start_new_session=True)
        log.close()
        wait_for(self._up, timeout=90, what="batchinfer api", on_timeout=self.log)
        return self.proc

    def _up(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log()
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return (self.tmp / "api.log").read_text(errors="replace")[-4000:]

    def slow_upload(self) -> http.client.HTTPConnection:
        """An upload that announced 1 MiB and sent a few lines of it, then stalls."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.putrequest("POST", "/v1/files")
        conn.putheader("Content-Type", "multipart/form-data; boundary=XyZ")
        conn.putheader("Content-Length", str(1 << 20))
        conn.endheaders()
        conn.send(b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XyZ\r\n'
                  b'Content-Disposition: form-data; name="file"; filename="slow.jsonl"\r\n\r\n'
                  + b'{"custom_id": "a", "body": {"messages": []}}\n' * 50)
        return conn

    def staged_of(self, pid: int) -> list[Path]:
        return list(self.staged_dir.glob(f".upload-{pid}-*.tmp"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_sigterm_ends_within_the_shutdown_timeout_during_a_slow_upload(tmp_path: Path) -> None:
    api = Api(tmp_path)
    try:
        proc = api.start()
        conn = api.slow_upload()
        wait_for(lambda: api.staged_of(proc.pid), timeout=30, what="the upload to be staged",
                 on_timeout=api.log)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"batchinfer api ignored SIGTERM during a slow upload\n{api.log()}")
        elapsed = time.monotonic() - start
        assert elapsed < SHUTDOWN_TIMEOUT_S + 15, elapsed
        assert proc.returncode in (0, -signal.SIGTERM), api.log()  # uvicorn exits by the signal it got
        assert not api.staged_of(proc.pid)  # the cut-off upload left nothing staged
        conn.close()
    finally:
        api.stop()


def test_a_killed_apis_staged_upload_is_removed_at_the_next_start(tmp_path: Path) -> None:
    api = Api(tmp_path)
    try:
        proc = api.start()
        conn = api.slow_upload()
        left = wait_for(lambda: api.staged_of(proc.pid), timeout=30, what="the upload to be staged",
                        on_timeout=api.log)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        conn.close()
        assert all(path.exists() for path in left)  # SIGKILL: nothing cleaned up on the way out
        orphan = api.staged_dir / f".upload-{_dead_pid()}-0123abcd.tmp"
        orphan.write_bytes(b"{}\n" * 1000)
        live = api.staged_dir / f".upload-{os.getpid()}-4567ef.tmp"  # this test process is alive
        live.write_bytes(b"{}\n")
        api.start()
        assert not any(path.exists() for path in left) and not orphan.exists()
        assert live.exists()
    finally:
        api.stop()
