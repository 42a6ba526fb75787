"""Servers the acceptance tests own: a private Redis, a private PostgreSQL cluster, a webhook receiver.

They run on free ports and in temp dirs, so stopping or restarting them touches nothing else on the
machine (its own PostgreSQL and Redis services are never restarted).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.1,
             on_timeout: Callable[[], str] = lambda: "") -> Any:
    """Poll `condition` until it returns something truthy (returned); AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{on_timeout()}")
        time.sleep(interval)


class WebhookReceiver:
    """A local HTTP server recording every POST (headers, body): what a schedule's webhook reaches."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append((dict(self.headers.items()), body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()


class RedisServer:
    """A private redis-server without persistence on a free port: restarting it drops every message."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start it and wait until it answers."""
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: port_open(self.port), timeout=10, what=f"redis-server on port {self.port}")

    def stop(self) -> None:
        """Terminate it (its queued messages are gone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


class PostgresCluster:
    """A private PostgreSQL cluster (initdb + pg_ctl in a temp dir, on a free port) that a test may restart.

    PostgreSQL refuses to run as root, so as root it runs as the `postgres` OS user (runuser).
    """

    def __init__(self) -> None:
        self.bindir = postgres_bindir()
        if self.bindir is None:
            raise RuntimeError("no PostgreSQL server binaries (initdb, pg_ctl) found")
        self.port = free_port()
        # Not under pytest's tmp dirs: those are private to root, and the server may run as `postgres`.
        self.workdir = Path(tempfile.mkdtemp(prefix="bi-accept-pg-"))
        self.datadir = self.workdir / "data"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=60, check=False)

    def init(self) -> None:
        """initdb (trust auth) and start; raises RuntimeError with the tool's output when impossible."""
        if os.geteuid() == 0:
            shutil.chown(self.workdir, "postgres", "postgres")
        result = self._run(str(self.bindir / "initdb"), "-D", str(self.datadir), "-A", "trust", "-U",
                           "postgres", "--no-sync")
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed: {result.stdout}{result.stderr}")
        self.start()

    def _ctl(self, action: str, *extra: str) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.workdir} -c fsync=off"
        result = self._run(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-o", options, "-l",
                           str(self.workdir / "server.log"), "-w", *extra, action)
        if result.returncode != 0:
            raise RuntimeError(f"pg_ctl {action} failed: {result.stdout}{result.stderr}")

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        self._ctl("start")

    def restart(self) -> None:
        """Stop (fast: open connections are cut) and start again."""
        self._ctl("restart", "-m", "fast")

    def stop(self) -> None:
        """Stop the server (immediate) if it runs, and delete the cluster."""
        try:
            if (self.datadir / "postmaster.pid").exists():
                self._ctl("stop", "-m", "immediate")
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def postgres_bindir() -> Path | None:
    """The directory of the newest installed PostgreSQL server binaries, or None."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    if candidates:
        return candidates[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def port_open(port: int) -> bool:
    """True when something accepts TCP connections on 127.0.0.1:`port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
