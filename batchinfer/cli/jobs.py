"""Job commands: submit, status, list, results, cancel (`run`, the whole job in this process: run_cmd.py).

Each talks to the database, or to a server with --server / BATCHINFER_SERVER (backend.py). Exit codes
(0 done, 1 error, 2 usage, 3 partial, 4 failed, 5 cancelled, 6 expired, 7 --wait timed out): output.py.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from batchinfer.cli.backend import Backend, BackendError, backend_for
from batchinfer.cli.context import cli_settings, server_option
from batchinfer.cli.output import (
    EXIT_CANCELLED,
    EXIT_EXPIRED,
    EXIT_FAILED,
    EXIT_PARTIAL,
    EXIT_TIMEOUT,
    emit,
    fail,
    input_file,
    json_option,
)
from batchinfer.cli.progress import DEFAULT_UPDATE_INTERVAL_S, JobProgress
from batchinfer.cli.result_files import export as _export
from batchinfer.wire.batch import BatchObject, OperatorBatch


def exit_code_for(batch: BatchObject) -> int:
    """How a finished job maps to the process exit code (see the module docstring)."""
    status = batch.status
    if status == "completed":
        return EXIT_PARTIAL if batch.request_counts.failed else 0
    return {"failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED, "expired": EXIT_EXPIRED}.get(status, 0)


def _metadata(pairs: tuple[str, ...]) -> dict[str, str] | None:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not key=value", param_hint="--metadata")
        out[key] = value
    return out or None


def _fail(message: str) -> None:
    fail(message)  # one line, or a JSON object under --json (output.py)


def _check_window(window: str) -> None:
    """Exit 1 with one line when --completion-window is not a window the store accepts."""
    from batchinfer.store.errors import JobError
    from batchinfer.store.jobs import parse_completion_window

    try:
        parse_completion_window(window)
    except JobError as exc:
        _fail(f"--completion-window: {exc}")


def _print_batch(batch: BatchObject, as_json: bool, *, show_owner: bool = False) -> None:
    """One line per batch (its owner named when it is not the CLI's own `local`, or `show_owner`)."""
    from batchinfer.store import LOCAL_OWNER

    if as_json:
        click.echo(batch.model_dump_json())
        return
    counts, progress = batch.request_counts, batch.progress
    owner = batch.owner if isinstance(batch, OperatorBatch) else None
    line = (f"{batch.id}  {batch.status:<11}  {counts.completed}/{counts.total} done, "
            f"{counts.failed} failed")
    if owner is not None and (show_owner or owner != LOCAL_OWNER):
        line += f", owner {owner}"
    if progress.tokens_per_second:
        line += f", {progress.tokens_per_second:.1f} tok/s"
    if progress.eta_seconds:
        line += f", ETA {progress.eta_seconds:.0f}s"
    cache = batch.result_cache  # store/result_cache.py: lines not computed for this job
    if cache is not None and (cache.hits or cache.dedups):
        line += f", {cache.hits} from the result cache, {cache.dedups} copied from identical lines"
    click.echo(line)
    if progress.note:
        click.echo(f"  note: {progress.note}")
    for error in batch.line_errors[:20]:
        message = error.message or ""
        where = f"line {error.line}: " if error.line and not message.startswith(f"line {error.line}:") else ""
        click.echo(f"  {where}{message}")


def _wait(backend: Backend, batch: BatchObject, *, timeout: float | None, quiet: bool,
          update_interval: float = DEFAULT_UPDATE_INTERVAL_S) -> BatchObject:
    """Poll until the job ends: a bar on a terminal, else a line every `update_interval` s (progress.py)."""
    from batchinfer.store.models import JOB_TERMINAL_STATUSES  # lazily, like every store import of the CLI

    counts = batch.request_counts
    deadline = time.monotonic() + timeout if timeout else None
    with JobProgress(total=counts.total, done=counts.completed + counts.failed,
                     description="waiting", enabled=not quiet, interval_s=update_interval,
                     label=batch.id) as bar:
        while batch.status not in JOB_TERMINAL_STATUSES:
            if deadline is not None and time.monotonic() > deadline:
                fail(f"timed out waiting for {batch.id} ({batch.status})", code=EXIT_TIMEOUT,
                     type="timeout")
            time.sleep(0.5)
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.5)
            try:
                batch = backend.get(batch.id, patient=True, within_s=remaining)  # outlasts a restart
            except BackendError as exc:
                if deadline is None or time.monotonic() < deadline:
                    raise
                fail(f"timed out waiting for {batch.id} ({batch.status}; last poll: {exc})",
                     code=EXIT_TIMEOUT, type="timeout")
            bar.show(batch)  # its counts and measured progress (tokens so far, ETA from the budgets)
    return batch


