"""Where the job commands send their work: the database directly (local) or a batchinfer server (remote).

Both return the same typed OpenAI Batch objects (batchinfer.wire.batch), so every command prints the same
thing in either mode. Locally the CLI is the trusted operator (README "Security"): `status`, `results`
and `cancel` act on any owner's batch, `list` shows the CLI's own (`local`) unless given an owner or
every owner, and each batch is an OperatorBatch, carrying its `owner`. A refused option is a BackendError
naming its field and input line as data (from the store's JobError, or the server's `param`). Against a
server the key's owner is all one sees.
"""

from __future__ import annotations

import builtins  # `list` is a method name in the clients below
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar

from batchinfer.config import Settings
from batchinfer.store import LOCAL_OWNER
from batchinfer.wire.batch import BatchObject, OperatorBatch, RetryInfo, RetryLeftOut

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from batchinfer.store.models import Job

_P = ParamSpec("_P")
_R = TypeVar("_R")


class BackendError(RuntimeError):
    """A job operation failed; the message says why and what to do, `field` and `line` what was at fault."""

    def __init__(self, message: str, *, field: str | None = None, line: int | None = None) -> None:
        super().__init__(message)
        self.field = field  # the option / body field refused (the store's JobError.field, a server's param)
        self.line = line  # the input line at fault (1-based), when it is about one


class Backend(Protocol):
    """What the job commands need from wherever jobs live."""

    def submit(self, path: Path, *, model: str, shard_size: int | None, priority: int,
               metadata: dict[str, str] | None, idempotency_key: str | None, on_invalid: str,
               completion_window: str | None, max_total_tokens: int | None = None,
               result_cache: str | None = None) -> BatchObject: ...

    def get(self, batch_id: str, *, patient: bool = False,
            within_s: float | None = None) -> BatchObject: ...

    def list(self, *, limit: int, after: str | None, owner: str | None = None,
             all_owners: bool = False) -> list[BatchObject]: ...

    def cancel(self, batch_id: str) -> BatchObject: ...

    def retry(self, batch_id: str, *, only: builtins.list[str] | None,
              include_invalid: bool) -> BatchObject: ...

    def results(self, batch_id: str, kind: str) -> Iterator[bytes]: ...


def prepare_database(settings: Settings, *, migrate: bool = False) -> str:
    """The database URL, ready: an SQLite file gets its data_dir and is migrated on first use; another
    database is migrated only with `migrate` (`batchinfer db upgrade` is its usual way)."""
    from batchinfer.store.db import upgrade

    url = settings.effective_database_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    if migrate or url.startswith("sqlite"):
        upgrade(url)
    return url


