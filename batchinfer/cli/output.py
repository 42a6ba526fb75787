"""How every command prints: human text, or with `--json` JSON objects; errors and exit codes.

Under `--json` stdout carries only JSON (one object per line) and an error is one JSON object on stderr,
`{"error": {"message", "type"}, "exit_code": N}`, with the same exit code as without `--json`. Without
it an error is one line, `error: <message>`, on stderr.

Exit codes (for scripts and schedulers): 0 the job completed with no failed request (or the command
succeeded); 1 an error (bad arguments, file not found, unknown job, server unreachable, bad settings);
2 a usage error (unknown option, missing argument); 3 the job completed but some requests failed; 4 the
job failed; 5 it was cancelled; 6 it expired; 7 --wait timed out.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

import click
import orjson
from pydantic import BaseModel, SecretStr

from batchinfer.wire.json_types import JSONValue

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_PARTIAL, EXIT_FAILED, EXIT_CANCELLED, EXIT_EXPIRED, EXIT_TIMEOUT = 3, 4, 5, 6, 7
EXIT_CODES = {
    EXIT_OK: "completed with no failed request (or the command succeeded)",
    EXIT_ERROR: "error (bad arguments, unknown job, unreachable server, bad settings)",
    EXIT_USAGE: "usage error (unknown option or command, missing argument)",
    EXIT_PARTIAL: "completed but some requests failed",
    EXIT_FAILED: "the job failed",
    EXIT_CANCELLED: "cancelled",
    EXIT_EXPIRED: "expired",
    EXIT_TIMEOUT: "--wait --timeout ran out",
}

_JSON_KEY = "batchinfer.json"  # ctx.meta is shared by a command and its parents


def _remember_json(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.meta[_JSON_KEY] = True
    return value


def json_option(help: str = "Print JSON (one object per line); errors as a JSON object on stderr."):  # noqa: A002, ANN201
    """The `--json` flag every command takes (eager, so errors met while parsing are JSON too)."""
    return click.option("--json", "as_json", is_flag=True, is_eager=True, callback=_remember_json, help=help)


def json_mode() -> bool:
    """True when the running command was given --json."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get(_JSON_KEY))


def dumps(value: object) -> str:
    """One line of JSON (datetimes and paths included)."""
    return orjson.dumps(value, default=_default).decode()


def _default(value: object) -> str | JSONValue:
    if isinstance(value, Path | SecretStr):
        return str(value)  # a SecretStr prints masked
    if isinstance(value, BaseModel):  # a typed wire object (batchinfer.wire): the Batch object, say
        return value.model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def emit(value: Mapping[str, object], text: str | None = None, *, err: bool = False) -> None:
    """Print `value` as one JSON line under --json, else `text` (nothing when text is None)."""
    if json_mode():
        click.echo(dumps(value), err=err)
    elif text is not None:
        click.echo(text, err=err)


def stdout_to_stderr() -> None:
    """From now on, whatever this process writes to stdout goes to stderr (fd 1 becomes fd 2).

    For long-running commands under --json: after their JSON start line, the libraries they hand over to
    (Celery's banner and shutdown lines write to sys.__stdout__) cannot break a script reading stdout.
    """
    sys.stdout.flush()
    os.dup2(2, 1)


def error_object(message: str, *, exit_code: int, type: str = "error",  # noqa: A002
                 param: str | None = None, line: int | None = None) -> dict[str, object]:
    """The JSON shape of an error under --json (`param`, `line`: the field and input line at fault)."""
    error: dict[str, str | int | None] = {"message": message, "type": type}
    if param is not None or line is not None:
        error.update(param=param, line=line)
    return {"error": error, "exit_code": exit_code}


def show_error(message: str, *, exit_code: int, type: str = "error", as_json: bool | None = None,  # noqa: A002
               param: str | None = None, line: int | None = None) -> None:
    """Print an error on stderr: one `error:` line, or one JSON object under --json."""
    if json_mode() if as_json is None else as_json:
        click.echo(dumps(error_object(message, exit_code=exit_code, type=type, param=param, line=line)),
                   err=True)
    else:
        click.echo(f"error: {message}", err=True)


def fail(message: str, *, code: int = EXIT_ERROR, type: str = "error",  # noqa: A002
         param: str | None = None, line: int | None = None) -> NoReturn:
    """Print one error and exit with `code` (`param`, `line`: the field and input line at fault)."""
    show_error(message, exit_code=code, type=type, param=param, line=line)
    sys.exit(code)


def input_file(path: Path) -> Path:
    """`path` when it is a readable file, else exit 1 with one line (click's own check exits 2)."""
    if not path.exists():
        fail(f"{path}: no such file")
    if path.is_dir():
        fail(f"{path}: is a directory, not a JSONL file")
    return path
