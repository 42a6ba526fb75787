"""The store's errors: one base, so a caller that only reports can catch JobError alone.

A JobError names what was wrong as data: `field` (the argument or body field, OpenAI's `param`) and `line`
(the input line, 1-based) when it is about one; callers map them (the API's error handler to `param`, the
CLI to its error object) instead of parsing the message. A route or CLI command that answers differently
(404 / 409 / 400) catches the subclasses first.
"""

from __future__ import annotations


class JobError(ValueError):
    """A job operation that cannot be done: an invalid argument, or one of the subclasses below."""

    def __init__(self, message: str, *, field: str | None = None, line: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field  # the argument / body field at fault (OpenAI's `param`), None: not one field
        self.line = line  # the input line at fault (1-based), None: not one line

    def located(self) -> str:
        """The message, prefixed with `line N: ` when it is about one line (and does not say so yet)."""
        prefix = f"line {self.line}: "
        if self.line is None or self.message.startswith(prefix):
            return self.message
        return prefix + self.message


class JobNotFound(JobError):
    """No such job (or it belongs to another owner, which callers must not be able to tell apart)."""


class JobStateError(JobError):
    """The job exists but its status does not allow the operation (e.g. cancelling a completed job)."""

    def __init__(self, message: str, *, status: str) -> None:
        super().__init__(message)
        self.status = status  # the job's status when the operation was refused


class LeaseLost(RuntimeError):
    """The shard's lease token no longer matches: another worker (or the rescuer) owns the shard now."""
