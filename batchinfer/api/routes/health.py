"""Liveness and readiness probes (no authentication: orchestrators call them)."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from batchinfer.api.deps import SessionsDep
from batchinfer.store.db import ping

logger = logging.getLogger("batchinfer.api")
router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    """The process is up (says nothing about the database)."""
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: the database answers",
            responses={503: {"description": "Not ready"}})
def readyz(factory: SessionsDep) -> JSONResponse:
    """The database is reachable: 200, else 503 (the reason goes to the log, not the client)."""
    try:
        with factory() as session:
            ping(session)
    except SQLAlchemyError:
        logger.warning("readiness check failed: database unreachable", exc_info=True)
        return JSONResponse({"status": "unavailable", "database": "unreachable"}, status_code=503)
    return JSONResponse({"status": "ok", "database": "ok"})
