"""The deployment as separate OS processes, driven only as a user drives it: the CLI (subprocess) and REST.

A Topology is one data dir and one environment shared by every process it starts (`batchinfer api`,
`beat`, `worker`, `scheduler` and one-off CLI commands). Short intervals (lease, rescue, expiry sweep,
schedule tick, ingest lease) make the recovery paths happen in seconds. The servers under it that the
tests own are in servers.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.acceptance.servers import free_port, wait_for

# Every promise is checked with these short intervals (seconds).
FAST_SETTINGS = {
    "BATCHINFER_LEASE_SECONDS": "3",
    "BATCHINFER_RESCUE_INTERVAL_SECONDS": "1",
    "BATCHINFER_EXPIRY_SWEEP_SECONDS": "1",
    "BATCHINFER_SCHEDULE_TICK_SECONDS": "1",
    # 2 s was lost once on a loaded machine: a submit alive and ingesting failed 2 s after its job was made.
    "BATCHINFER_INGEST_LEASE_SECONDS": "5",
    "BATCHINFER_SHARD_SIZE": "4",
    "BATCHINFER_DEVICE": "cpu",
    "BATCHINFER_MAX_NUM_SEQS": "2",  # slow enough that a job lasts seconds: time to interrupt it
    "BATCHINFER_KV_CACHE_MEMORY_BYTES": str(16 << 20),
    "BATCHINFER_WRITE_BATCH_SIZE": "2",
    "BATCHINFER_WRITE_INTERVAL_MS": "100",
    "BATCHINFER_AUTH_DISABLED": "true",
    "BATCHINFER_WEBHOOK_ALLOW_PRIVATE": "true",  # the test's webhook receiver listens on 127.0.0.1
    "OMP_NUM_THREADS": "1",
}


def write_chat_requests(path: Path, count: int, *, max_tokens: int, prefix: str = "req",
                        short_tokens: int | None = None) -> list[str]:
    """`count` chat requests that each generate exactly `max_tokens` tokens (every other one
    `short_tokens`, when given); returns their custom_ids."""
    ids = []
    with path.open("wb") as out:
        for i in range(count):
            custom_id = f"{prefix}-{i:05d}"
            ids.append(custom_id)
            tokens = short_tokens if short_tokens is not None and i % 2 else max_tokens
            body = {"messages": [{"role": "user", "content": f"the cat reads the prompt number {i}"}],
                    "max_tokens": tokens, "ignore_eos": True}
            out.write(orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + b"\n")
    return ids


class Topology:
    """batchinfer processes sharing one environment (database, broker, model, data dir, fast intervals)."""

    def __init__(self, tmp: Path, *, database_url: str, model: Path, broker_url: str | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.api_port = free_port()
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("BATCHINFER_")}
        self.env.update(FAST_SETTINGS)
        self.env.update({"BATCHINFER_DATA_DIR": str(tmp / "data"), "BATCHINFER_DATABASE_URL": database_url,
                         "BATCHINFER_DEFAULT_MODEL": str(model), "BATCHINFER_API_PORT": str(self.api_port),
                         "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        if broker_url:
            self.env["BATCHINFER_BROKER_URL"] = broker_url
        self.env.update(extra_env or {})
        self.procs: dict[str, subprocess.Popen] = {}
        self.workers: list[str] = []  # names of the `batchinfer worker` processes started, in order
        self.rest = httpx.Client(base_url=f"http://127.0.0.1:{self.api_port}/v1", timeout=30)

    # --- long-running processes ------------------------------------------------------------------------

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `batchinfer <args>` (with `env` over the topology's) in its own process group, logging to
        <tmp>/<name>.log."""
        log = (self.tmp / f"{name}.log").open("ab")
        proc = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", *args],
                                env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=self.tmp)
        log.close()
        self.procs[name] = proc
        return proc

    def start_api(self) -> None:
        """`batchinfer api`, waiting until it answers."""
        self.start("api", "api", "--log-level", "warning")
        wait_for(self._api_up, timeout=60, what="batchinfer api", on_timeout=self.logs)

    def _api_up(self) -> bool:
        try:
            return self.rest.get("/batches").status_code == 200
        except httpx.HTTPError:
            return False

    def start_beat(self, name: str = "beat", *, wait: bool = True) -> None:
        """`batchinfer beat`, waiting (unless not `wait`) until its control worker consumes."""
        self.start(name, "beat")
        if wait:
            self.wait_beat(name)

    def wait_beat(self, name: str = "beat") -> None:
        """Wait until the beat `name` consumes its control queue."""
        wait_for(lambda: " ready." in self.log(name), timeout=60, what=name, on_timeout=self.logs)

    def start_workers(self, *names: str, env: dict[str, str] | None = None) -> None:
        """`batchinfer worker` processes, waiting until each says it is ready (engine loaded, registered)."""
        for name in names:
            self.start(name, "worker", env=env)
            self.workers.append(name)
        ready = " ready." if "BATCHINFER_BROKER_URL" in self.env else ": polling "  # Celery / polling
        wait_for(lambda: all(ready in self.log(name) for name in names), timeout=90, interval=0.2,
                 what=f"workers {names}", on_timeout=self.logs)

    def workers_exactly(self, count: int, *, env: dict[str, str] | None = None) -> list[str]:
        """Exactly `count` running workers (names): extras stopped (SIGTERM), missing ones started (with
        `env`)."""
        live = [name for name in self.workers if name in self.procs and self.procs[name].poll() is None]
        self.stop(live[count:])
        new = [f"worker{len(self.workers) + i}" for i in range(max(0, count - len(live)))]
        if new:
            self.start_workers(*new, env=env)
        return live[:count] + new

    def signal(self, name: str, sig: signal.Signals) -> None:
        """Send `sig` to the process group of `name` (kill -9 takes its threads and children with it)."""
        os.killpg(self.procs[name].pid, sig)

    def kill(self, name: str) -> None:
        """kill -9 `name` and reap it."""
        self.signal(name, signal.SIGKILL)
        self.procs[name].wait(timeout=10)

    def stop(self, names: list[str] | None = None) -> None:
        """SIGTERM the named processes (default: all) still running; SIGKILL what outlives 20 s."""
        procs = [self.procs.pop(name) for name in (names if names is not None else list(self.procs))]
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # --- the CLI ---------------------------------------------------------------------------------------

    def cli(self, *args: str, timeout: float = 120, remote: bool = False, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run `batchinfer <args>` to completion (against the API with remote=True; `env` over the
        topology's, e.g. an owner's BATCHINFER_API_KEY); returns the result."""
        env = {**self.env, **(env or {})}
        if remote:
            env["BATCHINFER_SERVER"] = f"http://127.0.0.1:{self.api_port}"
        result = subprocess.run([sys.executable, "-m", "batchinfer.cli", *args], env=env, cwd=self.tmp,
                                capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"batchinfer {' '.join(args)} exited {result.returncode}\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def cli_json(self, *args: str, **kwargs: Any) -> list[dict[str, Any]]:
        """The JSON objects a CLI command printed with `--json` (appended here), one per line."""
        out = self.cli(*args, "--json", **kwargs).stdout
        return [orjson.loads(line) for line in out.splitlines() if line.strip().startswith("{")]

    def live_workers(self) -> list[dict[str, Any]]:
        """`batchinfer workers --json`, with each worker's pid."""
        workers = self.cli_json("workers")
        for worker in workers:
            worker["pid"] = int(worker["id"].split(":")[1])
        return workers

    def holder_of_a_shard(self, candidates: list[str]) -> str:
        """The name of a worker among `candidates` that holds a running shard right now (waits for one),
        as `batchinfer workers` shows it."""
        def find() -> str | None:
            by_pid = {worker["pid"]: worker for worker in self.live_workers()}
            for name in candidates:
                if by_pid.get(self.procs[name].pid, {}).get("shards"):
                    return name
            return None
        return wait_for(find, timeout=30, what="a worker holding a shard", on_timeout=self.logs)

    def shards_logged(self, name: str, verb: str) -> set[int]:
        """The shard ids a worker's log says it `verb` ("claimed", "completed", "released")."""
        return {int(match) for match in re.findall(rf"{verb} shard (\d+)", self.log(name))}

    # --- batches ---------------------------------------------------------------------------------------

    def cancel_unfinished(self) -> None:
        """Cancel every batch still running (REST), so one test's leftovers never slow the next."""
        for batch in self.rest.get("/batches", params={"limit": 100}).json()["data"]:
            if batch["status"] in ("validating", "in_progress"):
                self.rest.post(f"/batches/{batch['id']}/cancel")

    def batch(self, batch_id: str, *, via_rest: bool = True) -> dict[str, Any]:
        """The batch object, from REST (or `batchinfer status --json`)."""
        if via_rest:
            response = self.rest.get(f"/batches/{batch_id}")
            response.raise_for_status()
            return response.json()
        return self.cli_json("status", batch_id)[0]

    def wait_done(self, batch_id: str, count: int, *, timeout: float = 60, via_rest: bool = True) -> None:
        """Wait until `count` requests of the batch have finished (it is mid-flight)."""
        wait_for(lambda: self.batch(batch_id, via_rest=via_rest)["request_counts"]["completed"] >= count,
                 timeout=timeout, interval=0.1 if via_rest else 0.3, what=f"{count} results of {batch_id}",
                 on_timeout=self.logs)

    def wait_status(self, batch_id: str, statuses: set[str], *, timeout: float,
                    via_rest: bool = True) -> dict[str, Any]:
        """Wait until the batch has one of `statuses`; returns it."""
        def reached() -> dict[str, Any] | None:
            try:
                batch = self.batch(batch_id, via_rest=via_rest)
            except httpx.HTTPError:  # the API (or its database) is restarting
                return None
            return batch if batch["status"] in statuses else None
        return wait_for(reached, timeout=timeout, interval=0.2 if via_rest else 0.5,
                        what=f"{batch_id} to be {statuses}", on_timeout=self.logs)

    def results(self, batch_id: str, *, remote: bool = False) -> tuple[list[dict], list[dict]]:
        """(output lines, error lines) downloaded with `batchinfer results`."""
        out, err = self.tmp / f"{batch_id}.out.jsonl", self.tmp / f"{batch_id}.err.jsonl"
        self.cli("results", batch_id, "-o", str(out), "--errors", str(err), remote=remote)
        return read_jsonl(out), read_jsonl(err)

    # --- diagnostics -----------------------------------------------------------------------------------

    def log(self, name: str) -> str:
        """The log of one process so far."""
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """The tail of every process's log (for assertion messages)."""
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-2500:]}"
                         for path in sorted(self.tmp.glob("*.log")))


def read_jsonl(path: Path) -> list[dict]:
    """The objects of a JSONL file ([] when the file does not exist: no line of that kind)."""
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def custom_ids(lines: list[dict]) -> list[str]:
    """The custom_ids of result lines, sorted (duplicates kept, so 'exactly once' can be asserted)."""
    return sorted(line["custom_id"] for line in lines)
