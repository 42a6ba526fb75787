"""POST /v1/batches/estimate: what an uploaded batch file will cost on this deployment (store.estimate),
the figures `batchinfer estimate` prints (store.estimate.Estimate is the response model). Read, tokenized and
estimated on a worker thread."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from batchinfer.api.deps import OwnerDep, SessionsDep, SettingsDep
from batchinfer.api.errors import ERROR_RESPONSES, bad_request, not_found
from batchinfer.store import files as file_store
from batchinfer.store.estimate import estimate_file, model_tokenizer
from batchinfer.store.serialize import parse_file_id
from batchinfer.store.workers import served_models
from batchinfer.wire.batch import Estimate
from workers.result_cache_forecast import cache_hits

router = APIRouter(prefix="/v1/batches", tags=["batches"])


class EstimateRequest(BaseModel):
    """Extension: estimate an uploaded `batch` file on a model."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    input_file_id: str = Field(max_length=64, examples=["file-1"])
    model: str | None = Field(None, max_length=256, description="Default: the server's default_model.")


@router.post("/estimate", response_model=Estimate, responses=ERROR_RESPONSES,
             summary="Estimate a batch file (extension)")
async def estimate_batch(body: EstimateRequest, owner: OwnerDep, settings: SettingsDep,
                         factory: SessionsDep) -> Estimate:
    """Tokens, expected output tokens and seconds of an uploaded `batch` file, and what they rest on."""
    model = body.model or settings.default_model

    def run() -> Estimate:
        with factory() as session:
            known = {settings.default_model, *settings.allowed_models, *served_models(session)}
            if model not in known:  # stricter than a create: loads a tokenizer only for a named model
                raise bad_request(f"Invalid model: {model!r} is not served here; estimate on one of "
                                  f"{', '.join(sorted(known))}.", param="model", code="model_not_found")
            ref = parse_file_id(body.input_file_id)
            row = file_store.get_file(session, owner=owner, file_id=ref.id) \
                if ref and ref.kind == "input" else None
            if row is None or row.purpose != "batch":
                raise not_found("File", body.input_file_id, param="input_file_id")
            try:
                model_tokenizer(model)
            except (ValueError, OSError) as exc:
                raise bad_request(f"Invalid model: {exc}.", param="model", code="model_not_found") from None
            return estimate_file(session, path=row.path, model=model, settings=settings, cache_hits=partial(
                cache_hits, model=model, owner=owner, settings=settings))

    return await run_in_threadpool(run)
