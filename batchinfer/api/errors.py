"""Every error leaves the API in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Routes raise `APIError` (or one of its helpers) or let a store `JobError` through (its field and line are
data: `param` and the message's `line N:`); FastAPI's own errors are translated here too:
validation errors become 400 (OpenAI never answers 422), unknown routes 404, and anything unexpected
a 500 whose message says nothing about the internals (the traceback goes to the log only).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchinfer.store.errors import JobError, JobNotFound, JobStateError
from batchinfer.store.quotas import QuotaExceeded

logger = logging.getLogger("batchinfer.api")

# OpenAI's error `type` per status code.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}
INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request. Please retry."


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer of the API."""

    error: ErrorDetail


# The error answers every authenticated route documents (for /docs and schema-driven clients).
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {  # FastAPI `responses=`
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing, unknown or revoked API key"},
    404: {"model": ErrorResponse, "description": "No such object (or not yours)"},
}


class APIError(Exception):
    """An error answered to the client as-is: status, message, and OpenAI's type/param/code."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:  # noqa: A002
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_type(status_code)
        self.headers = headers


def not_found(kind: str, object_id: str, *, param: str | None = None) -> APIError:
    """404 for an id that does not exist or belongs to another owner (the two are indistinguishable)."""
    return APIError(404, f"No such {kind}: '{object_id}'.", param=param, code="not_found")


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    """400 with a message that names the field and the fix."""
    return APIError(400, message, param=param, code=code)


def _default_type(status_code: int) -> str:
    return _TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")


def error_body(message: str, *, type: str, param: str | None = None,  # noqa: A002
               code: str | None = None) -> dict[str, object]:
    """The JSON body of an error response."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()


def _response(status_code: int, message: str, *, type: str | None = None, param: str | None = None,  # noqa: A002
              code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    error_type = type or _default_type(status_code)
    return JSONResponse(error_body(message, type=error_type, param=param, code=code), status_code=status_code,
                        headers=headers)


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return _response(exc.status_code, exc.message, type=exc.type, param=exc.param, code=exc.code,
                     headers=exc.headers)


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else "Request failed."
    if exc.status_code == 404 and message == "Not Found":
        message = "Unknown request URL. Please check the URL and method (see /docs)."
    return _response(exc.status_code, message, headers=getattr(exc, "headers", None))


def _field_path(loc: Sequence[int | str]) -> str:
    # loc is ("body" | "query" | "path" | "header", field, index, ...); the client knows the field name.
    parts = [str(part) for part in loc[1:]] or [str(part) for part in loc]
    return ".".join(parts)


_NOT_AN_OBJECT = ("json_invalid", "model_attributes_type", "dict_type")  # pydantic: the body is no object


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if not errors:
        return _response(400, "Invalid request.")
    first = errors[0]
    param = _field_path(tuple(first.get("loc", ())))
    message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}."
    if first.get("type") == "missing":
        message = f"Missing required parameter: '{param}'."
    elif first.get("type") in _NOT_AN_OBJECT and param in ("", "body"):
        message = "The request body must be a JSON object."
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error(s) in the request.)"
    return _response(400, message, param=param or None, code="invalid_value")


def job_error(exc: JobError) -> APIError:
    """The answer to a store JobError: its field is OpenAI's `param`, its line leads the message.

    QuotaExceeded is a 429 naming the limit, JobNotFound a 404, JobStateError a 400 `invalid_batch_status`,
    any other a 400 (`invalid_value` when it names a field)."""
    if isinstance(exc, QuotaExceeded):
        return APIError(429, exc.located(), code="quota_exceeded")
    if isinstance(exc, JobNotFound):
        return APIError(404, exc.located(), param=exc.field, code="not_found")
    if isinstance(exc, JobStateError):
        return APIError(400, exc.located(), param=exc.field, code="invalid_batch_status")
    return APIError(400, exc.located(), param=exc.field, code="invalid_value" if exc.field else None)


async def _job_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, JobError)
    return await _api_error(_request, job_error(exc))


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _response(500, INTERNAL_ERROR_MESSAGE, type="server_error")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(JobError, _job_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
