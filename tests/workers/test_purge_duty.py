"""The purge runs beside the other periodic duties (beat, scheduler) and as a beat task (issue 15)."""

from __future__ import annotations

import time
from pathlib import Path

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.jobs import cancel_job, get_job, submit_job
from tests.workers.helpers import write_requests
from workers.app import PURGE, beat_schedule
from workers.duties import control_duties, purge_duty


def test_purge_is_a_control_duty_and_a_beat_task(sqlite_url: str, tmp_path: Path) -> None:
    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path, finished_job_retention_seconds=0.2)
    assert "purge" in {duty.name for duty in control_duties(settings)}
    assert beat_schedule(settings)[PURGE]["schedule"] == settings.purge_interval_seconds
    write_requests(tmp_path / "in.jsonl", 2)
    with session_factory(sqlite_url)() as session:
        job = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model="m", owner="t")
        cancel_job(session, job_id=job.id)
    time.sleep(0.3)
    purge_duty(settings).run()
    with session_factory(sqlite_url)() as session:
        assert get_job(session, job_id=job.id) is None
