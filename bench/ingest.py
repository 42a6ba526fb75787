"""Benchmark: stream a large JSONL batch file into SQLite and PostgreSQL, poll it, export it.

    .venv/bin/python bench/ingest.py --lines 1000000            # both databases
    .venv/bin/python bench/ingest.py --lines 200000 --db sqlite

For each database, in its own subprocess (so peak RSS is that database's alone), it measures:
ingest lines/s (submit_job: parse + validate + insert + shard), peak RSS, the latency of a status
poll (get_job + batch_object on a fresh session) at that size, result writes/s through the fenced
worker path (claim, pending_requests, write_results, complete_shard on a few shards), and export
lines/s (after marking every request succeeded with one bulk UPDATE, export_results of the output
file). Targets from issue 6: >= 100,000 lines/s, peak RSS < 300 MB, status poll < 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SYSTEM_PROMPTS = [
    "You are a concise assistant for an online bookshop. Answer in two sentences at most.",
    "You are a support agent for a cloud storage product. Be precise and friendly.",
    "You translate short English sentences into French. Reply with the translation only.",
    "You are a math tutor. Explain the key step, then give the final answer.",
    "You classify customer reviews as positive, negative or neutral. Reply with one word.",
]
TOPICS = ["shipping times", "a refund", "the API rate limit", "photosynthesis", "prime numbers",
          "a late order", "password reset", "the weather in Lyon", "a broken zipper", "sorting algorithms",
          "tax on imports"]
SAMPLING = [{"max_tokens": 32, "temperature": 0.7}, {"max_tokens": 64, "temperature": 0.0},
            {"max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 7}, {"max_completion_tokens": 48}]


def generate(path: Path, lines: int, seed: int = 0) -> int:
    """Write `lines` realistic chat/completion requests (~300 bytes each); returns the file size."""
    rng = random.Random(seed)
    with path.open("wb") as out:
        buffer = []
        for i in range(lines):
            topic, n = rng.choice(TOPICS), rng.randrange(10_000)
            if i % 10 == 9:
                body = {"model": "bench", "prompt": f"Write one sentence about {topic} (variant {n}):",
                        **rng.choice(SAMPLING[:3])}
                url = "/v1/completions"
            else:
                body = {"model": "bench", "messages": [
                    {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                    {"role": "user", "content": f"Question {n}: what should I know about {topic}?"}],
                    **rng.choice(SAMPLING)}
                url = "/v1/chat/completions"
            buffer.append(orjson.dumps({"custom_id": f"request-{i:08d}", "method": "POST", "url": url,
                                        "body": body}))
            if len(buffer) == 10_000:
                out.write(b"\n".join(buffer) + b"\n")
                buffer.clear()
        if buffer:
            out.write(b"\n".join(buffer) + b"\n")
    return path.stat().st_size


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(url: str, path: Path, lines: int) -> dict:
    """Measure one database (runs in a subprocess)."""
    from sqlalchemy import update

    from batchinfer.config import get_settings
    from batchinfer.store import jobs, shards
    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.export import export_results
    from batchinfer.store.models import Request, RequestStatus
    from batchinfer.store.serialize import batch_object

    upgrade(url)
    make_session = session_factory(url)
    rss_before = peak_rss_mb()
    with make_session() as session:
        start, cpu = time.perf_counter(), time.process_time()
        job = jobs.submit_job(session, settings=get_settings(), model="bench", path=path, shard_size=256)
        ingest_s, ingest_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        assert job.status == "in_progress", batch_object(job)
        assert job.total_requests == lines, (job.total_requests, lines)
    ingest_rss = peak_rss_mb()

    polls = []
    for _ in range(200):
        start = time.perf_counter()
        with make_session() as session:
            summary = batch_object(jobs.get_job(session, job_id=job.id)).model_dump(mode="json")
        polls.append(time.perf_counter() - start)
    assert summary["request_counts"]["total"] == lines

    with make_session() as session:  # the worker path, a few shards
        written, start = 0, time.perf_counter()
        for _ in range(20):
            lease = shards.claim_shard(session, worker_id="bench", model="bench", lease_seconds=60)
            pending = shards.pending_requests(session, shard_id=lease.shard_id)
            results = [{"request_id": r.request_id, "choices": [{"text": "An answer of a few words.",
                        "finish_reason": "stop"}], "prompt_tokens": 40, "completion_tokens": 8,
                        "cached_tokens": 32} for r in pending]
            for i in range(0, len(results), 32):  # the worker flushes every 32 outputs
                written += shards.write_results(session, shard_id=lease.shard_id,
                                                lease_token=lease.lease_token, results=results[i:i + 32])
            shards.complete_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token)
        worker_s = time.perf_counter() - start

    body = orjson.dumps({"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "bench",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "An answer."},
                                      "logprobs": None, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48,
                                   "prompt_tokens_details": {"cached_tokens": 32}}}).decode()
    with make_session() as session:
        pending = update(Request).where(Request.job_id == job.id, Request.status == RequestStatus.PENDING)
        session.execute(pending.values(status=RequestStatus.SUCCEEDED, response=body, prompt_tokens=40,
                                       completion_tokens=8, cached_tokens=32))
        session.commit()
    with make_session() as session:
        exported, nbytes, start = 0, 0, time.perf_counter()
        for line in export_results(session, job_id=job.id):
            exported += 1
            nbytes += len(line)
        export_s = time.perf_counter() - start
    assert exported == lines, (exported, lines)
    return {"ingest_s": ingest_s, "ingest_lps": lines / ingest_s, "ingest_cpu_s": ingest_cpu_s,
            "ingest_lp_cpu_s": lines / ingest_cpu_s, "rss_before_mb": rss_before,
            "ingest_peak_rss_mb": ingest_rss, "poll_ms_median": statistics.median(polls) * 1e3,
            "poll_ms_p99": sorted(polls)[int(len(polls) * 0.99) - 1] * 1e3,
            "worker_writes_ps": written / worker_s,
            "export_lps": exported / export_s, "export_mb": nbytes / 1e6, "peak_rss_mb": peak_rss_mb()}


def postgres_database(admin_url: str) -> tuple[str, callable]:
    """A fresh database on the server, and a function that drops it."""
    import sqlalchemy as sa

    name = f"bench_ingest_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(admin_url.replace("postgresql://", "postgresql+psycopg://"),
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False), drop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--postgres-url", default=os.environ.get(
        "BATCHINFER_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--workdir", default=None,
                        help="where the JSONL and SQLite files go (default: a temp dir)")
    parser.add_argument("--_child", nargs=2, metavar=("URL", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(run_one(args._child[0], Path(args._child[1]), args.lines)))
        return

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-ingest-"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"prompts-{args.lines}.jsonl"
    start = time.perf_counter()
    size = generate(path, args.lines)
    print(f"generated {args.lines:,} lines, {size / 1e6:.1f} MB ({size / args.lines:.0f} bytes/line) "
          f"in {time.perf_counter() - start:.1f}s; cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f}")

    figures: dict[str, dict] = {}
    load_before = os.getloadavg()[0]
    for db in (["sqlite", "postgres"] if args.db == "both" else [args.db]):
        drop = None
        if db == "sqlite":
            db_file = workdir / "bench.db"
            for suffix in ("", "-wal", "-shm"):
                Path(f"{db_file}{suffix}").unlink(missing_ok=True)
            url = f"sqlite:///{db_file}"
        else:
            url, drop = postgres_database(args.postgres_url)
        try:
            child = subprocess.run(
                [sys.executable, __file__, "--lines", str(args.lines), "--_child", url, str(path)],
                capture_output=True, text=True, check=False)
            if child.returncode != 0:
                print(f"{db}: failed\n{child.stderr[-3000:]}")
                continue
            figures[db] = json.loads(child.stdout.strip().splitlines()[-1])
        finally:
            if drop:
                drop()

    rows = [("ingest lines/s", "ingest_lps", "{:,.0f}", ">= 100,000"),
            ("ingest seconds", "ingest_s", "{:.1f}", ""),
            ("ingest CPU s (client)", "ingest_cpu_s", "{:.1f}", ""),
            ("lines per client CPU s", "ingest_lp_cpu_s", "{:,.0f}", ""),
            ("peak RSS MB (ingest)", "ingest_peak_rss_mb", "{:.0f}", "< 300"),
            ("RSS MB before ingest", "rss_before_mb", "{:.0f}", ""),
            ("status poll ms (median)", "poll_ms_median", "{:.2f}", "< 10"),
            ("status poll ms (p99)", "poll_ms_p99", "{:.2f}", ""),
            ("worker result writes/s", "worker_writes_ps", "{:,.0f}", ""),
            ("export lines/s", "export_lps", "{:,.0f}", ""),
            ("export MB", "export_mb", "{:.0f}", ""),
            ("peak RSS MB (whole run)", "peak_rss_mb", "{:.0f}", "")]
    dbs = list(figures)
    print(f"\n{args.lines:,} lines   " + "".join(f"{db:>14}" for db in dbs) + "        target")
    for label, key, fmt, target in rows:
        print(f"{label:<24}" + "".join(f"{fmt.format(figures[db][key]):>14}" for db in dbs) + f"   {target}")
    print(f"\nload average (1 min) before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cpus (a shared machine: wall-clock figures shrink as the load grows; "
          "CPU figures less so)")
    if len(dbs) == 2:
        ratio = figures["postgres"]["ingest_lps"] / figures["sqlite"]["ingest_lps"]
        print(f"\ningest postgres/sqlite = {ratio:.2f}x; export postgres/sqlite = "
              f"{figures['postgres']['export_lps'] / figures['sqlite']['export_lps']:.2f}x")


if __name__ == "__main__":
    main()
