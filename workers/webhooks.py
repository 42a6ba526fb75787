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
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import datetime

import httpx
import orjson
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.destinations import pinned_webhook_request
from batchinfer.store import schedules as store
from batchinfer.store.db import session_factory
from batchinfer.store.models import Job, Schedule, ScheduleRun, utcnow

SIGNATURE_HEADER = "X-Batchinfer-Signature"
TIMESTAMP_HEADER = "X-Batchinfer-Timestamp"
WEBHOOK_MAX_ATTEMPTS = 8
WEBHOOK_BASE_DELAY_S = 30.0
MAX_CONCURRENT_DELIVERIES = 16


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
    """POST due webhooks with their signature, concurrently; failures are retried later with backoff.

    Each call is bounded by webhook_timeout_seconds as a whole (a receiver that hangs or trickles its
    answer fails alone and does not hold the tick), and its URL is checked again before it is called
    (batchinfer.destinations: a host may resolve elsewhere than when the schedule was added). Returns
    how many were delivered.
    """
    now = now or utcnow()
    sessions = session_factory(settings.effective_database_url)
    with sessions() as session:
        due = [(d.id, d.url, d.payload.encode(), _secret(session, d.run_id))
               for d in store.due_webhooks(session, now=now)]
    if not due:
        return 0
    timeout = settings.webhook_timeout_seconds
    owns_client = client is None
    client = client or httpx.Client(timeout=timeout, follow_redirects=False)
    pool = ThreadPoolExecutor(max_workers=min(len(due), MAX_CONCURRENT_DELIVERIES),
                              thread_name_prefix="webhook")
    late: set = set()
    try:
        calls = {pool.submit(_post, client, settings, url, body, secret): delivery_id
                 for delivery_id, url, body, secret in due}
        done, late = wait(calls, timeout=timeout + 1.0)
        outcomes = [(calls[f], *f.result()) for f in done]
        outcomes += [(calls[f], False, f"no answer within {timeout:g} s (webhook_timeout_seconds)")
                     for f in late]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a late call ends by its own httpx timeout
        if owns_client and not late:
            client.close()
    with sessions() as session:
        for delivery_id, ok, error in outcomes:
            store.record_webhook_attempt(session, delivery_id=delivery_id, ok=ok, error=error, now=now,
                                         max_attempts=WEBHOOK_MAX_ATTEMPTS, base_delay_s=WEBHOOK_BASE_DELAY_S)
    return sum(ok for _, ok, _ in outcomes)


def _post(client: httpx.Client, settings: Settings, url: str, body: bytes,
          secret: str | None) -> tuple[bool, str | None]:
    """One delivery attempt: (delivered, the error if not)."""
    timestamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: timestamp}
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, timestamp, body)
    try:
        pinned = pinned_webhook_request(url, allow_private=settings.webhook_allow_private)
        response = client.post(pinned.url, content=body, headers={**headers, **pinned.headers},
                               extensions=pinned.extensions)
    except Exception as exc:  # HTTPError, InvalidURL, a refused address: this delivery fails alone, retried
        return False, f"{type(exc).__name__}: {exc}"
    return response.is_success, None if response.is_success else f"HTTP {response.status_code}"


def _secret(session: Session, run_id: int) -> str | None:
    run = session.get(ScheduleRun, run_id)
    schedule = session.get(Schedule, run.schedule_id) if run is not None else None
    return schedule.webhook_secret if schedule is not None else None
