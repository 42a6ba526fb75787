"""API keys: created once (the plaintext is shown once), stored as sha256 hashes, revoked, authenticated.

A key is `bi-` + 43 url-safe characters from `secrets` (256 bits), so a fast unsalted hash is enough: it
cannot be brute-forced, and it lets authentication be one indexed lookup on `key_hash`. The fetched hash
is compared again with `hmac.compare_digest`, so no code path compares secret bytes in variable time.

Each key belongs to an owner; files and jobs belong to owners, so several keys of one owner (rotation)
see the same objects. The owner defaults to the key's name. An `admin` key's dashboard also shows every
owner's batches (the CLI's and schedules' `local` ones included); over the REST API it is an ordinary key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from batchinfer.store.db import write_transaction
from batchinfer.store.models import ApiKey, utcnow

KEY_PREFIX = "bi-"
DISPLAY_PREFIX_CHARS = 10  # "bi-" + 7 characters: enough to tell keys apart, useless to an attacker
MAX_KEY_CHARS = 256
MAX_WEIGHT = 1000.0  # fair-share weight: a share at most 1000 times another owner's
# Writing last_used_at on every request would turn each status poll into a write; once a minute is plenty.
LAST_USED_RESOLUTION = timedelta(seconds=60)


_BY_HASH = (select(ApiKey.id, ApiKey.owner, ApiKey.key_hash, ApiKey.revoked_at, ApiKey.last_used_at,
                   ApiKey.admin)
            .where(ApiKey.key_hash == bindparam("digest")))


def hash_key(key: str) -> str:
    """The stored form of a key: sha256 hex."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def create_key(session: Session, *, name: str, owner: str | None = None,
               admin: bool = False, weight: float = 1.0) -> tuple[str, ApiKey]:
    """Create a key (`admin`: its dashboard sees every owner; `weight`: its owner's fair share of the fleet,
    store.fair_share); returns (the plaintext key, shown only this once, and its row)."""
    name = name.strip()
    if not name or len(name) > 128:
        raise ValueError("key name must be 1 to 128 characters")
    owner = (owner or name).strip()
    if not owner or len(owner) > 128:
        raise ValueError("owner must be 1 to 128 characters")
    if not 0 < weight <= MAX_WEIGHT:
        raise ValueError(f"weight must be above 0 and at most {MAX_WEIGHT:g} (got {weight:g})")
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(owner=owner, name=name, key_hash=hash_key(plaintext),
                 prefix=plaintext[:DISPLAY_PREFIX_CHARS], admin=admin, weight=weight)
    with write_transaction(session):
        session.add(row)
    return plaintext, row


def list_keys(session: Session, *, include_revoked: bool = True) -> list[ApiKey]:
    """All keys, oldest first (hashes included: callers print only id, name, owner, prefix, dates)."""
    query = select(ApiKey).order_by(ApiKey.id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return list(session.scalars(query))


def revoke_key(session: Session, *, key_id: int) -> ApiKey | None:
    """Revoke a key by id (idempotent); returns its row, or None when no such key exists."""
    with write_transaction(session):
        row = session.get(ApiKey, key_id)
        if row is not None and row.revoked_at is None:
            row.revoked_at = utcnow()
    return row


@dataclass(frozen=True, slots=True)
class KeyMatch:
    """A valid, unrevoked key: its owner, whether it is an admin key, and whether its last_used_at is due
    for a refresh."""

    key_id: int
    owner: str
    touch_due: bool
    admin: bool = False


def find_key(session: Session, *, key: str, now: datetime | None = None) -> KeyMatch | None:
    """Look a key up without writing anything; None for an unknown, revoked or malformed key."""
    if not key or len(key) > MAX_KEY_CHARS:
        return None
    digest = hash_key(key)
    # Core on the session's connection: this runs on every API request, the ORM layer adds nothing here.
    row = session.connection().execute(_BY_HASH, {"digest": digest}).first()
    if row is None or not hmac.compare_digest(row.key_hash, digest) or row.revoked_at is not None:
        return None
    now = now or utcnow()
    due = row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION
    return KeyMatch(key_id=row.id, owner=row.owner, touch_due=due, admin=bool(row.admin))


def touch_key(session: Session, *, key_id: int, now: datetime | None = None) -> None:
    """Record that the key was used now (one small write transaction)."""
    with write_transaction(session):
        session.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=now or utcnow()))


def authenticate(session: Session, *, key: str, now: datetime | None = None) -> str | None:
    """The owner of a valid, unrevoked key, or None; refreshes last_used_at at most once a minute."""
    match = find_key(session, key=key, now=now)
    if match is None:
        return None
    if match.touch_due:
        touch_key(session, key_id=match.key_id, now=now)
    return match.owner


def is_admin_key(session: Session, *, key: str | None) -> bool:
    """True for a valid, unrevoked admin key (read only: `authenticate` already touched it)."""
    match = find_key(session, key=key) if key else None
    return match is not None and match.admin
