"""Job commands: submit, status, list, results, cancel, and `run` (the whole job in this process).

Exit codes (for scripts and schedulers): 0 the job completed with no failed request (or the command
succeeded); 1 an error (bad arguments, file not found, server unreachable); 3 the job completed but some
requests failed; 4 the job failed; 5 it was cancelled; 6 it expired; 7 --wait timed out.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import orjson

from batchinfer.cli.backend import BackendError, backend_for
from batchinfer.cli.progress import JobProgress
from batchinfer.config import get_settings

EXIT_ERROR, EXIT_PARTIAL, EXIT_FAILED, EXIT_CANCELLED, EXIT_EXPIRED, EXIT_TIMEOUT = 1, 3, 4, 5, 6, 7


def exit_code_for(batch: dict[str, Any]) -> int:
    """How a finished job maps to the process exit code (see the module docstring)."""
    status = batch["status"]
    if status == "completed":
        return EXIT_PARTIAL if batch["request_counts"]["failed"] else 0
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
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_ERROR)


def _print_batch(batch: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(orjson.dumps(batch).decode())
        return
    counts = batch["request_counts"]
    progress = batch.get("progress") or {}
    line = (f"{batch['id']}  {batch['status']:<11}  {counts['completed']}/{counts['total']} done, "
            f"{counts['failed']} failed")
    if progress.get("tokens_per_second"):
        line += f", {progress['tokens_per_second']:.1f} tok/s"
    if progress.get("eta_seconds"):
        line += f", ETA {progress['eta_seconds']:.0f}s"
    click.echo(line)
    for error in ((batch.get("errors") or {}).get("data") or [])[:20]:
        message = error["message"] or ""
        where = f"line {error['line']}: " if error.get("line") and not message.startswith("line ") else ""
        click.echo(f"  {where}{message}")


def _write_lines(lines: Iterator[bytes], path: Path | None) -> int:
    """Write lines atomically to `path` (temp file + rename), or to stdout; returns the count."""
    count = 0
    if path is None:
        out = sys.stdout.buffer
        for line in lines:
            out.write(line)
            count += 1
        out.flush()
        return count
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as out:
        for line in lines:
            out.write(line)
            count += 1
    tmp.replace(path)
    return count


def _default_errors_path(output: Path) -> Path:
    return output.with_name(output.stem + ".errors" + (output.suffix or ".jsonl"))


def _export(backend: Any, batch_id: str, output: Path | None, errors: Path | None) -> tuple[int, int]:
    written = _write_lines(backend.results(batch_id, "output"), output)
    failed = 0
    if errors is not None:
        failed = _write_lines(backend.results(batch_id, "errors"), errors)
    return written, failed


def _wait(backend: Any, batch: dict[str, Any], *, timeout: float | None, quiet: bool) -> dict[str, Any]:
    from batchinfer.store.models import JOB_TERMINAL_STATUSES  # lazily, like every store import of the CLI

    counts = batch["request_counts"]
    deadline = time.monotonic() + timeout if timeout else None
    with JobProgress(total=counts["total"], done=counts["completed"] + counts["failed"],
                     description="waiting", enabled=not quiet) as bar:
        while batch["status"] not in JOB_TERMINAL_STATUSES:
            if deadline is not None and time.monotonic() > deadline:
                click.echo(f"timed out waiting for {batch['id']} ({batch['status']})", err=True)
                sys.exit(EXIT_TIMEOUT)
            time.sleep(0.5)
            batch = backend.get(batch["id"])
            counts = batch["request_counts"]
            bar.set(done=counts["completed"] + counts["failed"], tokens=batch["usage"]["output_tokens"],
                    total=counts["total"])
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
]


def _with_submit_options(func: Any) -> Any:
    for option in reversed(submit_options):
        func = option(func)
    return func


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_with_submit_options
@click.option("--wait", is_flag=True,
              help="Wait for the job to end (progress bar); exit code says how it ended.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --wait: write the results here.")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --wait: write the error lines here.")
@click.option("--json", "as_json", is_flag=True, help="Print the batch object as JSON.")
def submit(file: Path, model: str | None, shard_size: int | None, priority: int, metadata: tuple[str, ...],
           idempotency_key: str | None, on_invalid: str, completion_window: str | None, wait: bool,
           timeout: float | None, output: Path | None, errors: Path | None, as_json: bool) -> None:
    """Submit a JSONL file of requests as a batch job."""
    settings = get_settings()
    try:
        backend = backend_for(settings)
        batch = backend.submit(file, model=model or settings.default_model, shard_size=shard_size,
                               priority=priority, metadata=_metadata(metadata),
                               idempotency_key=idempotency_key, on_invalid=on_invalid,
                               completion_window=completion_window)
        if wait:
            batch = _wait(backend, batch, timeout=timeout, quiet=as_json)
            if output is not None:
                _export(backend, batch["id"], output, errors)
    except BackendError as exc:
        _fail(str(exc))
    _print_batch(batch, as_json)
    if wait or batch["status"] == "failed":
        sys.exit(exit_code_for(batch))


@click.command()
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="Print the batch object as JSON.")
def status(batch_id: str, as_json: bool) -> None:
    """Show a job's status, counts, throughput and ETA."""
    try:
        batch = backend_for(get_settings()).get(batch_id)
    except BackendError as exc:
        _fail(str(exc))
    _print_batch(batch, as_json)