submit_options = [
    click.option("--model", "-m", default=None,
                 help="Model name, alias or path (default: settings.default_model)."),
    click.option("--shard-size", type=click.IntRange(min=1), default=None, help="Requests per shard."),
    click.option("--priority", type=int, default=0, show_default=True, help="Lower runs first."),
    click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="Attach metadata (repeatable)."),
    click.option("--idempotency-key", default=None,
                 help="A retried submit with this key returns the same job."),
    click.option("--on-invalid", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
                 help="skip: a bad line becomes an errored request; fail: the whole job fails (OpenAI)."),
    click.option("--completion-window", default=None, help="e.g. 24h (default: settings.completion_window)."),
    click.option("--max-total-tokens", type=click.IntRange(min=1), default=None,
                 help="The job's token budget (prompt + completion, all lines): lines past it end with a "
                 "budget_exceeded error, finished lines are kept (default: none)."),
    click.option("--result-cache", type=click.Choice(["use", "refresh", "off"]), default=None,
                 help="use: deterministic lines (temperature 0 or a seed) computed before are served from "
                 "the result cache; refresh: computed again, replacing; off: neither (default: "
                 "settings.result_cache, use)."),
]


_Command = TypeVar("_Command", bound=Callable[..., object])


def _with_submit_options(func: _Command) -> _Command:
    for option in reversed(submit_options):
        func = option(func)
    return func


