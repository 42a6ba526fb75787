"""`batchinfer retry batch_N`: a child batch of the lines of a finished batch that failed, expired or were
cancelled (store/retry.py); lines whose input is invalid are named and left out unless asked for."""

from __future__ import annotations

import click

from batchinfer.cli.backend import BackendError, backend_for
from batchinfer.cli.context import cli_settings, server_option
from batchinfer.cli.output import emit, fail, json_option

KINDS = ("failed", "expired", "cancelled")


def _kinds(value: str | None) -> list[str] | None:
    if value is None:
        return None
    kinds = [kind.strip() for kind in value.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        fail(f"--only: {unknown[0] if unknown else value!r} is not a kind of line to retry; give a comma "
             f"list of {', '.join(KINDS)}")
    return kinds


@click.command()
@click.argument("batch_id")
@click.option("--only", default=None, metavar="KINDS",
              help="Comma list of failed, expired, cancelled (default: all three).")
@click.option("--include-invalid", is_flag=True,
              help="Also retry lines whose input was invalid (they fail again unless the file was fixed).")
@server_option
@json_option("Print the child batch object as JSON (with `retry`: of, lines, left_out).")
def retry(batch_id: str, only: str | None, include_invalid: bool, as_json: bool) -> None:
    """Run a finished batch's failed / expired / cancelled lines again as a new batch (its metadata names
    the parent: retry_of)."""
    kinds = _kinds(only)
    try:
        child = backend_for(cli_settings()).retry(batch_id, only=kinds, include_invalid=include_invalid)
    except BackendError as exc:
        fail(str(exc))
    left_out = child.retry.left_out if child.retry is not None else []
    lines = child.retry.lines if child.retry is not None else child.request_counts.total
    text = f"{child.id}: retrying {lines} line(s) of {batch_id}"
    if left_out:
        named = ", ".join(f"line {item.line} ({item.code})" for item in left_out[:10])
        more = f" and {len(left_out) - 10} more" if len(left_out) > 10 else ""
        text += f"; left out (invalid input, --include-invalid retries them): {named}{more}"
    emit(child.model_dump(mode="json"), text)