@click.command("list")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--after", default=None, help="Show jobs older than this batch id (pagination).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def list_(limit: int, after: str | None, as_json: bool) -> None:
    """List jobs, newest first."""
    try:
        batches = backend_for(get_settings()).list(limit=limit, after=after)
    except BackendError as exc:
        _fail(str(exc))
    for batch in batches:
        _print_batch(batch, as_json)


@click.command()
@click.argument("batch_id")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the output lines here (default: stdout).")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the error lines here.")
def results(batch_id: str, output: Path | None, errors: Path | None) -> None:
    """Download a job's results (OpenAI batch output lines, input order)."""
    try:
        written, failed = _export(backend_for(get_settings()), batch_id, output, errors)
    except BackendError as exc:
        _fail(str(exc))
    if output is not None:
        click.echo(f"wrote {written} results to {output}"
                   + (f", {failed} errors to {errors}" if errors else ""), err=True)


@click.command()
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="Print the batch object as JSON.")
def cancel(batch_id: str, as_json: bool) -> None:
    """Cancel a job; results already finished are kept."""
    try:
        batch = backend_for(get_settings()).cancel(batch_id)
    except BackendError as exc:
        _fail(str(exc))
    _print_batch(batch, as_json)


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where the results go (OpenAI batch output lines).")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where error lines go (default: OUTPUT with .errors before the suffix).")
@_with_submit_options
@click.option("--device", default=None, help="cpu, cuda, cuda:N (default: settings.device).")
@click.option("--show", type=int, default=0, help="Print the first N results when done.")
@click.option("--json", "as_json", is_flag=True, help="Print the final batch object as JSON.")
def run(file: Path, output: Path, errors: Path | None, model: str | None, shard_size: int | None,
        priority: int, metadata: tuple[str, ...], idempotency_key: str | None, on_invalid: str,
        completion_window: str | None, device: str | None, show: int, as_json: bool) -> None:
    """Run a JSONL file end to end in this process: submit, infer, export (no broker needed)."""
    from batchinfer.cli.backend import LocalBackend
    from workers.process import make_runner, run_job

    settings = get_settings()
    model = model or settings.default_model
    errors = errors or _default_errors_path(output)
    backend = LocalBackend(settings)
    try:
        batch = backend.submit(file, model=model, shard_size=shard_size, priority=priority,
                               metadata=_metadata(metadata), idempotency_key=idempotency_key,
                               on_invalid=on_invalid, completion_window=completion_window)
    except BackendError as exc:
        _fail(str(exc))
    if batch["status"] == "in_progress":
        if not as_json:
            click.echo(f"{batch['id']}: {batch['request_counts']['total']} requests; loading {model} ...",
                       err=True)
        overrides = {"device": device} if device else {}
        runner = make_runner(model=model, settings=settings, **overrides)
        counts = batch["request_counts"]
        with JobProgress(total=counts["total"], done=counts["completed"] + counts["failed"],
                         enabled=not as_json) as bar:
            run_job(job_id=int(batch["id"].removeprefix("batch_")), runner=runner, on_progress=bar.advance)
        batch = backend.get(batch["id"])
    written, failed = _export(backend, batch["id"], output, errors)
    if as_json:
        click.echo(orjson.dumps(batch).decode())
    else:
        _print_batch(batch, False)
        click.echo(f"results: {output} ({written} lines)"
                   + (f"; errors: {errors} ({failed} lines)" if failed else ""))
        _show(output, show)
    sys.exit(exit_code_for(batch))


def _show(path: Path, count: int) -> None:
    if count <= 0 or not path.exists():
        return
    with path.open("rb") as lines:
        for _, raw in zip(range(count), lines, strict=False):
            line = orjson.loads(raw)
            body = line["response"]["body"]
            choice = body["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            tokens = body["usage"]["completion_tokens"]
            click.echo(f"--- {line['custom_id']} ({choice['finish_reason']}, {tokens} tokens)")
            click.echo(text.strip())