@click.command()
@click.argument("file", type=click.Path(path_type=Path))  # checked by input_file: exit 1
@_with_submit_options
@server_option
@click.option("--wait", is_flag=True,
              help="Wait for the job to end (progress bar); exit code says how it ended.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
@click.option("--update-interval", type=click.FloatRange(min=0.1), default=DEFAULT_UPDATE_INTERVAL_S,
              show_default=True, metavar="SECONDS",
              help="With --wait and no terminal (cron, Airflow): print a one-line update this often.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --wait: write the results here.")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --wait: write the error lines here.")
@click.option("--quiet", "-q", is_flag=True,
              help="Print only the batch id: ID=$(batchinfer submit -q f.jsonl); the exit code tells more.")
@json_option("Print the batch object as JSON (with --wait: the submitted one, then the final one).")
def submit(file: Path, model: str | None, shard_size: int | None, priority: int, metadata: tuple[str, ...],
           idempotency_key: str | None, on_invalid: str, completion_window: str | None,
           max_total_tokens: int | None, result_cache: str | None, wait: bool,
           timeout: float | None, update_interval: float, output: Path | None, errors: Path | None,
           quiet: bool, as_json: bool) -> None:
    """Submit a JSONL file of requests as a batch job; prints its batch id (with --wait, first)."""
    input_file(file)
    settings = cli_settings()
    if completion_window is not None:
        _check_window(completion_window)  # before a remote upload, which a bad window would orphan
    try:
        backend = backend_for(settings)
        batch = backend.submit(file, model=model or settings.default_model, shard_size=shard_size,
                               priority=priority, metadata=_metadata(metadata),
                               idempotency_key=idempotency_key, on_invalid=on_invalid,
                               completion_window=completion_window, max_total_tokens=max_total_tokens,
                               result_cache=result_cache)
        if quiet and not as_json:
            click.echo(batch.id)  # the bare id, first, whatever follows
        if wait:
            if not quiet or as_json:
                _print_batch(batch, as_json)  # the id first: a wait cut short still says which job it was
            batch = _wait(backend, batch, timeout=timeout, quiet=as_json or quiet,
                          update_interval=update_interval)
            if output is not None:
                _export(backend, batch.id, output, errors)
    except BackendError as exc:
        fail(str(exc), param=exc.field, line=exc.line)  # a bad option: its field and line as data
    if not quiet or as_json:
        _print_batch(batch, as_json)
    elif batch.status == "failed":  # the why, beside the id, for the person reading stderr
        for error in batch.line_errors[:3]:
            click.echo(f"error: {error.message}", err=True)
    if wait or batch.status == "failed":
        sys.exit(exit_code_for(batch))


@click.command()
@click.argument("batch_id")
@server_option
@json_option("Print the batch object as JSON.")
def status(batch_id: str, as_json: bool) -> None:
    """Show a job's status, counts, throughput and ETA (any owner's: locally the CLI is the operator)."""
    try:
        batch = backend_for(cli_settings()).get(batch_id)
    except BackendError as exc:
        _fail(str(exc))
    _print_batch(batch, as_json)


@click.command("list")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--after", default=None, help="Show jobs older than this batch id (pagination).")
@click.option("--owner", default=None, metavar="NAME",
              help="Jobs of this owner (an API key's owner; default: the CLI's own, 'local').")
@click.option("--all-owners", is_flag=True, help="Jobs of every owner (the operator's view), owner shown.")
@server_option
@json_option("One JSON object per line.")
def list_(limit: int, after: str | None, owner: str | None, all_owners: bool, as_json: bool) -> None:
    """List jobs, newest first: the CLI's own (owner 'local'), another owner's, or every owner's."""
    if owner is not None and all_owners:
        _fail("--owner and --all-owners: give one of them (--all-owners already includes every owner)")
    try:
        batches = backend_for(cli_settings()).list(limit=limit, after=after, owner=owner,
                                                   all_owners=all_owners)
    except BackendError as exc:
        _fail(str(exc))
    for batch in batches:
        _print_batch(batch, as_json, show_owner=all_owners or owner is not None)


@click.command()
@click.argument("batch_id")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the output lines here (default: stdout).")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the error lines here.")
@server_option
@json_option("Print a summary object (to stderr when the lines themselves go to stdout).")
def results(batch_id: str, output: Path | None, errors: Path | None, as_json: bool) -> None:
    """Download a job's results (OpenAI batch output lines, input order; any owner's job when local);
    partial while it runs."""
    from batchinfer.store.models import JOB_TERMINAL_STATUSES

    try:
        backend = backend_for(cli_settings())
        batch = backend.get(batch_id)  # an unknown batch fails here, before any file is touched
        written, failed = _export(backend, batch.id, output, errors)
    except BackendError as exc:
        _fail(str(exc))
    counts = batch.request_counts
    partial = batch.status not in JOB_TERMINAL_STATUSES
    summary = {"id": batch.id, "status": batch.status, "partial": partial, "output": output,
               "results": written, "errors": errors, "error_lines": failed,
               "request_counts": counts.model_dump()}
    done = f"wrote {written} results to {output}" + (f", {failed} errors to {errors}" if errors else "")
    emit(summary, done if output is not None else None, err=output is None)
    if partial and not as_json:
        click.echo(f"note: {batch.id} is {batch.status}: this export is partial "
                   f"({counts.completed + counts.failed} of {counts.total} requests done); "
                   "run `batchinfer results` again when it has ended", err=True)


@click.command()
@click.argument("batch_id")
@server_option
@json_option("Print the batch object as JSON.")
def cancel(batch_id: str, as_json: bool) -> None:
    """Cancel a job (cancelling while workers abort, then cancelled; any owner's job when local); finished
    results are kept."""
    try:
        batch = backend_for(cli_settings()).cancel(batch_id)
    except BackendError as exc:
        _fail(str(exc))
    _print_batch(batch, as_json)
