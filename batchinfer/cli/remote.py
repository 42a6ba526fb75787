"""A small client of a batchinfer server's OpenAI-compatible API, used by the CLI when --server is set.

It speaks the same wire format as the `openai` package (files + batches), plus the extensions the
server understands: batch-level `model` (the model for lines whose body names none), `on_invalid`,
`priority` and `shard_size` in the create-batch body, and the `progress` object in batch responses.

A server that restarts is not an error: transport failures (refused or dropped connections, timeouts)
and 502/503/504 answers are retried with exponential backoff and jitter (tenacity) for up to
`retry_seconds`; a request that may not have reached the server is retried only when repeating it is
harmless (reads, a create with an idempotency key, or a connection that was never made).
"""

from __future__ import annotations

import builtins  # `list` is a method name in the clients below
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay, wait_exponential_jitter

from batchinfer.wire.batch import BatchList, BatchObject
from batchinfer.wire.file import FileObject

_M = TypeVar("_M", bound=BaseModel)
DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
UPLOAD_TIMEOUT = httpx.Timeout(None, connect=10.0)  # large files take as long as they take
MAX_PAGE = 100  # the server's largest page of batches
QUICK_RETRY_SECONDS = 5.0  # one command's patience with an unreachable server (a --wait poll: the setting)
_RETRY_STATUSES = frozenset({502, 503, 504})  # a proxy or load balancer in front of a restarting server
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout)  # retrying these cannot repeat an effect


