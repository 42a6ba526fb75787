"""POST /v1/batches/estimate: what an uploaded batch file will cost on this deployment (store.estimate),
the figures `batchinfer estimate` prints. Read, tokenized and estimated on a worker thread."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from batchinfer.api.deps import OwnerDep, SessionsDep, SettingsDep
from batchinfer.api.errors import ERROR_RESPONSES, bad_request, not_found
from batchinfer.store import files as file_store
from batchinfer.store.estimate import estimate_file, model_tokenizer
from batchinfer.store.serialize import parse_file_id
from batchinfer.store.workers import served_models

router = APIRouter(prefix="/v1/batches", tags=["batches"])


class EstimateRequest(BaseModel):
    """Extension: estimate an uploaded `batch` file on a model."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    input_file_id: str = Field(max_length=64, examples=["file-1"])
    model: str | None = Field(None, max_length=256, description="Default: the server's default_model.")


class LineErrorItem(BaseModel):
    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class EstimateObject(BaseModel):
    """What the file will cost (README "Sharing the workers")."""

    model_config = ConfigDict(protected_namespaces=())

    model: str
    requests: int
    invalid_lines: int
    prompt_tokens: int
    cached_prompt_tokens: int
    max_output_tokens: int
    expected_output_tokens: int
    expected_seconds: float | None
    live_workers: int
    basis: list[str]
    result_cache_hits: int | None = None
    errors: list[LineErrorItem] = []


@router.post("/estimate", response_model=EstimateObject, responses=ERROR_RESPONSES,
             summary="Estimate a batch file (extension)")
async def estimate_batch(body: EstimateRequest, owner: OwnerDep, settings: SettingsDep,
                         factory: SessionsDep) -> dict[str, Any]:
    """Tokens, expected output tokens and seconds of an uploaded `batch` file, and what they rest on."""
    model = body.model or settings.default_model

    def run() -> dict[str, Any]:
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
            return estimate_file(session, path=row.path, model=model, settings=settings).as_dict()

    return await run_in_threadpool(run)
