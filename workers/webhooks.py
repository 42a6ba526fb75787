"""Webhooks of scheduled runs: a signed JSON POST per finished run, delivered from an outbox table.

A run's webhook is queued in the same database as the run (batchinfer.store.schedules.enqueue_webhook)
and delivered by the schedule tick until one attempt succeeds (or WEBHOOK_MAX_ATTEMPTS failed), with
exponential backoff between attempts, so a receiver that is down for a while still hears of every run.
The body is signed with the schedule's secret: SIGNATURE_HEADER carries
sha256=HMAC-SHA256(secret, "<timestamp>.<body>"), TIMESTAMP_HEADER the timestamp, so a receiver can
reject forged and replayed deliveries (see `verify`).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import datetime

import httpx
import orjson
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.store import schedules as store
from batchinfer.store.db import session_factory
from batchinfer.store.models import Job, Schedule, ScheduleRun, utcnow

SIGNATURE_HEADER = "X-Batchinfer-Signature"
TIMESTAMP_HEADER = "X-Batchinfer-Timestamp"
WEBHOOK_MAX_ATTEMPTS = 8
WEBHOOK_BASE_DELAY_S = 30.0


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header value: sha256=HMAC-SHA256(secret, "<timestamp>.<body>") in hex."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    """Check a webhook signature in constant time (what a receiver does)."""
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


def enqueue_run_webhook(settings: Settings, run: ScheduleRun, schedule: Schedule, *, job: Job | None,
                        now: datetime | None = None) -> None:
    """Queue the webhook that tells the schedule's receiver how `run` ended (nothing without a URL)."""
    if not schedule.webhook_url:
        return
    payload = {
        "schedule": schedule.name,
        "slot": run.slot_at.isoformat(),
        "run_id": run.id,
        "status": str(run.status),
        "error": run.error,
        "job_id": job.batch_id if job is not None else None,
        "job_status": str(job.status) if job is not None else None,
        "request_counts": job.request_counts if job is not None else None,
        "usage": job.usage if job is not None else None,
        "output_path": run.output_path,
        "errors_path": run.errors_path,
    }
    with session_factory(settings.effective_database_url)() as session:
        store.enqueue_webhook(session, run=run, url=schedule.webhook_url, payload=orjson.dumps(payload),
                              now=now)


def deliver_webhooks(*, settings: Settings, now: datetime | None = None,
                     client: httpx.Client | None = None) -> int:
    """POST due webhooks with their signature; failures are retried later with backoff. Returns delivered."""
    now = now or utcnow()
    sessions = session_factory(settings.effective_database_url)
    with sessions() as session:
        due = [(d.id, d.url, d.payload.encode(), _secret(session, d.run_id))
               for d in store.due_webhooks(session, now=now)]
    if not due:
        return 0
    owns_client = client is None
    client = client or httpx.Client(timeout=10.0)
    delivered = 0
    try:
        for delivery_id, url, body, secret in due:
            timestamp = str(int(time.time()))
            headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: timestamp}
            if secret:
                headers[SIGNATURE_HEADER] = sign(secret, timestamp, body)
            try:
                response = client.post(url, content=body, headers=headers)
                ok = response.is_success
                error = None if ok else f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                ok, error = False, f"{type(exc).__name__}: {exc}"
            with sessions() as session:
                store.record_webhook_attempt(session, delivery_id=delivery_id, ok=ok, error=error, now=now,
                                             max_attempts=WEBHOOK_MAX_ATTEMPTS,
                                             base_delay_s=WEBHOOK_BASE_DELAY_S)
            delivered += ok
    finally:
        if owns_client:
            client.close()
    return delivered


def _secret(session: Session, run_id: int) -> str | None:
    run = session.get(ScheduleRun, run_id)
    schedule = session.get(Schedule, run.schedule_id) if run is not None else None
    return schedule.webhook_secret if schedule is not None else None