class RemoteError(RuntimeError):
    """The server answered with an error (OpenAI shape) or could not be reached."""

    def __init__(self, message: str, *, status_code: int | None = None, type: str | None = None,  # noqa: A002
                 param: str | None = None, code: str | None = None, transient: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.transient = transient  # worth retrying: the server may be restarting

    def __str__(self) -> str:
        where = f" (HTTP {self.status_code})" if self.status_code else ""
        return f"{self.message}{where}"


class RemoteClient:
    """Files and batches on a batchinfer (or any OpenAI-compatible) server, raising RemoteError on failure."""

    def __init__(self, server: str, api_key: str | None = None, *, timeout: httpx.Timeout = DEFAULT_TIMEOUT,
                 transport: httpx.BaseTransport | None = None, retry_seconds: float = QUICK_RETRY_SECONDS,
                 on_retry: Callable[[str], None] | None = None) -> None:
        base = server.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base, headers=headers, timeout=timeout, transport=transport)
        self.retry_seconds = retry_seconds
        self._on_retry = on_retry

    def __enter__(self) -> RemoteClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _retrying(self, retry_seconds: float | None) -> Retrying:
        """Retry transient failures with exponential backoff and jitter for up to `retry_seconds`."""
        return Retrying(retry=retry_if_exception(lambda exc: isinstance(exc, RemoteError) and exc.transient),
                        stop=stop_after_delay(self.retry_seconds if retry_seconds is None else retry_seconds),
                        wait=wait_exponential_jitter(initial=0.25, max=5.0), before_sleep=self._say_retry,
                        reraise=True)

    def _say_retry(self, state: RetryCallState) -> None:
        if self._on_retry is not None and state.outcome is not None and state.next_action is not None:
            self._on_retry(f"{state.outcome.exception()}; retrying in {state.next_action.sleep:.1f}s "
                           f"(attempt {state.attempt_number + 1})")

    def _request(self, method: str, url: str, *, replayable: bool | None = None,
                 retry_seconds: float | None = None, **kwargs: Any) -> httpx.Response:
        """One call, retried while the server is unreachable. `replayable`: whether a request that may
        have reached the server can be sent again (default: reads can)."""
        replayable = method == "GET" if replayable is None else replayable
        for attempt in self._retrying(retry_seconds):
            with attempt:
                try:
                    response = self._http.request(method, url, **kwargs)
                except httpx.TransportError as exc:
                    raise RemoteError(f"cannot reach {self._http.base_url}: {exc}",
                                      transient=replayable or isinstance(exc, _NEVER_SENT)) from exc
                except httpx.HTTPError as exc:
                    raise RemoteError(f"cannot reach {self._http.base_url}: {exc}") from exc
                _raise_for_error(response, transient=replayable)
        return response

    def _object(self, model: type[_M], response: httpx.Response) -> _M:
        """The response's JSON as `model` (the one typed definition, batchinfer.wire); RemoteError when the
        server answered something else."""
        try:
            return model.model_validate_json(response.content)
        except ValidationError as exc:
            raise RemoteError(f"{response.request.url} answered no {model.__name__}: "
                              f"{exc.errors()[0]['msg']}", status_code=response.status_code) from None

    def upload(self, path: str | Path, *, purpose: str = "batch") -> FileObject:
        """Upload a JSONL file (streamed from disk); returns the File object."""
        path = Path(path)
        with path.open("rb") as fh:
            files = {"file": (path.name, fh, "application/jsonl")}
            answer = self._request("POST", "/files", data={"purpose": purpose}, files=files,
                                   timeout=UPLOAD_TIMEOUT, replayable=False)
            return self._object(FileObject, answer)

    def create_batch(self, input_file_id: str, *, endpoint: str | None = None, completion_window: str = "24h",
                     metadata: dict[str, str] | None = None, model: str | None = None,
                     idempotency_key: str | None = None, on_invalid: str | None = None,
                     priority: int | None = None, shard_size: int | None = None,
                     max_total_tokens: int | None = None, result_cache: str | None = None) -> BatchObject:
        """Create a batch from an uploaded file; returns the Batch object.

        With `idempotency_key` the server returns the batch it first created under that key (a retried
        nightly submit does not run twice), so the create is retried like a read."""
        body: dict[str, object] = {"input_file_id": input_file_id, "endpoint": endpoint,
                                "completion_window": completion_window}  # endpoint None: lines may mix both
        extensions = {"metadata": metadata or None, "model": model or None, "on_invalid": on_invalid,
                      "priority": priority, "shard_size": shard_size, "max_total_tokens": max_total_tokens,
                      "result_cache": result_cache}
        body.update({key: value for key, value in extensions.items() if value is not None})
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self._object(BatchObject, self._request("POST", "/batches", json=body, headers=headers,
                                                       replayable=idempotency_key is not None))

    def submit(self, path: str | Path, *, model: str | None = None, metadata: dict[str, str] | None = None,
               completion_window: str = "24h", endpoint: str | None = None,
               idempotency_key: str | None = None, on_invalid: str | None = None,
               priority: int | None = None, shard_size: int | None = None,
               max_total_tokens: int | None = None, result_cache: str | None = None) -> BatchObject:
        """Upload `path` and create a batch from it; returns the Batch object.

        Without `endpoint` each line may use either endpoint (as `batchinfer submit` does locally)."""
        uploaded = self.upload(path)
        return self.create_batch(uploaded.id, endpoint=endpoint,
                                 completion_window=completion_window, metadata=metadata, model=model,
                                 idempotency_key=idempotency_key, on_invalid=on_invalid, priority=priority,
                                 shard_size=shard_size, max_total_tokens=max_total_tokens,
                                 result_cache=result_cache)

    def get(self, batch_id: str, *, retry_seconds: float | None = None) -> BatchObject:
        """The Batch object of `batch_id` (retried for `retry_seconds`, default the client's)."""
        answer = self._request("GET", f"/batches/{batch_id}", retry_seconds=retry_seconds)
        return self._object(BatchObject, answer)

    def list(self, limit: int = 20, after: str | None = None) -> BatchList:
        """Up to `limit` batches, newest first, as one OpenAI list object (pages of 100 fetched as needed)."""
        data: list[BatchObject] = []
        page = BatchList(data=[], has_more=True)
        while len(data) < limit and page.has_more:
            params: dict[str, str | int] = {"limit": min(MAX_PAGE, limit - len(data))}
            if after:
                params["after"] = after
            page = self._object(BatchList, self._request("GET", "/batches", params=params))
            data.extend(page.data)
            after = page.last_id
            if not page.data:
                break
        return BatchList(data=data, first_id=data[0].id if data else None,
                         last_id=data[-1].id if data else None, has_more=page.has_more)

    def cancel(self, batch_id: str) -> BatchObject:
        """Ask the server to cancel `batch_id`; returns the Batch object (cancelling or cancelled)."""
        return self._object(BatchObject, self._request("POST", f"/batches/{batch_id}/cancel",
                                                       replayable=True))  # idempotent

    def retry(self, batch_id: str, *, only: builtins.list[str] | None = None,
              include_invalid: bool = False) -> BatchObject:
        """A child batch of `batch_id`'s failed / expired / cancelled lines; returns its Batch object."""
        body = {"only": only, "include_invalid": include_invalid}
        return self._object(BatchObject, self._request("POST", f"/batches/{batch_id}/retry", json=body,
                                                       replayable=False))

    def file(self, file_id: str) -> FileObject:
        """The File object of `file_id`."""
        return self._object(FileObject, self._request("GET", f"/files/{file_id}"))

    def content(self, file_id: str) -> Iterator[bytes]:
        """The lines of a file's content (each with its trailing newline), streamed; opening the stream is
        retried like any read, a failure once lines have come is not (they cannot be taken back)."""
        for attempt in self._retrying(None):
            with attempt:
                try:
                    request = self._http.build_request("GET", f"/files/{file_id}/content",
                                                       timeout=UPLOAD_TIMEOUT)
                    response = self._http.send(request, stream=True)
                except httpx.TransportError as exc:
                    raise RemoteError(f"cannot reach {self._http.base_url}: {exc}", transient=True) from exc
                if response.is_error:
                    response.read()
                    response.close()
                    _raise_for_error(response, transient=True)
        try:
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
        finally:
            response.close()


def _raise_for_error(response: httpx.Response, *, transient: bool = False) -> None:
    """Raise RemoteError for an error answer; a 502/503/504 is transient when `transient` allows."""
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
                      param=error.get("param"), code=error.get("code"),
                      transient=transient and response.status_code in _RETRY_STATUSES)
