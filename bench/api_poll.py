"""Status-poll load on the REST API while a job runs: N concurrent clients poll GET /v1/batches/{id}.

Three processes, as in a one-box deployment: the API (uvicorn), a local worker running the job on the
tiny random Llama (or --model, e.g. smollm2-135m-instruct), and this load generator (httpx async, one
connection per client). Each client polls, waits --interval, polls again, for --seconds. The same
clients first poll /healthz (no auth, no database) for --baseline-seconds: the framework's floor, so
the batch-poll figures are printed next to a peer measured in the same run. The API process's CPU time
per request is printed too: unlike latency, it does not depend on how busy the machine is.

    python bench/api_poll.py                     # 100 clients, 30 s, tiny model
    python bench/api_poll.py --interval 0        # closed loop: saturation throughput
    python bench/api_poll.py --model smollm2-135m-instruct --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET_P99_MS = 50.0


def _serve(settings_dict: dict[str, Any], port: int) -> None:
    import uvicorn

    from batchinfer.api.app import create_app
    from batchinfer.config import Settings

    app = create_app(Settings(**settings_dict))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _work(settings_dict: dict[str, Any], model: str, threads: int) -> None:
    import os

    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    from batchinfer.config import Settings
    from workers.process import make_runner, poll_forever

    settings = Settings(**settings_dict)
    runner = make_runner(model=model, settings=settings)
    poll_forever(runner, stop=threading.Event(), max_backoff_s=0.5)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("API server did not start")


async def _client(http: httpx.AsyncClient, path: str, until: float, interval: float, latencies: list[float],
                  errors: list[str]) -> None:
    while time.perf_counter() < until:
        start = time.perf_counter()
        try:
            response = await http.get(path)
            if response.status_code != 200:
                errors.append(str(response.status_code))
        except httpx.HTTPError as exc:
            errors.append(type(exc).__name__)
        latencies.append(time.perf_counter() - start)
        if interval:
            await asyncio.sleep(interval)


async def _load(base: str, path: str, headers: dict[str, str], *, clients: int, seconds: float,
                interval: float) -> dict[str, Any]:
    """`clients` independent clients (own connection each), connected and warmed up before the clock."""
    https = [httpx.AsyncClient(base_url=base, headers=headers, timeout=30, verify=False)
             for _ in range(clients)]
    try:
        await asyncio.gather(*(http.get(path) for http in https))  # open every connection first
        latencies: list[float] = []
        errors: list[str] = []
        start = time.perf_counter()
        until = start + seconds
        # Start offsets spread the clients over one interval, as independent pollers would be.
        await asyncio.gather(*(
            _staggered(i / clients * interval, _client(http, path, until, interval, latencies, errors))
            for i, http in enumerate(https)
        ))
        elapsed = time.perf_counter() - start
    finally:
        await asyncio.gather(*(http.aclose() for http in https))
    return {"latencies": latencies, "elapsed": elapsed, "errors": len(errors)}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge load phases into one row: count, req/s, percentiles (ms), errors, API CPU per request."""
    ordered = sorted(x for run in runs for x in run["latencies"])
    elapsed = sum(run["elapsed"] for run in runs)

    def pct(p: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else float("nan")

    return {"requests": len(ordered), "rps": len(ordered) / elapsed, "p50": pct(50), "p90": pct(90),
            "p99": pct(99), "max": 1000 * ordered[-1] if ordered else float("nan"),
            "mean": 1000 * statistics.fmean(ordered) if ordered else float("nan"),
            "errors": sum(run["errors"] for run in runs),
            "cpu_ms": sum(run["cpu_ms"] * len(run["latencies"]) for run in runs) / max(len(ordered), 1)}


def _measured(server_pid: int, load: Any) -> dict[str, Any]:
    """Run a load phase; add the API process's CPU time per request (contention-free cost of a request)."""
    import psutil

    server = psutil.Process(server_pid)
    before = sum(server.cpu_times()[:2])
    row = asyncio.run(load)
    row["cpu_ms"] = 1000 * (sum(server.cpu_times()[:2]) - before) / max(len(row["latencies"]), 1)
    return row


async def _staggered(delay: float, coroutine: Any) -> None:
    await asyncio.sleep(delay)
    await coroutine


def _server_histogram(base: str, route: str) -> tuple[float, float]:
    """Server-side p50/p99 (ms) of `route` from the /metrics histogram (bucket upper bounds)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: list[tuple[float, float]] = []
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name != "batchinfer:api_request_duration_seconds":
            continue
        for sample in family.samples:
            labels = sample.labels
            if (sample.name.endswith("_bucket") and labels.get("route") == route
                    and labels.get("status") == "200"):
                buckets.append((float(labels["le"]), sample.value))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0

    def quantile(q: float) -> float:
        for bound, count in buckets:
            if count >= q * total:
                return 1000 * bound
        return float("nan")

    return quantile(0.5), quantile(0.99)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--baseline-seconds", type=float, default=None, help="default: --seconds")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="pause between a client's polls (0: closed loop)")
    parser.add_argument("--model", default=None, help="model for the worker (default: a tiny random Llama)")
    parser.add_argument("--requests", type=int, default=20_000, help="requests in the job the worker runs")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--worker-threads", type=int, default=1,
                        help="torch threads of the worker "
                             "(1 leaves the other core of a 2-core box to the API)")
    parser.add_argument("--database-url", default=None, help="default: an SQLite file in a temp dir")
    args = parser.parse_args()
    args.baseline_seconds = args.seconds if args.baseline_seconds is None else args.baseline_seconds

    from batchinfer.store.apikeys import create_key
    from batchinfer.store.db import session_factory, upgrade

    tmp = Path(tempfile.mkdtemp(prefix="bench-api-poll-"))
    model = args.model
    if model is None:
        from tests.fixtures.tiny_models import build_tiny_model

        model = str(build_tiny_model("llama", tmp / "tiny-llama"))
    url = args.database_url or f"sqlite:///{tmp / 'bench.db'}"
    upgrade(url)
    settings = {"data_dir": str(tmp / "data"), "database_url": url, "default_model": model, "device": "cpu",
                "shard_size": 256, "max_upload_bytes": 1 << 30}
    with session_factory(url)() as session:
        key, _ = create_key(session, name="bench")
    headers = {"Authorization": f"Bearer {key}"}

    ctx = mp.get_context("spawn")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = ctx.Process(target=_serve, args=(settings, port), daemon=True)
    server.start()
    worker = None
    try:
        _wait_healthy(base)
        lines = [orjson.dumps({
            "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
                "messages": [{"role": "user", "content": f"Question {i}: the worker reads many tokens."}],
                "max_tokens": args.max_tokens, "ignore_eos": True},
        }) for i in range(args.requests)]
        with httpx.Client(base_url=base, headers=headers, timeout=300) as http:
            file_id = http.post("/v1/files", data={"purpose": "batch"},
                                files={"file": ("bench.jsonl", b"\n".join(lines) + b"\n")}).json()["id"]
            batch = http.post("/v1/batches", json={"input_file_id": file_id,
                                                    "endpoint": "/v1/chat/completions",
                                                    "completion_window": "24h"}).json()
            batch_id = batch["id"]
            print(f"job {batch_id}: {args.requests} requests, model {Path(model).name}; starting worker ...",
                  flush=True)
            worker = ctx.Process(target=_work, args=(settings, model, args.worker_threads), daemon=True)
            worker.start()
            deadline = time.monotonic() + 300
            while http.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] == 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker finished nothing in 300 s")
                time.sleep(0.2)
            before = http.get(f"/v1/batches/{batch_id}").json()

        load_before = os.getloadavg()[0]
        print(f"{args.clients} clients, interval {args.interval}s: "
              f"/healthz {args.baseline_seconds:.0f}s, then GET /v1/batches/{{id}} {args.seconds:.0f}s",
              flush=True)
        poll_path = f"/v1/batches/{batch_id}"

        def phase(pid: int, url: str, path: str, hdrs: dict[str, str], seconds: float) -> dict[str, Any]:
            return _measured(pid, _load(url, path, hdrs, clients=args.clients, seconds=seconds,
                                        interval=args.interval))

        floor = [phase(server.pid, base, "/healthz", {}, args.baseline_seconds)]
        polls = [phase(server.pid, base, poll_path, headers, args.seconds)]
        after = httpx.get(f"{base}{poll_path}", headers=headers).json()
        server_p50, server_p99 = _server_histogram(base, "/v1/batches/{batch_id}")
        load_after = os.getloadavg()[0]
    finally:
        for process in (worker, server):
            if process is not None and process.is_alive():
                process.terminate()
                process.join(10)

    rows = {"GET /healthz (floor)": _summary(floor), "GET /v1/batches/{id}": _summary(polls)}
    done = after["request_counts"]["completed"] - before["request_counts"]["completed"]
    print()
    print(f"{'':<26}{'requests':>10}{'req/s':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}"
          f"{'errors':>8}{'API cpu ms/req':>16}")
    for name, row in rows.items():
        print(f"{name:<26}{row['requests']:>10}{row['rps']:>8.0f}{row['p50']:>9.1f}{row['p90']:>9.1f}"
              f"{row['p99']:>9.1f}{row['max']:>9.1f}{row['errors']:>8}{row['cpu_ms']:>16.2f}")
    poll, floor_row = rows["GET /v1/batches/{id}"], rows["GET /healthz (floor)"]
    print()
    print(f"batch poll / healthz floor: p50 x{poll['p50'] / floor_row['p50']:.2f}, "
          f"p99 x{poll['p99'] / floor_row['p99']:.2f}, throughput x{poll['rps'] / floor_row['rps']:.2f}, "
          f"API cpu x{poll['cpu_ms'] / floor_row['cpu_ms']:.2f}")
    print(f"API process CPU per poll {poll['cpu_ms']:.2f} ms: one uncontended core serves about "
          f"{1000 / poll['cpu_ms']:.0f} polls/s")
    print(f"server-side (/metrics histogram bucket bounds): p50 <= {server_p50:.1f} ms, "
          f"p99 <= {server_p99:.1f} ms")
    print(f"worker during the poll phases: {done} requests finished, "
          f"job {before['status']} -> {after['status']} "
          f"({after['request_counts']['completed']}/{args.requests}); "
          f"1-min load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} cores")
    verdict = "meets" if poll["p99"] < TARGET_P99_MS else "MISSES"
    print(f"p99 {poll['p99']:.1f} ms {verdict} the {TARGET_P99_MS:.0f} ms target")


if __name__ == "__main__":
    main()