class LocalBackend:
    """Jobs in the configured database (SQLite by default); migrates an SQLite file on first use."""

    def __init__(self, settings: Settings, *, migrate: bool = False) -> None:
        from batchinfer.store.db import session_factory

        self.settings = settings
        self.sessions = session_factory(prepare_database(settings, migrate=migrate))

    def _job_id(self, batch_id: str) -> int:
        from batchinfer.store.serialize import parse_batch_id

        job_id = parse_batch_id(batch_id) or (int(batch_id) if batch_id.isdigit() else None)
        if job_id is None:
            raise BackendError(f"{batch_id!r} is not a batch id; batch ids look like batch_42")
        return job_id

    def _batch(self, job: Job, session: Session) -> OperatorBatch:
        from batchinfer.store.serialize import current_batch_object

        return OperatorBatch.model_construct(**dict(current_batch_object(session, job)), owner=job.owner)

    def submit(self, path: Path, *, model: str, shard_size: int | None, priority: int,
               metadata: dict[str, str] | None, idempotency_key: str | None, on_invalid: str,
               completion_window: str | None, max_total_tokens: int | None = None,
               result_cache: str | None = None, served_names: frozenset[str] | None = None,
               adapter_names: frozenset[str] = frozenset()) -> BatchObject:
        """Ingest `path` as a job and announce its shards when a broker is configured (`served_names`,
        `adapter_names`: the job runs in this process, see store.line_models)."""
        from batchinfer.store.errors import JobError  # a bad argument (window, metadata, on_invalid, ...)
        from workers.dispatch import broker_problem, submit_and_announce

        problem = broker_problem(self.settings.broker_url) if self.settings.broker_url else None
        if problem:  # refused before the job exists: no job waits on a broker nobody will reach
            raise BackendError(problem)
        with self.sessions() as session:
            try:
                job = submit_and_announce(session=session, settings=self.settings, path=path, model=model,
                                          owner=LOCAL_OWNER, shard_size=shard_size, priority=priority,
                                          metadata=metadata, idempotency_key=idempotency_key,
                                          on_invalid=on_invalid, completion_window=completion_window,
                                          max_total_tokens=max_total_tokens, result_cache=result_cache,
                                          served_names=served_names, adapter_names=adapter_names)
            except JobError as exc:
                raise BackendError(exc.located(), field=exc.field, line=exc.line) from None
            return self._batch(job, session)

    def fail_unstarted(self, batch_id: str, message: str) -> None:
        """Mark a job failed whose runner never started in this process (`batchinfer run`)."""
        from batchinfer.store.jobs import fail_unstarted_job

        with self.sessions() as session:
            fail_unstarted_job(session, job_id=self._job_id(batch_id), code="engine_error", message=message)

    def get(self, batch_id: str, *, patient: bool = False, within_s: float | None = None) -> BatchObject:
        """The batch object of one job, whoever owns it (`patient` and `within_s` matter only to a server)."""
        from batchinfer.store.jobs import get_job

        with self.sessions() as session:
            job = get_job(session, job_id=self._job_id(batch_id))
            if job is None:
                raise BackendError(f"batch {batch_id} not found")
            return self._batch(job, session)

    def list(self, *, limit: int, after: str | None, owner: str | None = None,
             all_owners: bool = False) -> list[BatchObject]:
        """Newest jobs first: of `owner` (default the CLI's own, `local`), or of every owner."""
        from batchinfer.store.jobs import list_jobs

        with self.sessions() as session:
            after_id = self._job_id(after) if after else None
            jobs = list_jobs(session, owner=None if all_owners else owner or LOCAL_OWNER, after=after_id,
                             limit=limit)
            return [self._batch(job, session) for job in jobs]

    def cancel(self, batch_id: str) -> BatchObject:
        """Cancel a job, whoever owns it; finished results are kept."""
        from batchinfer.store.errors import JobNotFound, JobStateError
        from batchinfer.store.jobs import cancel_job

        with self.sessions() as session:
            try:
                job = cancel_job(session, job_id=self._job_id(batch_id))
            except JobNotFound:
                raise BackendError(f"batch {batch_id} not found") from None
            except JobStateError as exc:
                raise BackendError(str(exc)) from None
            return self._batch(job, session)

    def retry(self, batch_id: str, *, only: builtins.list[str] | None,
              include_invalid: bool) -> BatchObject:
        """A child job of the batch's failed / expired / cancelled lines (store.retry), any owner's; the
        batch object with `retry: {of, lines, left_out}`."""
        from batchinfer.store.errors import JobError, JobNotFound
        from batchinfer.store.retry import retry_input
        from workers.dispatch import submit_and_announce

        with self.sessions() as session:
            try:
                child = retry_input(session, job_id=self._job_id(batch_id), only=only,
                                    include_invalid=include_invalid)
                job = submit_and_announce(session=session, settings=self.settings, stream=child.stream,
                                          **child.submit_args)
            except JobNotFound:
                raise BackendError(f"batch {batch_id} not found") from None
            except JobError as exc:
                raise BackendError(exc.located(), field=exc.field, line=exc.line) from None
            retry = RetryInfo(of=batch_id, lines=len(child.lines),
                              left_out=[RetryLeftOut.model_validate(line) for line in child.left_out])
            return self._batch(job, session).model_copy(update={"retry": retry})

    def results(self, batch_id: str, kind: str) -> Iterator[bytes]:
        """The output (kind="output"), error (kind="errors") or both (kind="all") lines, in input order."""
        from batchinfer.store.export import export_results

        job_id = self._job_id(batch_id)
        self.get(batch_id)  # raises when the job does not exist
        with self.sessions() as session:
            # kind: a str from click.Choice(output, errors, all), export_results' ExportKind
            yield from export_results(session, job_id=job_id, kind=kind)  # type: ignore[arg-type]


