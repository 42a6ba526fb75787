"""A small client of a batchinfer server's OpenAI-compatible API, used by the CLI when --server is set.

It speaks the same wire format as the `openai` package (files + batches), plus two extensions the
server understands: a batch-level `model` (the model for lines whose body names none) and the
`progress` object in batch responses.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
UPLOAD_TIMEOUT = httpx.Timeout(None, connect=10.0)  # large files take as long as they take
MAX_PAGE = 100  # the server's largest page of batches


class RemoteError(RuntimeError):
    """The server answered with an error (OpenAI shape) or could not be reached."""

    def __init__(self, message: str, *, status_code: int | None = None, type: str | None = None,  # noqa: A002
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def __str__(self) -> str:
        where = f" (HTTP {self.status_code})" if self.status_code else ""
        return f"{self.message}{where}"


class RemoteClient:
    """Files and batches on a batchinfer (or any OpenAI-compatible) server, raising RemoteError on failure."""

    def __init__(self, server: str, api_key: str | None = None, *, timeout: httpx.Timeout = DEFAULT_TIMEOUT,
                 transport: httpx.BaseTransport | None = None) -> None:
        base = server.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base, headers=headers, timeout=timeout, transport=transport)

    def __enter__(self) -> RemoteClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach {self._http.base_url}: {exc}") from exc
        _raise_for_error(response)
        return response

    def upload(self, path: str | Path, *, purpose: str = "batch") -> dict[str, Any]:
        """Upload a JSONL file (streamed from disk); returns the File object."""
        path = Path(path)
        with path.open("rb") as fh:
            files = {"file": (path.name, fh, "application/jsonl")}
            return self._request("POST", "/files", data={"purpose": purpose}, files=files,
                                 timeout=UPLOAD_TIMEOUT).json()

    def create_batch(self, input_file_id: str, *, endpoint: str | None = None, completion_window: str = "24h",
                     metadata: dict[str, str] | None = None, model: str | None = None,
                     idempotency_key: str | None = None) -> dict[str, Any]:
        """Create a batch from an uploaded file; returns the Batch object.

        With `idempotency_key` the server returns the batch it first created under that key (a retried
        nightly submit does not run twice)."""
        body: dict[str, Any] = {"input_file_id": input_file_id, "endpoint": endpoint,
                                "completion_window": completion_window}  # endpoint None: lines may mix both
        if metadata:
            body["metadata"] = metadata
        if model:
            body["model"] = model
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self._request("POST", "/batches", json=body, headers=headers).json()

    def submit(self, path: str | Path, *, model: str | None = None, metadata: dict[str, str] | None = None,
               completion_window: str = "24h", endpoint: str | None = None,
               idempotency_key: str | None = None) -> dict[str, Any]:
        """Upload `path` and create a batch from it; returns the Batch object.

        Without `endpoint` each line may use either endpoint (as `batchinfer submit` does locally)."""
        uploaded = self.upload(path)
        return self.create_batch(uploaded["id"], endpoint=endpoint,
                                 completion_window=completion_window, metadata=metadata, model=model,
                                 idempotency_key=idempotency_key)

    def get(self, batch_id: str) -> dict[str, Any]:
        """The Batch object of `batch_id`."""
        return self._request("GET", f"/batches/{batch_id}").json()

    def list(self, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        """Up to `limit` batches, newest first, as one OpenAI list object (pages of 100 fetched as needed)."""
        data: list[dict[str, Any]] = []
        page: dict[str, Any] = {"has_more": True}
        while len(data) < limit and page["has_more"]:
            params: dict[str, Any] = {"limit": min(MAX_PAGE, limit - len(data))}
            if after:
                params["after"] = after
            page = self._request("GET", "/batches", params=params).json()
            data.extend(page["data"])
            after = page.get("last_id")
            if not page["data"]:
                break
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": bool(page.get("has_more"))}

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """Ask the server to cancel `batch_id`; returns the Batch object (cancelling or cancelled)."""
        return self._request("POST", f"/batches/{batch_id}/cancel").json()

    def file(self, file_id: str) -> dict[str, Any]:
        """The File object of `file_id`."""
        return self._request("GET", f"/files/{file_id}").json()

    def content(self, file_id: str) -> Iterator[bytes]:
        """The lines of a file's content (each with its trailing newline), streamed."""
        try:
            with self._http.stream("GET", f"/files/{file_id}/content", timeout=UPLOAD_TIMEOUT) as response:
                if response.is_error:
                    response.read()
                    _raise_for_error(response)
                pending = b""
                for chunk in response.iter_bytes():
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        yield line + b"\n"
                if pending:
                    yield pending
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach {self._http.base_url}: {exc}") from exc


def _raise_for_error(response: httpx.Response) -> None:
    if not response.is_error:
        return
    try:
        error = response.json().get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    if not isinstance(error, dict):
        error = {"message": str(error)}
    message = error.get("message") or f"{response.reason_phrase or 'error'} from {response.request.url}"
    raise RemoteError(message, status_code=response.status_code, type=error.get("type"),
                      param=error.get("param"), code=error.get("code"))
