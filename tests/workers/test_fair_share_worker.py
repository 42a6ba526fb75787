"""The held-out scheduling scenarios with a real polling worker on the tiny model (issue 32):
(1) fairness: a second owner's small job finishes while the first owner's big job is at most half done;
(3) earliest deadline first: a 1h job queued after a 24h one finishes while the 24h one is at most half done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.jobs import get_job, submit_job
from tests.workers.helpers import write_requests
from workers.process import make_runner, poll_forever

DEADLINE_S = 120.0  # a loaded 2-core CI machine; the scenarios take seconds


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    upgrade(url)
    return url


@contextmanager
def polling_worker(settings: Settings, model: Path) -> Iterator[None]:
    """`batchinfer worker`'s broker-less loop on a thread, stopped (shards handed back) at exit."""
    runner = make_runner(model=str(model), settings=settings, max_num_seqs=8, device="cpu")
    stop = threading.Event()
    thread = threading.Thread(target=poll_forever, args=(runner,), kwargs={"stop": stop}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=DEADLINE_S)
        assert not thread.is_alive()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_second_owners_small_job_finishes_while_the_big_one_is_at_most_half_done(
        db_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    settings = Settings(database_url=db_url, data_dir=tmp_path, write_batch_size=4)
    sessions = session_factory(db_url)
    write_requests(tmp_path / "a.jsonl", 400)
    write_requests(tmp_path / "b.jsonl", 20)

    def job(job_id: int):  # noqa: ANN202
        with sessions() as session:
            return get_job(session, job_id=job_id)

    with sessions() as session:
        big = submit_job(session, settings=settings, path=tmp_path / "a.jsonl", model=str(tiny_llama),
                         owner="alice", shard_size=8).id
    with polling_worker(settings, tiny_llama):
        wait_for(lambda: job(big).completed_requests > 0, "alice's job to run")
        with sessions() as session:
            small = submit_job(session, settings=settings, path=tmp_path / "b.jsonl", model=str(tiny_llama),
                               owner="bob", shard_size=8).id
        wait_for(lambda: job(small).status == "completed", "bob's job to complete")
        done = job(big).completed_requests
    assert job(small).completed_requests == 20
    assert done <= 200, f"alice's job had done {done} of 400 lines when bob's 20 finished"


def test_a_job_due_in_an_hour_finishes_before_half_of_an_earlier_one_due_tomorrow(
        sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path, write_batch_size=4)
    sessions = session_factory(sqlite_url)
    write_requests(tmp_path / "day.jsonl", 300)
    write_requests(tmp_path / "hour.jsonl", 30)
    with sessions() as session:  # no worker yet: both wait in the queue, the 24h one first
        day = submit_job(session, settings=settings, path=tmp_path / "day.jsonl", model=str(tiny_llama),
                         completion_window="24h").id
        hour = submit_job(session, settings=settings, path=tmp_path / "hour.jsonl", model=str(tiny_llama),
                          completion_window="1h").id

    def job(job_id: int):  # noqa: ANN202
        with sessions() as session:
            return get_job(session, job_id=job_id)

    with polling_worker(settings, tiny_llama):
        wait_for(lambda: job(hour).status == "completed", "the 1h job to complete")
        done = job(day).completed_requests
    assert job(hour).completed_requests == 30
    assert done <= 150, f"the 24h job had done {done} of 300 lines when the 1h job finished"
