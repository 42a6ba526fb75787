"""Writing a job's result lines: atomically to a file (temp file + rename) or to stdout.

A failed export (unknown batch, server gone mid-download) leaves neither a half-written file nor a temp
file behind: the destination keeps what it had.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchinfer.cli.backend import Backend


def write_lines(lines: Iterator[bytes], path: Path | None) -> int:
    """Write lines atomically to `path`, or to stdout when `path` is None; returns the count."""
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
    try:
        with tmp.open("wb") as out:
            for line in lines:
                out.write(line)
                count += 1
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return count


def write_error_lines(lines: Iterator[bytes], path: Path) -> int:
    """Write error lines to `path` only when there are some (OpenAI makes no error file when no request
    failed); a file already at `path` is emptied rather than left holding an earlier run's errors."""
    lines = iter(lines)
    first = next(lines, None)
    if first is None:
        if path.exists():
            write_lines(iter(()), path)
        return 0
    return write_lines(itertools.chain([first], lines), path)


def default_errors_path(output: Path) -> Path:
    """OUTPUT with `.errors` before its suffix: results.jsonl -> results.errors.jsonl."""
    return output.with_name(output.stem + ".errors" + (output.suffix or ".jsonl"))


def export(backend: Backend, batch_id: str, output: Path | None, errors: Path | None) -> tuple[int, int]:
    """Write the output lines to `output` (stdout when None) and the error lines to `errors` (when given);
    returns (output lines, error lines)."""
    written = write_lines(backend.results(batch_id, "output"), output)
    failed = 0
    if errors is not None:
        failed = write_lines(backend.results(batch_id, "errors"), errors)
    return written, failed
