"""The FastAPI application: OpenAI-compatible /v1/files and /v1/batches, health probes, /metrics.

`create_app(settings)` builds one app bound to one database. It refuses to build an app without
authentication unless the server binds a loopback address: an open batch API on a network interface
would let anyone run (and read) jobs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from batchinfer import __version__
from batchinfer.api import metrics
from batchinfer.api.cache import PollCache
from batchinfer.api.deps import AUTH_CACHE_TTL_S, STATUS_CACHE_TTL_S, shutdown_ingest_pool
from batchinfer.api.errors import install_error_handlers
from batchinfer.api.loopback import LoopbackOnly, is_loopback
from batchinfer.api.routes import batches, estimate, files, health, ui
from batchinfer.config import Settings, get_settings
from batchinfer.store.db import session_factory
from batchinfer.store.files import files_dir, remove_stale_uploads

__all__ = ["UnsafeConfiguration", "create_app", "is_loopback"]

logger = logging.getLogger("batchinfer.api")

DESCRIPTION = """OpenAI-compatible Batch API: upload a JSONL file (`POST /v1/files`, purpose `batch`), create
a batch from it (`POST /v1/batches`), poll it (`GET /v1/batches/{id}`) and download its output
(`GET /v1/files/{output_file_id}/content`). Authenticate with `Authorization: Bearer <key>`
(`batchinfer apikey create --name NAME`)."""


class UnsafeConfiguration(RuntimeError):
    """Settings that would expose the API without authentication."""


def create_app(settings: Settings | None = None, *, auth_cache_ttl_s: float = AUTH_CACHE_TTL_S,
               status_cache_ttl_s: float = STATUS_CACHE_TTL_S) -> FastAPI:
    """Build the API app for `settings` (default: the process settings).

    Status polls are served from two short-lived in-process caches (0 disables them): authenticated
    keys (`auth_cache_ttl_s`, the longest a revoked key keeps working) and batch objects
    (`status_cache_ttl_s`, the most a polled status lags the database).
    """
    settings = settings or get_settings()
    if settings.auth_disabled and not is_loopback(settings.api_host):
        raise UnsafeConfiguration(
            "auth_disabled is only allowed when the API binds a loopback address, "
            f"not {settings.api_host!r}; create an API key (`batchinfer apikey create --name NAME`) "
            "or bind 127.0.0.1"
        )
    files_dir(settings.data_dir).mkdir(parents=True, exist_ok=True)
    stale = remove_stale_uploads(settings.data_dir, max_idle_s=settings.staged_upload_max_idle_seconds)
    if stale:  # a killed API's half-received uploads: counted by no quota, owned by no process
        logger.warning("removed %d staged upload(s) left by a stopped API process", len(stale))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        shutdown_ingest_pool(app)

    app = FastAPI(title="batchinfer", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.settings = settings
    app.state.session_factory = session_factory(settings.effective_database_url)
    app.state.jobs_registry = metrics.jobs_registry(app.state.session_factory, settings)
    app.state.ingest_pool = None  # created on first use: an app may serve again after a lifespan ended
    app.state.auth_cache = PollCache(auth_cache_ttl_s)
    app.state.status_cache = PollCache(status_cache_ttl_s)
    app.state.uploads_in_flight = {}  # owner -> uploads streaming now (api.limits.upload_slot)

    install_error_handlers(app)
    app.add_middleware(metrics.LatencyMiddleware)
    app.include_router(files.router)
    app.include_router(estimate.router)  # before batches: /v1/batches/estimate is no batch id
    app.include_router(batches.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    ui.install(app)  # the web dashboard at /ui, behind the same API keys
    if settings.auth_disabled:  # Host, Origin and the bound address must be loopback (loopback.py)
        app.add_middleware(LoopbackOnly)
        logger.warning("AUTHENTICATION IS DISABLED: every request acts as owner 'local' (loopback only)")
    return app
