"""Quotas and expiry policies at the API (README "Security"): 429 for an owner over a limit (stored
bytes, jobs, requests, uploads streaming at once), and OpenAI's `expires_after` of an upload
({"anchor": "created_at", "seconds": N}, sent as the form fields `expires_after[anchor]` and
`expires_after[seconds]`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timedelta

from fastapi import FastAPI

from batchinfer.api.errors import APIError, bad_request
from batchinfer.config import Settings
from batchinfer.store.quotas import QuotaExceeded

# OpenAI's bounds for expires_after.seconds: one hour to thirty days.
MIN_EXPIRES_AFTER_S, MAX_EXPIRES_AFTER_S = 3600, 30 * 86400


@contextmanager
def quota_errors() -> Iterator[None]:
    """Turn a store QuotaExceeded into the API's 429 (OpenAI's rate_limit_error shape)."""
    try:
        yield
    except QuotaExceeded as exc:
        raise APIError(429, str(exc), code="quota_exceeded", param=None) from None


@asynccontextmanager
async def upload_slot(app: FastAPI, owner: str, settings: Settings) -> AsyncIterator[None]:
    """One of the owner's max_owner_concurrent_uploads upload slots in this process, else 429 at once.

    Counted on the event loop (no lock needed): uploads are streamed by async routes."""
    in_flight: dict[str, int] = app.state.uploads_in_flight
    limit = settings.max_owner_concurrent_uploads
    if in_flight.get(owner, 0) >= limit:
        raise APIError(429, f"Too many uploads at once: you are already sending {limit}, the limit "
                       f"is {limit} "
                       "(max_owner_concurrent_uploads). Wait for one to finish.", code="quota_exceeded")
    in_flight[owner] = in_flight.get(owner, 0) + 1
    try:
        yield
    finally:
        in_flight[owner] -= 1
        if not in_flight[owner]:
            del in_flight[owner]


def check_expires_after(anchor: object, seconds: object, *, param: str) -> int:
    """The seconds of an expires_after policy, or 400 naming `param`."""
    if anchor != "created_at":
        raise bad_request(f"Invalid {param}.anchor: only 'created_at' is supported, got {anchor!r}.",
                          param=f"{param}.anchor", code="invalid_value")
    try:
        value = int(str(seconds))
    except ValueError:
        value = -1
    if not MIN_EXPIRES_AFTER_S <= value <= MAX_EXPIRES_AFTER_S:
        raise bad_request(f"Invalid {param}.seconds: must be an integer from {MIN_EXPIRES_AFTER_S} to "
                          f"{MAX_EXPIRES_AFTER_S}, got {str(seconds)[:40]!r}.", param=f"{param}.seconds",
                          code="invalid_value")
    return value


def upload_expires_at(fields: Mapping[str, str], created_at: datetime) -> datetime | None:
    """When an upload expires, from its form fields (None: it does not)."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    return created_at + timedelta(seconds=check_expires_after(anchor, seconds, param="expires_after"))
