"""Request dependencies: settings, sessions, the caller (API key -> owner), the ingest threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.api.cache import PollCache
from batchinfer.api.errors import APIError
from batchinfer.config import Settings
from batchinfer.fair_pool import FairPool
from batchinfer.store import LOCAL_OWNER
from batchinfer.store.apikeys import authenticate, hash_key

INGEST_THREADS = 2  # concurrent batch ingests (one owner holds one: fair_pool.py); more would contend
# for the database write lock
AUTH_CACHE_TTL_S = 1.0  # a revoked key stops working within this long (status polls skip the key lookup)
STATUS_CACHE_TTL_S = 1.0  # a polled batch object is at most this stale (changes made here drop it at once)

# auto_error=False: a missing or malformed header is answered by us, in OpenAI's error shape.
_bearer = HTTPBearer(auto_error=False, description="An API key from `batchinfer apikey create`.")


_pool_lock = threading.Lock()


def ingest_pool(app: FastAPI) -> FairPool:
    """The app's ingest threads, owners taking turns (created on first use, and again after a lifespan
    shut them down)."""
    with _pool_lock:
        if app.state.ingest_pool is None:
            app.state.ingest_pool = FairPool(INGEST_THREADS, name="batchinfer-ingest")
        return app.state.ingest_pool


def shutdown_ingest_pool(app: FastAPI) -> None:
    """Stop taking ingests; running ones finish (their jobs must not stay `validating`)."""
    with _pool_lock:
        pool, app.state.ingest_pool = app.state.ingest_pool, None
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


# Cheap dependencies are async: FastAPI runs sync ones in the threadpool, one thread hop each.
async def get_settings_dep(request: Request) -> Settings:
    """The settings the app was created with."""
    return request.app.state.settings


async def get_session_factory(request: Request) -> sessionmaker[Session]:
    """The app's sessionmaker.

    Routes open a session inside the function that uses it (`with sessions() as session:`) instead of
    receiving one from a yield-dependency: a session held across FastAPI's thread hops keeps its pooled
    connection while waiting for a free thread, and under load every thread ends up waiting for a
    connection held by a request that is waiting for a thread.
    """
    return request.app.state.session_factory


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_session_factory)]


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


_MISSING_KEY = ("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                "(create one with `batchinfer apikey create --name NAME`).")
_WRONG_KEY = ("Incorrect API key provided. Check the key, or create a new one with "
              "`batchinfer apikey create --name NAME`.")


def _owner_of(session: Session, settings: Settings, api_key: str | None,
              cache: PollCache | None = None) -> str:
    if settings.auth_disabled:
        return LOCAL_OWNER
    owner = authenticate(session, key=api_key) if api_key else None
    if owner is None:
        raise _unauthorized(_WRONG_KEY if api_key else _MISSING_KEY)
    if cache is not None and api_key:
        cache.put(hash_key(api_key), owner)  # only keys that authenticated: unknown keys always ask the DB
    return owner


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Caller:
    """The request's credentials, checked inside the session of the route's own work.

    A route authenticates and works in one pooled connection and one thread hop (`read` / `session`):
    a session handed from a dependency to the route would hold its connection across FastAPI's thread
    hops, and under load every thread would wait for a connection held by a request waiting for a thread.

    `cached_owner()` serves status polls without the database: a key that authenticated less than
    AUTH_CACHE_TTL_S ago is trusted again, so a revoked key stops working within that time.
    """

    settings: Settings
    sessions: sessionmaker[Session]
    api_key: str | None
    auth_cache: PollCache | None = None

    @contextmanager
    def session(self) -> Iterator[tuple[Session, str]]:
        """A session and the caller's owner; raises 401 (OpenAI shape) for an unknown or revoked key."""
        with self.sessions() as session:
            yield session, _owner_of(session, self.settings, self.api_key, self.auth_cache)

    def cached_owner(self) -> str | None:
        """The owner if the key authenticated within the cache TTL (or auth is disabled), else None."""
        if self.settings.auth_disabled:
            return LOCAL_OWNER
        if self.auth_cache is None or not self.api_key:
            return None
        return self.auth_cache.get(hash_key(self.api_key))

    def auth_refresh_due(self) -> bool:
        """True once per half-TTL for a cached key: re-check it (revocation) in the background."""
        return bool(self.auth_cache and self.api_key and not self.settings.auth_disabled
                    and self.auth_cache.refresh_due(hash_key(self.api_key)))

    def forget_key(self) -> None:
        """Drop the key from the auth cache (its background re-check failed)."""
        if self.auth_cache is not None and self.api_key:
            self.auth_cache.drop(hash_key(self.api_key))

    async def read(self, work: Callable[[Session, str], T]) -> T:
        """`work(session, owner)` in the threadpool, after authentication in the same session."""
        return await run_in_threadpool(self._in_thread, work)

    def _in_thread(self, work: Callable[[Session, str], T]) -> T:
        with self.session() as (session, owner):
            return work(session, owner)


async def current_caller(
    request: Request,
    settings: SettingsDep,
    sessions: SessionsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    """The caller; a missing key is refused here (401) without touching the database."""
    if credentials is None and not settings.auth_disabled:
        raise _unauthorized(_MISSING_KEY)
    return Caller(settings, sessions, credentials.credentials if credentials else None,
                  request.app.state.auth_cache)


CallerDep = Annotated[Caller, Depends(current_caller)]


async def current_owner(caller: CallerDep) -> str:
    """The owner of the request's API key (for async routes); 401 when it is unknown or revoked."""
    if caller.settings.auth_disabled:
        return LOCAL_OWNER
    return await run_in_threadpool(_authenticate, caller)


def _authenticate(caller: Caller) -> str:
    with caller.session() as (_, owner):
        return owner


OwnerDep = Annotated[str, Depends(current_owner)]
