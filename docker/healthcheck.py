#!/usr/bin/env python3
"""The image's HEALTHCHECK: is the batchinfer command this container runs healthy?

It reads the container's command (PID 1's arguments, or --cmdline "api --port 8000" for tests):
`api` is healthy when GET /healthz on its port answers 200; `worker` when this host has a live worker in
the database (its heartbeat, `batchinfer workers --json`); any other command while it runs. Exit 0
healthy, 1 not (what Docker expects).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path


def container_command(argv: list[str]) -> list[str]:
    """The batchinfer arguments of the container: after --cmdline, else PID 1's after `batchinfer`."""
    if len(argv) > 2 and argv[1] == "--cmdline":
        return argv[2].split()
    words = Path("/proc/1/cmdline").read_bytes().decode().split("\0")
    names = [Path(word).name for word in words]
    return words[names.index("batchinfer") + 1:] if "batchinfer" in names else words


def option(args: list[str], name: str, default: str) -> str:
    """The value of `--name VALUE` or `--name=VALUE` in args."""
    for i, word in enumerate(args):
        if word == name and i + 1 < len(args):
            return args[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return default


def api_healthy(args: list[str]) -> bool:
    """GET /healthz of the API this container serves."""
    port = option(args, "--port", "8000")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def worker_healthy() -> bool:
    """A worker of this host heartbeats (worker ids are host:pid:model)."""
    listed = subprocess.run(["batchinfer", "workers", "--json"], capture_output=True, text=True, timeout=8)
    host = socket.gethostname()
    return listed.returncode == 0 and any(
        json.loads(line)["id"].startswith(f"{host}:") for line in listed.stdout.splitlines() if line.strip())


def main(argv: list[str]) -> int:
    """0 when the container's command is healthy, else 1."""
    args = container_command(argv)
    command = args[0] if args else ""
    if command == "api":
        return 0 if api_healthy(args) else 1
    if command == "worker":
        return 0 if worker_healthy() else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
