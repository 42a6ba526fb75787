"""What the result cache would serve of a file before it is submitted (`estimate`'s result_cache_hits).

The count is honest only with the worker's own key (workers/result_cache.py: request_key), and that key
covers what only a worker knows: its model's fingerprint, resolved dtype, quantization and adapter. So
the identity is not guessed from this process's settings (an API on a CPU host would resolve another
dtype than the GPU workers): it is the one this deployment's workers last recorded for the model, in the
provenance of a finished result. Each request of the file is then keyed as a worker would key it (its
stored payload read back as pending_requests reads it, the owner's scope, this installation's numerics
version) and the keys are looked up without marking any body used. None when no result of the model
records its identity (nothing was cached for it), or when the cache is not read (`off`, `refresh`).
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from sqlalchemy import select
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.store.db import end_transaction
from batchinfer.store.models import Job, Request, RequestStatus, ResultBody, request_id_for
from batchinfer.store.shards import PendingRequest
from batchinfer.wire.request import NormalizedRequest, decode_stored, encode_stored
from workers.model_identity import ModelIdentity
from workers.result_cache import cache_scope, request_key

RECENT_JOBS = 20  # the model's newest jobs searched for a recorded identity
LOOKUP_BATCH = 500


def recorded_identity(session: Session, *, model: str) -> ModelIdentity | None:
    """The identity this deployment's workers last recorded (a result's provenance) for `model`."""
    jobs = session.scalars(select(Job.id).where(Job.model == model).order_by(Job.id.desc())
                           .limit(RECENT_JOBS)).all()
    found = None
    for job_id in jobs:
        for text in session.scalars(
                select(Request.provenance)
                .where(Request.id.between(request_id_for(job_id, 0), request_id_for(job_id + 1, 0) - 1),
                       Request.status == RequestStatus.SUCCEEDED, Request.provenance.is_not(None))
                .order_by(Request.id.desc()).limit(10)):
            if text is None:  # excluded by the WHERE
                continue
            provenance = orjson.loads(text)
            adapter = provenance.get("adapter") or {}
            if model in (provenance.get("model"), adapter.get("name")):
                found = ModelIdentity.from_provenance(provenance)
                break
        if found is not None:
            break
    end_transaction(session)
    return found


def as_pending(request: NormalizedRequest) -> PendingRequest:
    """The request as a worker reads it back from its stored payload (store.shards.pending_requests)."""
    stored = decode_stored(encode_stored(request))
    return PendingRequest.from_stored(0, request.custom_id or "", 0, request.endpoint.value, stored)


def cache_hits(session: Session, requests: Sequence[NormalizedRequest], *, model: str, owner: str,
               settings: Settings) -> tuple[int | None, str]:
    """(requests whose result the cache holds now, or None; what the figure rests on)."""
    if settings.result_cache != "use":
        return None, f"result cache: not read (result_cache = {settings.result_cache})"
    identity = recorded_identity(session, model=model)
    if identity is None:
        return None, (f"result cache: unknown, no finished result of {model} records the identity (model "
                      "fingerprint, dtype, quantization) its workers key results with")
    scope = cache_scope(settings, owner)
    keys = [request_key(identity, as_pending(request), scope=scope) for request in requests]
    wanted = sorted({key for key in keys if key is not None})
    held: set[str] = set()
    for start in range(0, len(wanted), LOOKUP_BATCH):
        held.update(session.scalars(select(ResultBody.key)
                                    .where(ResultBody.key.in_(wanted[start:start + LOOKUP_BATCH]))))
    end_transaction(session)
    hits = sum(key in held for key in keys)
    return hits, (f"result cache: {hits} of {len(keys)} requests, keyed as the workers of {identity.model} "
                  f"key them ({identity.dtype}, fingerprint {identity.model_fingerprint[:12]}), are stored "
                  f"now (deterministic ones only; scope {scope.split(':')[0]})")

