"""The periodic duty loop every deployment shape runs (workers.duties) and beat's task schedule."""

from __future__ import annotations

import threading
import time

from batchinfer.config import Settings
from workers.app import CONTROL_QUEUE, EXPIRE, RESCUE, SCHEDULE_TICK, beat_schedule
from workers.duties import Duty, control_duties, start_duties, worker_duties


def test_each_duty_runs_at_its_interval_and_a_failing_one_does_not_stop_the_others() -> None:
    runs: dict[str, list[float]] = {"fast": [], "slow": [], "broken": []}
    slow_ran_thrice = threading.Event()

    def counter(name: str, fail: bool = False):  # noqa: ANN202
        def run() -> None:
            runs[name].append(time.monotonic())
            if name == "slow" and len(runs[name]) == 3:
                slow_ran_thrice.set()
            if fail:
                raise RuntimeError("database away")
        return run

    stop = threading.Event()
    thread = start_duties([Duty("fast", 0.05, counter("fast")), Duty("slow", 0.3, counter("slow")),
                           Duty("broken", 0.05, counter("broken", fail=True))], stop=stop)
    assert slow_ran_thrice.wait(timeout=30)  # bounded by the event, not by a guess at the machine's speed
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert len(runs["broken"]) >= 3 and len(runs["fast"]) >= 3  # the failures did not end the loop
    slow = runs["slow"]
    # at once, then every 0.3 s
    assert all(later - earlier >= 0.29 for earlier, later in zip(slow, slow[1:], strict=False))
    assert len(runs["fast"]) > len(slow)  # the short interval ran more often


def test_an_aligned_duty_runs_at_wall_clock_multiples_of_its_interval() -> None:
    tick = Duty("tick", 60.0, lambda: None, aligned=True)
    assert tick.next_run_after(120.5) == 180.0
    assert Duty("rescue", 60.0, lambda: None).next_run_after(120.5) == 180.5


def test_intervals_come_from_the_settings() -> None:
    settings = Settings(lease_seconds=8, expiry_sweep_seconds=3, schedule_tick_seconds=2)
    intervals = {d.name: d.interval_s for d in control_duties(settings)}
    assert {name: intervals[name] for name in ("rescue", "expiry", "schedule_tick")} == {
        "rescue": 2.0, "expiry": 3.0, "schedule_tick": 2.0}  # rescue: a quarter of the lease
    assert [d.name for d in worker_duties(settings)] == ["rescue", "expiry"]
    assert Settings(rescue_interval_seconds=0.5).effective_rescue_interval_s == 0.5


def test_a_separate_celery_beat_sends_every_duty_to_the_control_queue_with_an_expiry() -> None:
    schedule = beat_schedule(Settings(rescue_interval_seconds=1, expiry_sweep_seconds=4,
                                      schedule_tick_seconds=9))
    entries = {entry["task"]: (entry["schedule"], entry["options"]) for entry in schedule.values()}
    assert {task: entries[task] for task in (RESCUE, EXPIRE, SCHEDULE_TICK)} == {
        RESCUE: (1, {"queue": CONTROL_QUEUE, "expires": 1}),
        EXPIRE: (4, {"queue": CONTROL_QUEUE, "expires": 4}),
        SCHEDULE_TICK: (9, {"queue": CONTROL_QUEUE, "expires": 9}),
    }


def test_an_idle_celery_worker_stays_listed_through_its_presence_duty(sqlite_url, tmp_path, tiny_llama,
                                                                     monkeypatch) -> None:
    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.workers import WORKER_LIVE_S, list_workers
    from workers import process
    from workers.duties import presence_duty

    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path)
    runner = process.make_runner(model=str(tiny_llama), settings=settings, device="cpu",
                                 kv_cache_memory_bytes=16 << 20)
    monkeypatch.setattr(process, "_process_runner", runner)
    sessions = session_factory(sqlite_url)
    with sessions() as session:
        registered = list_workers(session)[0].last_heartbeat_at
    duty = presence_duty(process.heartbeat_process_worker)
    assert duty.interval_s < WORKER_LIVE_S / 2  # at least two beats inside the live window
    time.sleep(0.05)
    duty.run()
    with sessions() as session:
        (worker,) = list_workers(session)
    assert worker.live and worker.last_heartbeat_at > registered


def test_the_expiry_duty_stores_the_expired_jobs_file_sizes(sqlite_url: str, tmp_path) -> None:  # noqa: ANN001
    from datetime import timedelta

    from sqlalchemy import update

    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.export import export_results
    from batchinfer.store.jobs import get_job
    from batchinfer.store.models import Job, utcnow
    from tests.store.helpers import chat_line, jsonl, submit_job
    from workers.duties import expiry_duty

    upgrade(sqlite_url)
    sessions = session_factory(sqlite_url)
    with sessions() as session:
        job = submit_job(session, stream=jsonl(*(chat_line(f"q{i}", "hi") for i in range(3))), model="m")
        past = utcnow() - timedelta(seconds=1)
        session.execute(update(Job).where(Job.id == job.id).values(expires_at=past))
        session.commit()
    expiry_duty(Settings(database_url=sqlite_url, data_dir=tmp_path)).run()
    with sessions() as session:
        expired = get_job(session, job_id=job.id)
        errors = b"".join(export_results(session, job_id=job.id, kind="errors"))
    assert expired.status == "expired" and b"batch_expired" in errors
    assert (expired.output_bytes, expired.error_bytes) == (0, len(errors))  # GET /v1/files reads these
