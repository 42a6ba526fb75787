"""Retention and quotas in the store (issue 15): the purge step, per-owner limits naming their setting."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from batchinfer.config import Settings
from batchinfer.store.files import create_file, stage_upload
from batchinfer.store.jobs import cancel_job
from batchinfer.store.models import File, Job, Request, Shard, utcnow
from batchinfer.store.quotas import QuotaExceeded, check_job_quotas, check_storage_quota
from batchinfer.store.retention import purge
from tests.store.helpers import chat_line, jsonl, submit_job

LINES = [chat_line(f"q{i}", f"hello {i}", max_tokens=4) for i in range(3)]


def _job(session, owner: str = "alice", **kwargs) -> Job:
    return submit_job(session, stream=jsonl(*LINES), model="m", owner=owner, shard_size=2, **kwargs)


def _count(session, model, job_id: int) -> int:
    return session.scalar(select(func.count()).select_from(model).where(model.job_id == job_id))


def test_purge_deletes_expired_files_and_old_finished_jobs(session, tmp_path: Path) -> None:
    now = utcnow()
    staged = stage_upload([b"".join(line + b"\n" for line in LINES)], data_dir=tmp_path, max_bytes=1 << 20)
    expired = create_file(session, owner="alice", staged=staged, filename="a.jsonl",
                          expires_at=now - timedelta(seconds=1))
    staged = stage_upload([LINES[0] + b"\n"], data_dir=tmp_path, max_bytes=1 << 20)
    kept_file = create_file(session, owner="alice", staged=staged, filename="b.jsonl",
                            expires_at=now + timedelta(days=30))
    expired_path = Path(expired.path)
    old, own_policy, running, kept = _job(session), _job(session, output_expires_after=3600), _job(session), \
        _job(session)
    for job in (old, own_policy, kept):
        cancel_job(session, job_id=job.id, owner="alice")
    settings = Settings(finished_job_retention_seconds=86400)

    report = purge(session, settings=settings, now=now + timedelta(hours=2))
    assert report.files == [expired.id] and not expired_path.exists()
    assert report.jobs == [own_policy.id]  # its own output_expires_after passed; the others are young
    report = purge(session, settings=settings, now=now + timedelta(days=2))
    assert report.files == [] and report.jobs == [old.id, kept.id]
    assert session.get(File, kept_file.id) is not None
    for job in (old, own_policy, kept):
        assert session.get(Job, job.id) is None
        assert _count(session, Request, job.id) == 0 and _count(session, Shard, job.id) == 0
    assert session.get(Job, running.id) is not None and _count(session, Request, running.id) == 3
    session.rollback()
    # Without a retention setting finished jobs stay (unless their own policy says otherwise).
    assert purge(session, settings=Settings(finished_job_retention_seconds=None),
                 now=now + timedelta(days=400)).jobs == []


def test_quotas_name_their_setting(session, tmp_path: Path) -> None:
    settings = Settings(max_owner_active_jobs=2, max_owner_pending_requests=None, max_owner_stored_bytes=100)
    check_job_quotas(session, owner="alice", settings=settings)
    _job(session), _job(session)
    with pytest.raises(QuotaExceeded, match=r"you have 2, the limit is 2 \(max_owner_active_jobs\)"):
        check_job_quotas(session, owner="alice", settings=settings)
    check_job_quotas(session, owner="bob", settings=settings)  # per owner
    pending = Settings(max_owner_active_jobs=None, max_owner_pending_requests=6)
    with pytest.raises(QuotaExceeded, match="max_owner_pending_requests"):
        check_job_quotas(session, owner="alice", settings=pending)
    staged = stage_upload([b'{"prompt": "' + b"x" * 46 + b'"}\n'], data_dir=tmp_path, max_bytes=1 << 20)
    create_file(session, owner="alice", staged=staged, filename="a.jsonl")
    check_storage_quota(session, owner="alice", settings=settings, new_bytes=39)
    with pytest.raises(QuotaExceeded, match=r"limit is 100 bytes \(max_owner_stored_bytes\)"):
        check_storage_quota(session, owner="alice", settings=settings, new_bytes=40)


@pytest.mark.parametrize("off", ["0", "none", "off", "None"])
def test_each_limit_on_by_default_is_turned_off_by_0_or_none(session, off: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = Settings()
    assert defaults.finished_job_retention_seconds == 30 * 86400  # on by default (README "Security")
    assert defaults.max_owner_active_jobs == 100 and defaults.max_owner_stored_bytes == 50 << 30
    for name in ("MAX_OWNER_STORED_BYTES", "MAX_OWNER_ACTIVE_JOBS", "MAX_OWNER_PENDING_REQUESTS",
                 "FINISHED_JOB_RETENTION_SECONDS"):
        monkeypatch.setenv(f"BATCHINFER_{name}", off)
    settings = Settings()
    assert (settings.max_owner_stored_bytes, settings.max_owner_active_jobs,
            settings.max_owner_pending_requests, settings.finished_job_retention_seconds) == (None,) * 4
    old = _job(session)
    cancel_job(session, job_id=old.id, owner="alice")
    assert purge(session, settings=settings, now=utcnow() + timedelta(days=400)).jobs == []  # kept
    assert purge(session, settings=defaults, now=utcnow() + timedelta(days=400)).jobs == [old.id]
    for _ in range(2):
        _job(session)
    check_job_quotas(session, owner="alice", settings=settings)  # no limit
    with pytest.raises(QuotaExceeded):
        check_job_quotas(session, owner="alice", settings=Settings(max_owner_active_jobs=2))
    check_storage_quota(session, owner="alice", settings=settings, new_bytes=1 << 62)


def test_a_negative_limit_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinfer.config import load_settings
    from batchinfer.config_sources import ConfigError

    monkeypatch.setenv("BATCHINFER_MAX_OWNER_ACTIVE_JOBS", "-3")
    with pytest.raises(ConfigError, match="invalid setting max_owner_active_jobs = '-3'"):
        load_settings()
