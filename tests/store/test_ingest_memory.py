"""Ingest memory is bounded by bytes as well as rows (issue 15: 200 lines of 1 MiB cost +268 MB RSS when a
chunk was 10,000 rows whatever their size). Measured on a subprocess with psutil, loosely."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import psutil

SCRIPT = textwrap.dedent("""
    import sys
    from batchinfer.config import Settings
    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.jobs import submit_job

    url, path = sys.argv[1], sys.argv[2]
    upgrade(url)
    settings = Settings(database_url=url, max_request_kv_tokens=10**9)
    with session_factory(url)() as session:
        job = submit_job(session, settings=settings, path=path, model="m", shard_size=50)
        assert job.status == "in_progress" and job.total_requests == 200, (job.status, job.errors)
    print("done")
""")


def _peak_rss(tmp_path: Path, name: str, line_bytes: int) -> int:
    """Peak RSS (sampled) of a process that imports the store and ingests 200 lines of about line_bytes."""
    path = tmp_path / f"{name}.jsonl"
    with path.open("wb") as out:
        for i in range(200):
            out.write(orjson.dumps({"custom_id": f"r{i}", "prompt": "x" * line_bytes, "max_tokens": 1})
                      + b"\n")
    url = f"sqlite:///{tmp_path / name}.db"
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, url, str(path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    watched = psutil.Process(process.pid)
    peak = 0
    while process.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.005)
    out, err = process.communicate()
    assert process.returncode == 0 and b"done" in out, err.decode()[-2000:]
    return peak


def test_large_lines_cost_within_100_mb_of_small_ones(tmp_path: Path) -> None:
    baseline = _peak_rss(tmp_path, "small", 100)
    large = _peak_rss(tmp_path, "large", 1_000_000)  # 200 MB of input, just under max_line_bytes
    assert large - baseline < 100 << 20, (baseline >> 20, large >> 20)