class RemoteBackend:
    """Jobs on a batchinfer server, over its OpenAI-compatible REST API."""

    def __init__(self, server: str, api_key: str | None, *, patience_seconds: float = 120.0) -> None:
        from batchinfer.cli.remote import RemoteClient

        self.client = RemoteClient(server, api_key, on_retry=_say_retry)
        self.patience_seconds = patience_seconds  # how long a --wait poll retries a restarting server

    def _call(self, method: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        from batchinfer.cli.remote import RemoteError

        try:
            return method(*args, **kwargs)
        except RemoteError as exc:
            raise BackendError(str(exc), field=exc.param) from None

    def submit(self, path: Path, *, model: str, shard_size: int | None, priority: int,
               metadata: dict[str, str] | None, idempotency_key: str | None, on_invalid: str,
               completion_window: str | None, max_total_tokens: int | None = None,
               result_cache: str | None = None) -> BatchObject:
        """Upload the file and create a batch with the same options a local submit takes."""
        return self._call(self.client.submit, path, model=model, metadata=metadata,
                          completion_window=completion_window or "24h", idempotency_key=idempotency_key,
                          on_invalid=on_invalid, priority=priority, shard_size=shard_size,
                          max_total_tokens=max_total_tokens, result_cache=result_cache)

    def get(self, batch_id: str, *, patient: bool = False, within_s: float | None = None) -> BatchObject:
        """The batch object from the server; `patient` (a --wait poll) outlasts a server restart, retrying
        for at most `within_s` seconds when given (what is left of a --timeout)."""
        retry_seconds = self.patience_seconds if patient else None
        if within_s is not None:
            retry_seconds = min(retry_seconds if retry_seconds is not None else within_s, within_s)
        return self._call(self.client.get, batch_id, retry_seconds=retry_seconds)

    def list(self, *, limit: int, after: str | None, owner: str | None = None,
             all_owners: bool = False) -> list[BatchObject]:
        """Newest batches first (the key's own: a server shows nothing else)."""
        if owner is not None or all_owners:
            raise BackendError("--owner / --all-owners read the database directly, as its operator: run "
                               "them without --server where the database is reachable (through a server, "
                               "an admin key's dashboard shows every owner)")
        return self._call(self.client.list, limit=limit, after=after).data

    def cancel(self, batch_id: str) -> BatchObject:
        """Ask the server to cancel."""
        return self._call(self.client.cancel, batch_id)

    def retry(self, batch_id: str, *, only: builtins.list[str] | None,
              include_invalid: bool) -> BatchObject:
        """Ask the server for a child batch of the batch's failed / expired / cancelled lines."""
        return self._call(self.client.retry, batch_id, only=only, include_invalid=include_invalid)

    def results(self, batch_id: str, kind: str) -> Iterator[bytes]:
        """Stream the output or error file the server generated for the batch."""
        batch = self.get(batch_id)
        file_id = batch.output_file_id if kind == "output" else batch.error_file_id
        if file_id is None:
            return iter(())
        return self._stream(file_id)

    def _stream(self, file_id: str) -> Iterator[bytes]:
        from batchinfer.cli.remote import RemoteError

        try:
            yield from self.client.content(file_id)
        except RemoteError as exc:  # raised while iterating, so _call cannot see it
            raise BackendError(str(exc)) from None


def _say_retry(message: str) -> None:
    """Tell a person (not a --json reader: stderr stays errors only) that the server is being retried."""
    import click

    from batchinfer.cli.output import json_mode

    if not json_mode():
        click.echo(f"server unreachable: {message}", err=True)


def backend_for(settings: Settings) -> Backend:
    """Remote when a server is configured (--server / BATCHINFER_SERVER), else the local database."""
    if settings.server:
        key = settings.api_key.get_secret_value() if settings.api_key else None
        return RemoteBackend(settings.server, key, patience_seconds=settings.server_retry_seconds)
    return LocalBackend(settings)
