"""A full disk (issue 28 item 15): an idle worker backs off instead of spinning, and loses nothing.

The database lives on a real, tiny tmpfs filled to the last byte, so its writes fail as they do in
production ("database or disk is full"). Mounting needs root (or CAP_SYS_ADMIN); elsewhere the test skips.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from sqlalchemy.exc import OperationalError

from batchinfer.config import Settings
from batchinfer.store import workers as worker_store
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job, submit_job
from tests.workers.helpers import write_requests
from workers.process import make_runner, poll_forever

pytestmark = pytest.mark.integration  # a tmpfs mount, a worker thread and the tiny model

ENGINE = {"max_num_seqs": 4, "device": "cpu", "kv_cache_memory_bytes": 16 << 20}
WINDOW_S = 3.0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path, database: Path) -> Path:
    """Empty the WAL into the database file (so the next write must grow a file), then fill the disk."""
    with sqlite3.connect(database) as connection:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):  # big blocks, then the last partial ones
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:  # ENOSPC: full at this block size
                pass
    finally:
        os.close(fd)
    return filler


def test_an_idle_worker_on_a_full_disk_backs_off_and_then_loses_nothing(small_disk: Path, tmp_path: Path,
                                                                         tiny_llama: Path) -> None:
    database = small_disk / "batchinfer.db"
    url = f"sqlite:///{database}"
    upgrade(url)
    settings = Settings(database_url=url, data_dir=tmp_path / "data", shard_size=2)
    runner = make_runner(model=str(tiny_llama), settings=settings, **ENGINE)
    sessions = session_factory(url)
    stop = threading.Event()
    worker = threading.Thread(target=poll_forever, args=(runner,),
                              kwargs={"stop": stop, "max_backoff_s": 0.3}, daemon=True)
    worker.start()
    filler = None
    try:
        filler = _fill(small_disk, database)
        with sessions() as session, pytest.raises(OperationalError, match="full"):
            worker_store.worker_heartbeat(session, worker_id=runner.worker_id)
        # The idle loop heartbeats every 0.3 s, so it has met the full disk by now; measure its CPU.
        time.sleep(0.5)
        cpu_before, wall_before = time.process_time(), time.monotonic()
        stop.wait(WINDOW_S)
        share = (time.process_time() - cpu_before) / (time.monotonic() - wall_before)
        assert share < 0.2, f"the idle worker used {share:.0%} of a core on a full disk"
        filler.unlink()  # space again: the worker resumes by itself and runs a job exactly once
        ids = write_requests(tmp_path / "in.jsonl", 6)
        with sessions() as session:
            job = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model=str(tiny_llama),
                             owner="t")
        deadline = time.monotonic() + 90
        while True:
            with sessions() as session:
                status = get_job(session, job_id=job.id).status
            if status == "completed":
                break
            assert time.monotonic() < deadline and worker.is_alive(), f"job still {status}"
            stop.wait(0.2)
        with sessions() as session:
            lines = [orjson.loads(raw) for raw in export_results(session, job_id=job.id)]
        assert sorted(line["custom_id"] for line in lines) == ids  # each request once, none lost
    finally:
        if filler is not None and filler.exists():
            filler.unlink()
        stop.set()
        worker.join(timeout=30)
        runner.engine.close()
    assert not worker.is_alive()
